"""Compiled Flux-class steps: resident and DLO, eager, compiled and with CUDA graphs,
against diffusers' compiled group offloading, in one process on one GPU.

Random bf16 weights of the real FluxTransformer2DModel configuration (``flux_dlo.py``'s
helpers). Each configuration is timed synchronized (median step) and back to back (mean
of steps with no sync between them), and compared with its limit,
max(resident compiled step, streamed bytes / pinned H2D), timed the same way. Compiled
means what ``--compile`` does (``dlo_worker.pipeline.compilation.compile_blocks``):
regional, ``fullgraph=True``, inductor deterministic; under DLO the streamed blocks'
forwards compile and DLO's hooks stay eager. ``--cuda-graphs`` adds ``--compile-mode
reduce-overhead`` rows (each block one CUDA graph) and a 256x256 size, where the step is
bound by launching kernels rather than running them: the difference there between the
compiled and the CUDA graph rows is the host launch time saved per step. diffusers' group
offloading cannot compile a block whole (its onload hooks are ``torch.compiler.disable``-d),
so the peer runs ``fullgraph=False``, its best.

Also printed: whether DLO is bitwise equal to the resident model compiled the same way at
each size, the first step's time (which includes the compile) and the recompiles DLO
counted. ``--budgets`` times DLO compiled under ``gpu_memory_budget_gib``, each against
max(resident compiled step, its streamed bytes / H2D). The compile cache's cold and warm
first step: ``flux_compile_cache.py``.

    python bench/flux_compile.py --resolutions 1024 2048 --cuda-graphs --budgets 16 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from flux_dlo import (
    PEER_CONFIGURATIONS,
    back_to_back_step_seconds,
    build_flux,
    flux_inputs,
    peak_gib,
    pinned_h2d_gbps,
    release,
    step_seconds,
)

from dlo_worker.config import CompileMode
from dlo_worker.pipeline.compilation import compile_blocks

LAUNCH_BOUND_RESOLUTION = 256
LABELS = {CompileMode.DEFAULT: "compiled", CompileMode.REDUCE_OVERHEAD: "cuda graphs"}


@torch.inference_mode()
def first_step_seconds(model: torch.nn.Module, inputs: dict) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    model(**inputs)
    torch.cuda.synchronize()
    return time.perf_counter() - started


@torch.inference_mode()
def output(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs).sample.cpu()


def timings(model: torch.nn.Module, inputs: dict, repeats: int) -> dict:
    return {
        "step_s": step_seconds(model, inputs, repeats),
        "back_to_back_s": back_to_back_step_seconds(model, inputs, repeats),
    }


def measure(model: torch.nn.Module, inputs: dict, args: argparse.Namespace) -> dict:
    """First step (compiles when compiled), timings and output at every size."""
    rows = {}
    for resolution, sized in inputs.items():
        rows[resolution] = {"first_step_s": first_step_seconds(model, sized)}
        rows[resolution].update(timings(model, sized, args.repeats))
        rows[resolution]["output"] = output(model, sized)
        rows[resolution]["peak_gib"] = peak_gib(sized["hidden_states"].device)
    return rows


def compiled_again(model: torch.nn.Module, mode: CompileMode, device: torch.device) -> None:
    """Compile ``model``'s blocks as ``--compile-mode mode`` does, from a clean Dynamo."""
    torch._dynamo.reset()
    compile_blocks(model, mode, device)


def run(args: argparse.Namespace) -> dict:  # noqa: PLR0915 (one run, in order)
    from diffusers.hooks import apply_group_offloading

    from dlo_worker.offload import enable_dlo

    device = torch.device("cuda", 0)
    bandwidth = pinned_h2d_gbps(device)
    sizes = list(args.resolutions)
    if args.cuda_graphs and LAUNCH_BOUND_RESOLUTION not in sizes:
        sizes.insert(0, LAUNCH_BOUND_RESOLUTION)
    inputs = {r: flux_inputs(r, device) for r in sizes}
    modes = [CompileMode.DEFAULT] + ([CompileMode.REDUCE_OVERHEAD] if args.cuda_graphs else [])
    report: dict = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "pinned_h2d_gbps": bandwidth,
        "dlo": {},
    }

    model = build_flux(device)
    streamed_bytes = sum(
        p.numel() * p.element_size()
        for blocks in (model.transformer_blocks, model.single_transformer_blocks)
        for p in blocks.parameters()
    )
    bound_s = streamed_bytes / (bandwidth * 1e9)
    release(device)
    runs = {"resident eager": measure(model, inputs, args)}
    for mode in modes:
        compiled_again(model, mode, device)
        release(device)
        runs[f"resident {LABELS[mode]}"] = measure(model, inputs, args)
    del model
    release(device)

    model = build_flux(device).to("cpu")
    release(device)
    backend = enable_dlo(model, device=device, use_allgather=False)
    runs["dlo eager"] = measure(model, inputs, args)
    for mode in modes:
        compiled_again(model, mode, device)
        release(device)
        runs[f"dlo {LABELS[mode]}"] = measure(model, inputs, args)
        stats = backend.stats()
        report["dlo"][LABELS[mode]] = {
            "compiled_blocks": stats.compiled_blocks,
            "recompiles": stats.recompiles,
            "on_demand_loads": stats.on_demand_loads,
        }
    backend.disable()
    del model, backend
    release(device)

    if args.budgets:
        report["budgets"] = budget_rows(device, inputs, args, runs, bandwidth)

    if not args.skip_peer:
        for name, options in PEER_CONFIGURATIONS.items():
            torch._dynamo.reset()
            model = build_flux(device).to("cpu")
            release(device)
            apply_group_offloading(
                model, onload_device=device, use_stream=True, record_stream=True, **options
            )
            model.compile_repeated_blocks(fullgraph=False)
            runs[f"diffusers {name} compiled"] = measure(model, inputs, args)
            del model
            release(device)

    report["results"] = {}
    for resolution in sizes:
        reference = runs["resident compiled"][resolution]
        limit = {key: max(reference[key], bound_s) for key in ("step_s", "back_to_back_s")}
        rows = {}
        for name, by_size in runs.items():
            row = by_size[resolution]
            rows[name] = {
                "first_step_s": row["first_step_s"],
                "step_s": row["step_s"],
                "back_to_back_s": row["back_to_back_s"],
                "over_limit": row["step_s"] / limit["step_s"],
                "over_limit_back_to_back": row["back_to_back_s"] / limit["back_to_back_s"],
                "peak_gib": row["peak_gib"],
            }
        equal = {}
        for label in ["eager", *(LABELS[mode] for mode in modes)]:
            ours = runs[f"dlo {label}"][resolution]["output"].float()
            resident = runs[f"resident {label}"][resolution]["output"].float()
            equal[label] = (ours - resident).abs().max().item()
        report["results"][resolution] = {
            "transfer_bound_s": bound_s,
            "limit_s": limit,
            "dlo_max_abs_difference_to_resident": equal,
            "runs": rows,
        }
    return report


def budget_rows(
    device: torch.device, inputs: dict, args: argparse.Namespace, runs: dict, bandwidth: float
) -> list[dict]:
    """DLO compiled under each GPU memory budget, against max(resident compiled step, its
    streamed bytes / H2D), each timed the same way."""
    from dlo_worker.offload import enable_dlo

    rows = []
    for budget in args.budgets:
        torch._dynamo.reset()
        model = build_flux(device)
        release(device)
        backend = enable_dlo(
            model, device=device, use_allgather=False, gpu_memory_budget_gib=budget
        )
        streamed_bytes = sum(layout.nbytes for layout in backend.block_layouts())
        compile_blocks(model, CompileMode.DEFAULT, device)
        for resolution in args.resolutions:
            release(device)
            first = first_step_seconds(model, inputs[resolution])
            measured = timings(model, inputs[resolution], args.repeats)
            resident = runs["resident compiled"][resolution]
            transfer = streamed_bytes / (bandwidth * 1e9)
            rows.append(
                {
                    "budget_gib": budget,
                    "resolution": resolution,
                    "resident_blocks": backend.stats().resident_blocks,
                    "streamed_gib": streamed_bytes / 2**30,
                    "first_step_s": first,
                    **measured,
                    "over_bound": measured["step_s"] / max(resident["step_s"], transfer),
                    "over_bound_back_to_back": measured["back_to_back_s"]
                    / max(resident["back_to_back_s"], transfer),
                    "peak_gib": peak_gib(device),
                }
            )
        backend.disable()
        del model, backend
        release(device)
    return rows


def print_report(report: dict) -> None:
    print(
        f"{report['gpu']}, torch {report['torch']}, pinned H2D {report['pinned_h2d_gbps']:.1f} "
        f"GB/s, DLO {report['dlo']}"
    )
    for resolution, result in report["results"].items():
        print(
            f"\n{resolution}x{resolution}: transfer bound {result['transfer_bound_s']:.3f} s; "
            "DLO - resident, max abs difference (0 = bitwise): "
            f"{result['dlo_max_abs_difference_to_resident']}"
        )
        print("| run | first step | step | x limit | back to back | x limit | peak GiB |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, row in result["runs"].items():
            print(
                f"| {name} | {row['first_step_s']:.2f} s | {row['step_s']:.3f} s | "
                f"{row['over_limit']:.3f} | {row['back_to_back_s']:.3f} s | "
                f"{row['over_limit_back_to_back']:.3f} | {row['peak_gib']:.1f} |"
            )
    if report.get("budgets"):
        print("\n| budget | size | resident blocks | step | x bound | back to back | x bound |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for row in report["budgets"]:
            print(
                f"| {row['budget_gib']:g} GiB | {row['resolution']} | {row['resident_blocks']} | "
                f"{row['step_s']:.3f} s | {row['over_bound']:.3f} | "
                f"{row['back_to_back_s']:.3f} s | {row['over_bound_back_to_back']:.3f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--budgets", type=float, nargs="*", default=[])
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--json", type=Path, help="Also write the report here.")
    args = parser.parse_args()
    report = run(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
