"""The compile cache: a fresh worker process's first compiled forward, with an empty
(cold) and a filled (warm) ``--compile-cache-dir``, as a Pod restarted on the same node.

Each child builds the Flux-class DiT on the GPU (random bf16 weights of the real
configuration, ``flux_dlo.py``'s helpers), compiles its blocks as the worker does
(``compile_blocks``, resident) and times its first forward, synchronized, then a second
one. Also printed, from torch's own compile timers: Dynamo's bytecode tracing and the
compiler backend's share (AOTAutograd and inductor: compiling, or loading from the
cache). Pairs of fresh processes, each pair over a new empty directory, give the spread.

    python bench/flux_compile_cache.py --pairs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from flux_dlo import build_flux, flux_inputs

from dlo_worker.config import CompileMode
from dlo_worker.pipeline.compilation import compile_blocks

COMPILE_TIMERS = {
    "_compile.compile_inner": "compile_seconds",
    "bytecode_tracing": "dynamo_tracing_seconds",
    "OutputGraph.call_user_compiler": "backend_seconds",
}
"""torch's aggregate compile timers (``torch._dynamo.utils.compile_times``) reported."""


def first_forward_in(directory: Path, resolution: int) -> dict:
    """Child: a fresh process's first compiled forward; its record."""
    device = torch.device("cuda", 0)
    model = build_flux(device)
    inputs = flux_inputs(resolution, device)
    compiled = compile_blocks(model, CompileMode.DEFAULT, device, cache_dir=directory)
    with torch.inference_mode():
        model(**inputs)
        torch.cuda.synchronize()
        second = time.perf_counter()
        model(**inputs)
        torch.cuda.synchronize()
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    timers = dict(zip(names, values, strict=True))
    return {
        **compiled.fields(),
        "second_forward_seconds": time.perf_counter() - second,
        **{key: float(timers.get(name, 0.0)) for name, key in COMPILE_TIMERS.items()},
    }


def pair(resolution: int) -> dict:
    """Cold, then warm, over one new empty cache directory."""
    result = {}
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as directory:
        for attempt in ("cold", "warm"):
            command = [sys.executable, __file__, "--child", directory]
            command += ["--resolution", str(resolution)]
            child = subprocess.run(command, capture_output=True, text=True, check=True)
            result[attempt] = json.loads(child.stdout.strip().splitlines()[-1])
    result["warm_over_cold"] = (
        result["warm"]["first_forward_seconds"] / result["cold"]["first_forward_seconds"]
    )
    return result


def print_report(report: dict) -> None:
    print(
        f"{report['gpu']}, torch {report['torch']}, {report['resolution']}x{report['resolution']}"
    )
    print(
        "| pair | cache | first forward | of it: Dynamo tracing | compiler backend | "
        "second forward | hits / misses |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for number, result in enumerate(report["pairs"], 1):
        for attempt in ("cold", "warm"):
            row = result[attempt]
            print(
                f"| {number} | {attempt} | {row['first_forward_seconds']:.2f} s | "
                f"{row['dynamo_tracing_seconds']:.2f} s | {row['backend_seconds']:.2f} s | "
                f"{row['second_forward_seconds']:.3f} s | "
                f"{row['cache_hits']} / {row['cache_misses']} |"
            )
    ratios = [result["warm_over_cold"] for result in report["pairs"]]
    print(
        f"warm/cold: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
        f"max {max(ratios):.3f} over {len(ratios)} pairs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="Also write the report here.")
    args = parser.parse_args()
    if args.child is not None:
        record = first_forward_in(args.child, args.resolution)
        print(json.dumps(record, default=str))
        return
    report = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "resolution": args.resolution,
        "pairs": [pair(args.resolution) for _ in range(args.pairs)],
    }
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
