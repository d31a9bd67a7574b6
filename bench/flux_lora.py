"""LoRA adapters on a Flux-class DiT, resident and streamed by DLO, in one process on one GPU.

Random bf16 weights of the real FluxTransformer2DModel configuration (``flux_dlo.py``'s
helpers) with rank-64 PEFT adapters on every attention projection (random A and B, as a
trained adapter's). Each row is one configuration, timed synchronized (median step) and
back to back: 0 adapters, 1 loaded (active), 4 loaded (one active). Resident first; then
the adapters are unloaded, the DiT goes to host memory, DLO is enabled (rank-local) and
the same adapters are added again, after enable, as the worker adds them.

Printed: each row's step, the adapter's cost (the row minus the 0-adapter row) resident
and under DLO, DLO's extra time over the resident cost as a share of the DLO step, the
bytes DLO streamed per step in each row (adapters stay on the device, so they must be
equal), the time ``set_adapters`` takes to switch the active adapter, and whether the
DLO output equals the resident one bitwise with the same adapter.

    python bench/flux_lora.py --resolution 1024
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from flux_dlo import (
    back_to_back_step_seconds,
    build_flux,
    flux_inputs,
    release,
    step_seconds,
)

RANK = 64
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
NAMES = ["a", "b", "c", "d"]


def add_adapter(model: torch.nn.Module, name: str) -> None:
    """A rank-64 adapter whose weights depend on its name only (seeded), so the resident
    and the DLO model get the same one."""
    from peft import LoraConfig

    torch.manual_seed(NAMES.index(name) + 1)
    config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS, init_lora_weights=False)
    model.add_adapter(config, adapter_name=name)  # type: ignore[operator]


@torch.inference_mode()
def output(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs).sample.cpu()


def timed(model: torch.nn.Module, inputs: dict, repeats: int) -> dict:
    return {
        "step_s": step_seconds(model, inputs, repeats),
        "back_to_back_s": back_to_back_step_seconds(model, inputs, repeats),
    }


def switch_seconds(model: torch.nn.Module, repeats: int = 5) -> float:
    """Median time of ``set_adapters`` switching the active adapter (a to b and back)."""
    times = []
    for index in range(2 * repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.set_adapters([NAMES[(index + 1) % 2]])  # type: ignore[operator]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    model.set_adapters(["a"])  # type: ignore[operator]
    return sorted(times)[len(times) // 2]


def measured_row(
    model: torch.nn.Module, inputs: dict, repeats: int, streamed: object | None
) -> dict:
    """:func:`timed`, and under DLO (``streamed``, its backend) the bytes per step."""
    before = streamed.stats().bytes_streamed if streamed is not None else 0  # type: ignore[attr-defined]
    measured = timed(model, inputs, repeats)
    if streamed is not None:
        forwards = 2 * (2 + repeats)  # warmups and repeats of both timings
        after = streamed.stats().bytes_streamed  # type: ignore[attr-defined]
        measured["bytes_streamed_per_step"] = (after - before) / forwards
    print(json.dumps(measured), flush=True)
    return measured


def rows_with_adapters(
    model: torch.nn.Module, inputs: dict, repeats: int, streamed: object | None
) -> tuple[dict, torch.Tensor]:
    """0, 1 and 4 loaded adapters (one active); the output with adapter a."""

    def row() -> dict:
        return measured_row(model, inputs, repeats, streamed)

    rows = {"0 adapters": row()}
    add_adapter(model, "a")
    model.set_adapters(["a"])  # type: ignore[operator]
    rows["1 loaded"] = row()
    with_a = output(model, inputs)
    for name in NAMES[1:]:
        add_adapter(model, name)
    model.set_adapters(["a"])  # type: ignore[operator]
    rows["4 loaded, 1 active"] = row()
    rows["switch_s"] = switch_seconds(model)
    return rows, with_a


def run(args: argparse.Namespace) -> dict:
    from dlo_worker.offload import enable_dlo

    device = torch.device("cuda", 0)
    model = build_flux(device)
    inputs = flux_inputs(args.resolution, device)
    resident, resident_a = rows_with_adapters(model, inputs, args.repeats, None)
    model.unload_lora()  # type: ignore[operator]
    model.to("cpu")
    release(device)
    backend = enable_dlo(model, device=device, use_allgather=False)
    try:
        dlo, dlo_a = rows_with_adapters(model, inputs, args.repeats, backend)
    finally:
        backend.disable()
    report: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "resolution": args.resolution,
        "rank": RANK,
        "resident": resident,
        "dlo": dlo,
        "dlo_max_abs_difference_to_resident_with_a": (dlo_a.float() - resident_a.float())
        .abs()
        .max()
        .item(),
    }
    for key in ("step_s", "back_to_back_s"):
        for loaded in ("1 loaded", "4 loaded, 1 active"):
            cost = resident[loaded][key] - resident["0 adapters"][key]
            extra = dlo[loaded][key] - dlo["0 adapters"][key]
            report.setdefault("extra_over_cost_share_of_dlo_step", {})[f"{loaded}, {key}"] = (
                extra - cost
            ) / dlo["0 adapters"][key]
    return report


def print_report(report: dict) -> None:
    size = report["resolution"]
    print(f"\n{report['gpu']}, torch {report['torch']}, {size}x{size}, rank {report['rank']}")
    print("| adapters | resident step | back to back | DLO step | back to back | DLO bytes/step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in ("0 adapters", "1 loaded", "4 loaded, 1 active"):
        resident, dlo = report["resident"][row], report["dlo"][row]
        print(
            f"| {row} | {resident['step_s']:.4f} s | {resident['back_to_back_s']:.4f} s | "
            f"{dlo['step_s']:.4f} s | {dlo['back_to_back_s']:.4f} s | "
            f"{dlo['bytes_streamed_per_step'] / 2**30:.3f} GiB |"
        )
    print(
        f"switch (set_adapters): resident {report['resident']['switch_s'] * 1e3:.1f} ms, "
        f"DLO {report['dlo']['switch_s'] * 1e3:.1f} ms"
    )
    for name, share in report["extra_over_cost_share_of_dlo_step"].items():
        print(f"DLO extra over the resident adapter cost, {name}: {share * 100:+.2f}% of the step")
    print(f"DLO - resident with adapter a: {report['dlo_max_abs_difference_to_resident_with_a']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="Also write the report here.")
    args = parser.parse_args()
    report = run(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
