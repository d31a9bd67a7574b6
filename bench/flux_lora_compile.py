"""LoRA adapters under ``--compile`` on a Flux-class DiT: adapters and scales switched every
step without a recompile, resident and streamed by DLO, in one process on one GPU.

Random bf16 weights of the real FluxTransformer2DModel configuration and four rank-64
adapters (``flux_lora.py``'s), every block compiled as ``--compile`` compiles it
(``compile_blocks``), the adapters chosen per step as the worker chooses them per request
(``dlo_worker.pipeline.lora.AdapterSelection``: every loaded adapter active, its scale a
device tensor the choice fills in). Rows: the compiled step without adapters, then one row
per choice (one adapter, two mixed with scales, none, another adapter), each timed
synchronized (median step) and back to back, resident and under DLO (rank-local, adapters
added after enable, as the worker adds them).

Printed: each row's step, the cost of keeping four adapters loaded (the row minus the
no-adapter row: under --compile every loaded adapter runs), DLO's extra time over that
cost as a share of the DLO step, bytes streamed per step (unchanged by adapters), the time
one switch takes, the recompiles after the first step (must be 0) and whether DLO equals
resident bitwise for every choice.

    python bench/flux_lora_compile.py --resolution 1024
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from flux_dlo import build_flux, flux_inputs, release
from flux_lora import NAMES, add_adapter, measured_row, output

from dlo_worker.config import CompileMode
from dlo_worker.pipeline.compilation import compile_blocks
from dlo_worker.pipeline.lora import AdapterSelection

CHOICES: dict[str, tuple[tuple[str, float], ...]] = {
    "a": (("a", 1.0),),
    "a 0.5 + b -1": (("a", 0.5), ("b", -1.0)),
    "none": (),
    "d 0.3": (("d", 0.3),),
}


def compiled(model: torch.nn.Module, device: torch.device) -> object:
    """``model``'s blocks compiled as ``--compile`` does, from a clean Dynamo."""
    torch._dynamo.reset()
    return compile_blocks(model, CompileMode.DEFAULT, device)


def first_step(model: torch.nn.Module, inputs: dict) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    output(model, inputs)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def switch_seconds(selection: AdapterSelection, model: torch.nn.Module, repeats: int = 5) -> float:
    """Median time of one choice replacing another (a, then a 0.5 + b -1, ...)."""
    choices = list(CHOICES.values())
    times = []
    for index in range(2 * repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        selection.select(model, choices[index % len(choices)])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def rows(
    model: torch.nn.Module,
    inputs: dict,
    repeats: int,
    device: torch.device,
    streamed: object | None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The no-adapter row, then the four adapters added and one row per choice."""

    def row() -> dict:
        return measured_row(model, inputs, repeats, streamed)

    plain = compiled(model, device)
    report: dict = {"first_step_s (0 adapters)": first_step(model, inputs), "0 adapters": row()}
    for name in NAMES:
        add_adapter(model, name)
    selection = AdapterSelection()
    selection.for_compiled_blocks(model, device)
    with_adapters = compiled(model, device)
    selection.select(model, CHOICES["a"])
    report["first_step_s (4 adapters)"] = first_step(model, inputs)
    outputs = {}
    for label, choice in CHOICES.items():
        selection.select(model, choice)
        outputs[label] = output(model, inputs)
        report[label] = row()
    report["switch_s"] = switch_seconds(selection, model)
    report["recompiles"] = with_adapters.recompiles  # type: ignore[attr-defined]
    report["recompiles (0 adapters)"] = plain.recompiles  # type: ignore[attr-defined]
    return report, outputs


def run(args: argparse.Namespace) -> dict:
    from dlo_worker.offload import enable_dlo

    device = torch.device("cuda", 0)
    inputs = flux_inputs(args.resolution, device)
    model = build_flux(device)
    resident, resident_outputs = rows(model, inputs, args.repeats, device, None)
    del model
    release(device)
    model = build_flux(device).to("cpu")
    release(device)
    backend = enable_dlo(model, device=device, use_allgather=False)
    try:
        dlo, dlo_outputs = rows(model, inputs, args.repeats, device, backend)
    finally:
        backend.disable()
    report: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "resolution": args.resolution,
        "resident": resident,
        "dlo": dlo,
        "dlo_max_abs_difference_to_resident": {
            label: (dlo_outputs[label].float() - resident_outputs[label].float()).abs().max().item()
            for label in CHOICES
        },
    }
    for key in ("step_s", "back_to_back_s"):
        for label in CHOICES:
            cost = resident[label][key] - resident["0 adapters"][key]
            extra = dlo[label][key] - dlo["0 adapters"][key]
            report.setdefault("extra_over_cost_share_of_dlo_step", {})[f"{label}, {key}"] = (
                extra - cost
            ) / dlo["0 adapters"][key]
    return report


def print_report(report: dict) -> None:
    size = report["resolution"]
    print(f"\n{report['gpu']}, torch {report['torch']}, {size}x{size}, compiled, 4 adapters")
    print("| choice | resident step | back to back | DLO step | back to back | DLO bytes/step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label in ("0 adapters", *CHOICES):
        resident, dlo = report["resident"][label], report["dlo"][label]
        print(
            f"| {label} | {resident['step_s']:.4f} s | {resident['back_to_back_s']:.4f} s | "
            f"{dlo['step_s']:.4f} s | {dlo['back_to_back_s']:.4f} s | "
            f"{dlo['bytes_streamed_per_step'] / 2**30:.3f} GiB |"
        )
    for side in ("resident", "dlo"):
        data = report[side]
        print(
            f"{side}: switch {data['switch_s'] * 1e3:.2f} ms, recompiles {data['recompiles']} "
            f"(without adapters {data['recompiles (0 adapters)']}), first step "
            f"{data['first_step_s (0 adapters)']:.1f} s / {data['first_step_s (4 adapters)']:.1f} s"
        )
    for name, share in report["extra_over_cost_share_of_dlo_step"].items():
        print(f"DLO extra over the resident adapter cost, {name}: {share * 100:+.2f}% of the step")
    print(f"DLO - resident per choice: {report['dlo_max_abs_difference_to_resident']}")


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
