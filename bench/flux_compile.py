"""Compiled Flux-class steps: resident and DLO, eager and compiled, against diffusers'
compiled group offloading, in one process on one GPU.

Random bf16 weights of the real FluxTransformer2DModel configuration (``flux_dlo.py``'s
helpers). Each configuration is timed synchronized (median step) and back to back (mean
of steps with no sync between them), and compared with its limit,
max(resident compiled step, streamed bytes / pinned H2D), timed the same way. Compiled
here means regional: ``compile_repeated_blocks(fullgraph=True)``, what ``--compile``
does; under DLO the streamed blocks' forwards compile and DLO's hooks stay eager.
diffusers' group offloading cannot compile a block whole (its onload hooks are
``torch.compiler.disable``-d), so the peer runs ``fullgraph=False``, its best.

Also printed: whether DLO compiled is bitwise equal to resident compiled at each size,
the first step's time (which includes the compile) and the recompiles DLO counted.

    python bench/flux_compile.py --resolutions 1024 2048
    python bench/flux_compile.py --resolutions 1024 --deterministic   # inductor's mode
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
    for resolution in args.resolutions:
        rows[resolution] = {"first_step_s": first_step_seconds(model, inputs[resolution])}
        rows[resolution].update(timings(model, inputs[resolution], args.repeats))
        rows[resolution]["output"] = output(model, inputs[resolution])
    return rows


def run(args: argparse.Namespace) -> dict:
    from diffusers.hooks import apply_group_offloading

    from dlo_worker.offload import enable_dlo

    if args.deterministic:
        torch._inductor.config.deterministic = True
    device = torch.device("cuda", 0)
    bandwidth = pinned_h2d_gbps(device)
    inputs = {r: flux_inputs(r, device) for r in args.resolutions}
    report: dict = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "deterministic": args.deterministic,
        "pinned_h2d_gbps": bandwidth,
    }

    model = build_flux(device)
    streamed_bytes = sum(
        p.numel() * p.element_size()
        for blocks in (model.transformer_blocks, model.single_transformer_blocks)
        for p in blocks.parameters()
    )
    bound_s = streamed_bytes / (bandwidth * 1e9)
    runs = {"resident eager": measure(model, inputs, args)}
    model.compile_repeated_blocks(fullgraph=True)
    runs["resident compiled"] = measure(model, inputs, args)
    del model
    release(device)

    model = build_flux(device).to("cpu")
    release(device)
    backend = enable_dlo(model, device=device, use_allgather=False)
    runs["dlo eager"] = measure(model, inputs, args)
    model.compile_repeated_blocks(fullgraph=True)
    runs["dlo compiled"] = measure(model, inputs, args)
    stats = backend.stats()
    report["dlo"] = {"compiled_blocks": stats.compiled_blocks, "recompiles": stats.recompiles}
    for resolution in args.resolutions:
        runs["dlo compiled"][resolution]["peak_gib"] = peak_gib(device)
    backend.disable()
    del model, backend
    release(device)

    if not args.skip_peer:
        for name, options in PEER_CONFIGURATIONS.items():
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
    for resolution in args.resolutions:
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
            }
        ours, resident = runs["dlo compiled"][resolution], runs["resident compiled"][resolution]
        difference = (ours["output"].float() - resident["output"].float()).abs().max().item()
        eager_difference = (
            (
                (runs["dlo eager"][resolution]["output"].float())
                - runs["resident eager"][resolution]["output"].float()
            )
            .abs()
            .max()
            .item()
        )
        report["results"][resolution] = {
            "transfer_bound_s": bound_s,
            "limit_s": limit,
            "dlo_compiled_bitwise_equal_to_resident_compiled": difference == 0.0,
            "dlo_compiled_max_abs_difference": difference,
            "dlo_eager_max_abs_difference": eager_difference,
            "runs": rows,
        }
    return report


def print_report(report: dict) -> None:
    print(
        f"{report['gpu']}, torch {report['torch']}, pinned H2D {report['pinned_h2d_gbps']:.1f} "
        f"GB/s, inductor deterministic={report['deterministic']}, DLO {report['dlo']}"
    )
    for resolution, result in report["results"].items():
        print(
            f"\n{resolution}x{resolution}: transfer bound {result['transfer_bound_s']:.3f} s; "
            f"DLO compiled bitwise equal to resident compiled: "
            f"{result['dlo_compiled_bitwise_equal_to_resident_compiled']} (max abs "
            f"{result['dlo_compiled_max_abs_difference']:.4g}; eager "
            f"{result['dlo_eager_max_abs_difference']:.4g})"
        )
        print("| run | first step | step | x limit | back to back | x limit |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, row in result["runs"].items():
            print(
                f"| {name} | {row['first_step_s']:.2f} s | {row['step_s']:.3f} s | "
                f"{row['over_limit']:.3f} | {row['back_to_back_s']:.3f} s | "
                f"{row['over_limit_back_to_back']:.3f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--json", type=Path, help="Also write the report here.")
    args = parser.parse_args()
    report = run(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
