"""FP8 weight streaming on the Flux-class DiT (``--quantization fp8``), one GPU.

Same model and inputs as ``bench/flux_dlo.py`` (random bf16 weights, 57 blocks), in one
process: resident bf16, DLO bf16, resident FP8 and DLO FP8 (per-tensor FP8 linears in
the blocks, cast on the GPU before each matmul by the worker's Triton kernel;
``--torch-cast`` adds FP8 rows cast by ``Tensor.to``, PyTorch's own cast). Prints each DLO
step against its own limit max(resident step, streamed bytes / pinned H2D measured here),
the streamed bytes, and how far the FP8 step's output is from the bf16 one (relative error
and PSNR over the output's range). Steps are timed synchronized around each step and back
to back (as ``bench/flux_dlo.py`` says).

Each resident row also times every block's compute (CUDA events around each block's
forward, over one step) and reports the mean per double-stream and per single-stream
block beside each kind's copy time at the pinned H2D rate: where a kind's copy outlasts
its compute, two device slots cannot hide it, and the model of docs/benchmarks.md
("How much lookahead the goal needs") assumes both kinds compute alike.

Each resident row also runs the resident step while a side stream copies the streamed
bytes, all issued up front: the floor of any streaming schedule (unlimited device
lookahead), and the rate the copy engine reaches beside this step's compute. Where that
floor is above the limit, no schedule reaches the limit on this machine.

``--budgets`` adds FP8 DLO rows under ``gpu_memory_budget_gib`` (resident blocks spread
through the order, the rest streamed through the two slots), each against its own limit
max(resident step, its streamed bytes / pinned H2D): the other way to spend device memory
on the step, beside more copies in flight.

    python bench/flux_fp8.py --resolutions 1024 --budgets 2 3 4 --json flux_fp8.json

    python bench/flux_fp8.py --resolutions 1024 --json flux_fp8.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import cast

import torch
from flux_dlo import (
    back_to_back_step_seconds,
    build_flux,
    copies_beside_resident,
    flux_inputs,
    peak_gib,
    pinned_h2d_gbps,
    release,
    step_seconds,
)

from dlo_worker.offload import enable_dlo
from dlo_worker.pipeline import quantization
from dlo_worker.pipeline.quantization import quantize_blocks_fp8

WORKER_CAST = quantization.compute_weight


def torch_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 layers' cast without the Triton kernel (the ``--torch-cast`` rows)."""
    return weight.to(dtype)


@torch.inference_mode()
def output_of(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs, return_dict=False)[0].float()


def fidelity(output: torch.Tensor, reference: torch.Tensor) -> dict:
    error = output - reference
    mse = error.pow(2).mean().item()
    span = (reference.max() - reference.min()).item()
    return {
        "relative_error": (error.norm() / reference.norm()).item(),
        "psnr_db": 10 * math.log10(span**2 / mse) if mse else math.inf,
    }


@torch.inference_mode()
def block_compute_ms(model: torch.nn.Module, inputs: dict, bandwidth_gbps: float) -> dict:
    """Mean compute milliseconds of a double-stream and of a single-stream block over one
    resident step (events on the compute stream around each block's forward), beside each
    kind's copy at ``bandwidth_gbps``."""
    names = {"double": "transformer_blocks", "single": "single_transformer_blocks"}
    kinds = {kind: cast(torch.nn.ModuleList, model.get_submodule(n)) for kind, n in names.items()}
    starts: dict[str, list[torch.cuda.Event]] = {kind: [] for kind in kinds}
    ends: dict[str, list[torch.cuda.Event]] = {kind: [] for kind in kinds}

    def recorder(events: list[torch.cuda.Event]) -> Callable[..., None]:
        def record(*_hook_args: object) -> None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            events.append(event)

        return record

    handles = []
    for kind, blocks in kinds.items():
        for block in blocks:
            handles.append(block.register_forward_pre_hook(recorder(starts[kind])))
            handles.append(block.register_forward_hook(recorder(ends[kind])))
    try:
        model(**inputs)
        torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    report: dict = {}
    for kind, blocks in kinds.items():
        block_bytes = sum(t.nbytes for t in chain(blocks[0].parameters(), blocks[0].buffers()))
        spans = [
            start.elapsed_time(end) for start, end in zip(starts[kind], ends[kind], strict=True)
        ]
        report[f"{kind}_compute_ms"] = sum(spans) / len(spans)
        report[f"{kind}_copy_ms"] = block_bytes / (bandwidth_gbps * 1e9) * 1e3
    return report


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the blocks DLO streams (both block lists' parameters and buffers)."""
    lists = ("transformer_blocks", "single_transformer_blocks")
    blocks = chain.from_iterable(cast(torch.nn.ModuleList, model.get_submodule(n)) for n in lists)
    return sum(t.nbytes for block in blocks for t in chain(block.parameters(), block.buffers()))


def streamed(
    model,
    inputs: dict,
    repeats: int,
    device,
    resident_output: torch.Tensor,
    *,
    budget_gib: float | None = None,
) -> dict:
    """DLO rank-local on ``model`` (within ``budget_gib`` of device memory if given); its
    step time, streamed bytes, peak HBM, and whether its output is bitwise the resident
    one."""
    backend = enable_dlo(
        model, device=device, use_allgather=False, gpu_memory_budget_gib=budget_gib
    )
    try:
        block_bytes = sum(layout.nbytes for layout in backend.block_layouts())
        release(device)
        step = step_seconds(model, inputs, repeats)
        peak = peak_gib(device)
        back_to_back = back_to_back_step_seconds(model, inputs, repeats)
        bitwise = torch.equal(output_of(model, inputs), resident_output)
        stats = backend.stats()
        return {
            "dlo_s": step,
            "dlo_back_to_back_s": back_to_back,
            "block_gib": block_bytes / 2**30,
            "block_bytes": block_bytes,
            "peak_gib": peak,
            "achieved_h2d_gbps": stats.h2d_gbps,
            "slot_gib": stats.device_slot_bytes / 2**30,
            "resident_blocks": stats.resident_blocks,
            "bitwise_equal_to_resident": bitwise,
        }
    finally:
        backend.disable()


def against_limits(
    dlo: dict, resident_s: float, resident_back_to_back_s: float, bandwidth: float
) -> dict:
    """A DLO row's transfer bound (its streamed bytes at ``bandwidth`` GB/s) and its steps
    against max(resident step, bound), each timing against the resident step timed alike."""
    bound_s = dlo["block_bytes"] / (bandwidth * 1e9)
    return {
        "transfer_bound_s": bound_s,
        "dlo_over_limit": dlo["dlo_s"] / max(resident_s, bound_s),
        "dlo_back_to_back_over_limit": dlo["dlo_back_to_back_s"]
        / max(resident_back_to_back_s, bound_s),
    }


def budget_row(
    inputs: dict, device, repeats: int, budget_gib: float, *, fp8: dict, bandwidth: float
) -> dict:
    """FP8 DLO within ``budget_gib`` (a fresh FP8 model: DLO empties the one it streamed),
    against the limit of the bytes it still streams; ``fp8`` is the all-streamed row."""
    quantization.compute_weight = WORKER_CAST
    model = build_flux(device)
    quantize_blocks_fp8(model)
    output = output_of(model, inputs)
    release(device)
    dlo = streamed(model, inputs, repeats, device, output, budget_gib=budget_gib)
    del model, output
    release(device)
    row = {
        "budget_gib": budget_gib,
        **dlo,
        **against_limits(dlo, fp8["resident_s"], fp8["resident_back_to_back_s"], bandwidth),
    }
    print(f"  budget {budget_gib} GiB: {row}", flush=True)
    return row


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda", 0)
    bandwidth = pinned_h2d_gbps(device)
    report: dict = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "pinned_h2d_gbps": bandwidth,
        "results": {},
    }
    for resolution in args.resolutions:
        inputs = flux_inputs(resolution, device)
        row: dict = {}
        for variant in ("bf16", "fp8", *(["fp8_torch_cast"] if args.torch_cast else [])):
            model = build_flux(device)
            if variant != "bf16":
                quantize_blocks_fp8(model)
            # Float8Linear.forward calls the module's compute_weight.
            quantization.compute_weight = torch_cast if variant == "fp8_torch_cast" else WORKER_CAST
            release(device)
            resident_s = step_seconds(model, inputs, args.repeats)
            resident_back_to_back_s = back_to_back_step_seconds(model, inputs, args.repeats)
            blocks = block_compute_ms(model, inputs, bandwidth)
            floor_s, beside_gbps = copies_beside_resident(
                model, inputs, streamed_bytes(model), args.repeats
            )
            output = output_of(model, inputs)
            if variant == "bf16":
                reference = output
            elif variant == "fp8":
                row["fp8_vs_bf16"] = fidelity(output, reference)
            dlo = streamed(model, inputs, args.repeats, device, output)
            limits = against_limits(dlo, resident_s, resident_back_to_back_s, bandwidth)
            row[variant] = {
                "resident_s": resident_s,
                **dlo,
                **limits,
                "resident_back_to_back_s": resident_back_to_back_s,
                "blocks": blocks,
                "floor_beside_copies_s": floor_s,
                "copies_beside_compute_gbps": beside_gbps,
                "floor_over_limit": floor_s / max(resident_s, limits["transfer_bound_s"]),
            }
            del model, output
            release(device)
            print(f"{resolution} {variant}: {row[variant]}", flush=True)
        row["fp8_budgets"] = [
            budget_row(inputs, device, args.repeats, budget, fp8=row["fp8"], bandwidth=bandwidth)
            for budget in args.budgets
        ]
        row["fp8_over_bf16_dlo"] = row["fp8"]["dlo_s"] / row["bf16"]["dlo_s"]
        report["results"][resolution] = row
    return report


def print_report(report: dict) -> None:
    print(
        f"# {report['gpu']}, torch {report['torch']}, "
        f"pinned H2D {report['pinned_h2d_gbps']:.1f} GB/s"
    )
    for resolution, row in report["results"].items():
        for variant in ("bf16", "fp8", "fp8_torch_cast"):
            if variant not in row:
                continue
            r = row[variant]
            print(
                f"{resolution}x{resolution} {variant}: blocks {r['block_gib']:.2f} GiB | resident "
                f"{r['resident_s']:.3f} s | bound {r['transfer_bound_s']:.3f} s | DLO "
                f"{r['dlo_s']:.3f} s (peak {r['peak_gib']:.1f} GiB, H2D "
                f"{r['achieved_h2d_gbps']:.1f} GB/s) = {r['dlo_over_limit']:.3f}x limit | back "
                f"to back: resident {r['resident_back_to_back_s']:.3f} s, DLO "
                f"{r['dlo_back_to_back_s']:.3f} s = {r['dlo_back_to_back_over_limit']:.3f}x limit"
                f" | slots {r['slot_gib']:.2f} GiB | bitwise {r['bitwise_equal_to_resident']}"
            )
            b = r["blocks"]
            print(
                f"  per block, compute / copy at pinned H2D: double "
                f"{b['double_compute_ms']:.2f} / {b['double_copy_ms']:.2f} ms, single "
                f"{b['single_compute_ms']:.2f} / {b['single_copy_ms']:.2f} ms"
            )
            print(
                f"  resident beside copies of the streamed bytes (floor): "
                f"{r['floor_beside_copies_s']:.3f} s = {r['floor_over_limit']:.3f}x limit, "
                f"copies at {r['copies_beside_compute_gbps']:.1f} GB/s beside compute"
            )
        for b in row["fp8_budgets"]:
            print(
                f"{resolution}x{resolution} fp8, budget {b['budget_gib']} GiB: "
                f"{b['resident_blocks']} blocks resident, streamed {b['block_gib']:.2f} GiB | "
                f"bound {b['transfer_bound_s']:.3f} s | DLO {b['dlo_s']:.3f} s "
                f"= {b['dlo_over_limit']:.3f}x limit | back to back {b['dlo_back_to_back_s']:.3f} s"
                f" = {b['dlo_back_to_back_over_limit']:.3f}x limit | peak {b['peak_gib']:.2f} GiB"
                f" | bitwise {b['bitwise_equal_to_resident']}"
            )
        quality = row["fp8_vs_bf16"]
        print(
            f"{resolution}x{resolution}: FP8 DLO / bf16 DLO = {row['fp8_over_bf16_dlo']:.3f}; FP8 "
            f"step output vs bf16: relative error {quality['relative_error']:.4f}, PSNR "
            f"{quality['psnr_db']:.1f} dB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="Also write the report as JSON here.")
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[],
        help="Also run FP8 DLO within each of these GPU memory budgets (GiB).",
    )
    parser.add_argument(
        "--torch-cast",
        action="store_true",
        help="Also run FP8 cast by Tensor.to (PyTorch's own cast) instead of the Triton kernel.",
    )
    args = parser.parse_args()
    report = run(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
