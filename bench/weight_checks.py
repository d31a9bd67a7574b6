"""What the start-up weight checks cost: the non-finite scan and the content digest.

A DiT bound to its checkpoint mapping is scanned for NaN and infinity at start
(:mod:`dlo_worker.loader.finite`), and a skip-load start re-derives the runtime-cache
entry's content digest from its mapped views (:mod:`dlo_worker.runtime_cache.digest`).
Both read every byte once. This writes a Flux-class checkpoint of random bf16 weights
(``--gib``, default the Flux-class DiT's 22 GiB) and times, from a warm page cache, in one
process:

- ``ordinary_load``: every mapped tensor copied into private memory, which is what an
  ordinary (unmapped) start does with each byte anyway (the reference: one read and one
  write of every byte, with torch's own threads);
- ``scan``: the non-finite scan over the mapped tensors, per thread count;
- ``isfinite_all``: the check this replaced (``torch.isfinite(p).all()`` per tensor);
- ``content_digest``: the per-tensor SHA-256 digest, per thread count.

    python bench/weight_checks.py --gib 22 --threads 1 4 16 --json out.json

Ratios are against ``ordinary_load`` measured in the same run; each row is the median of
``--repeats`` runs, with the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dlo_worker.loader import finite
from dlo_worker.runtime_cache import digest

# A Flux double block's largest linear layers (bf16): 3072x12288 and 12288x3072.
SHAPES = ((3072, 12288), (12288, 3072), (3072, 3072), (3072,))


def write_checkpoint(path: Path, gib: float) -> int:
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    total, index = 0, 0
    while total < gib * 2**30:
        shape = SHAPES[index % len(SHAPES)]
        tensor = torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
        tensors[f"blocks.{index // len(SHAPES)}.t{index % len(SHAPES)}"] = tensor
        total += tensor.nbytes
        index += 1
    save_file(tensors, str(path))
    return total


def mapped(path: Path) -> list[tuple[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as handle:
        return [(name, handle.get_tensor(name)) for name in handle.keys()]  # noqa: SIM118


def timed(run, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=22.05)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, os.cpu_count() or 1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="Where to write the checkpoint (tmp).")
    parser.add_argument("--skip-isfinite", action="store_true", help="Skip the old check.")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        path = Path(scratch) / "model.safetensors"
        nbytes = write_checkpoint(path, args.gib)
        report: dict = {"gib": nbytes / 2**30, "cpus": os.cpu_count()}
        tensors = mapped(path)
        [tensor.clone() for _, tensor in tensors]  # warm the page cache
        report["ordinary_load"] = timed(
            lambda: [tensor.clone() for _, tensor in tensors], args.repeats
        )
        bound = report["ordinary_load"]["median_s"]
        for threads in args.threads:
            finite.MAX_THREADS = threads
            digest.MAX_THREADS = threads
            torch.set_num_threads(1)  # as under torchrun: the pool owns the parallelism
            scan = timed(lambda: finite.non_finite(tensors), args.repeats)
            hashed = timed(lambda: digest.content_digest(tensors), args.repeats)
            for name, row in (("scan", scan), ("content_digest", hashed)):
                row["gb_s"] = nbytes / row["median_s"] / 1e9
                row["vs_ordinary_load"] = row["median_s"] / bound
                report[f"{name}_{threads}_threads"] = row
        if not args.skip_isfinite:
            torch.set_num_threads(os.cpu_count() or 1)
            old = timed(lambda: [bool(torch.isfinite(t).all()) for _, t in tensors], 1)
            old["gb_s"] = nbytes / old["median_s"] / 1e9
            old["vs_ordinary_load"] = old["median_s"] / bound
            report["isfinite_all_all_threads"] = old
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
