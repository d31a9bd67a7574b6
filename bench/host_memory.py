"""Host memory of N worker processes on one node: checkpoint mmap, the runtime cache and
the ordinary path; and how long each start takes to load.

Each process is a real worker rank (torchrun, gloo, DP = N, rank-local DLO on the CPU)
running one DiT forward so every block has streamed once; then, while all N are alive,
each reads its own ``/proc/self/smaps_rollup`` and the smaps of the checkpoint mappings.

- checkpoint-mmap: the loader's checkpoint mapping; blocks stay in the page cache, mapped by every
  process (shared), packed through two staging buffers per process;
- ordinary: the same weights in a checkpoint that also holds one foreign tensor, which
  the loader must load ordinarily as a unit; every process packs a private copy;
- runtime-cache (cold): that mixed checkpoint with ``--dlo-enable-runtime-cache`` on a fresh
  root: every process loads ordinarily, one builds the entry and the others join it, then
  all map it (shared) and free their private copies;
- runtime-cache (warm): the same root again: every process skips loading (a hit).

    python bench/host_memory.py --processes 2 4 --json docs/bench-results/host_memory.json

The DiT is a DiTPipeline with 24 blocks of width 768 (float32, ~1.1 GB of blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 2**30


def write_models(root: Path, layers: int, heads: int, head_dim: int) -> tuple[Path, Path]:
    """The benchmark pipeline, and a copy whose transformer checkpoint is a mixed source."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from dlo_worker.pipeline.demo_model import DemoModelShape, write_demo_model

    shape = DemoModelShape(
        num_layers=layers, num_attention_heads=heads, attention_head_dim=head_dim
    )
    mapped = write_demo_model(root / "checkpoint-mmap", shape=shape)
    ordinary = root / "ordinary"
    shutil.copytree(mapped, ordinary)
    weights = ordinary / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state["text_encoder.embeddings.weight"] = torch.zeros(8, 8)
    save_file(state, weights, metadata={"format": "pt"})
    os.sync()  # measure clean page-cache pages, not freshly written ones
    return mapped, ordinary


def measure_rank(model: Path, out: Path, cache_root: Path | None) -> None:
    """Runs inside one torchrun rank."""
    import time

    import torch
    import torch.distributed as dist

    from dlo_worker.config import build_config
    from dlo_worker.observability.memory import mapped_file_memory, process_memory
    from dlo_worker.process.worker import Worker

    world = int(os.environ["WORLD_SIZE"])
    offload = {"enable_distributed_layerwise_offload": True, "dlo_use_allgather": False}
    if cache_root is not None:
        offload |= {"dlo_enable_runtime_cache": True, "dlo_runtime_cache_root": str(cache_root)}
    config = build_config(
        {
            "model": {"model": str(model), "device": "cpu"},
            "parallel": {"data_parallel_size": world},
            "offload": offload,
        }
    )
    started = time.perf_counter()
    with Worker(config) as worker:
        load_s = time.perf_counter() - started
        transformer = worker.pipeline.transformer
        size = transformer.config.sample_size
        latents = torch.randn(2, transformer.config.in_channels, size, size)
        with torch.inference_mode():
            transformer(
                latents, timestep=torch.tensor([500, 500]), class_labels=torch.tensor([1, 2])
            )
        stats = worker.backend.stats()
        block_bytes = sum(layout.nbytes for layout in worker.backend.block_layouts())
        files = sorted(
            (model / "transformer").glob("*.safetensors")
            if stats.host_backing != "runtime-cache"
            else cache_root.glob("entries/*/*.safetensors")
        )
        reason = worker.backing.reason
        dist.barrier()
        total, mapped = process_memory(), mapped_file_memory(files)
        dist.barrier()
    record = {
        "backing": stats.host_backing,
        "cache": next((r for r in ("built", "joined", "hit") if f"{r} entry" in reason), None)
        or ("hit" if "skip-load hit" in reason else None),
        "load_s": load_s,
        "rss": total.rss,
        "pss": total.pss,
        "private": total.private,
        "anonymous": total.anonymous,
        "checkpoint_resident": mapped.rss,
        "checkpoint_shared": mapped.shared_clean + mapped.shared_dirty,
        "checkpoint_private": mapped.private,
        "dlo_host_bytes": stats.host_bytes,
        "staging_bytes": stats.staging_bytes,
        "block_bytes": block_bytes,
    }
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


def run_case(model: Path, processes: int, cache_root: Path | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cache = ["--cache-root", str(cache_root)] if cache_root is not None else []
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(processes),
                __file__,
                "--rank-of",
                str(model),
                "--out",
                out,
                *cache,
            ],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        return [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]


def summarize(records: list[dict]) -> dict:
    def mean(key: str) -> float:
        return sum(record[key] for record in records) / len(records)

    return {
        "backing": records[0]["backing"],
        "cache": sorted(str(record["cache"]) for record in records)
        if records[0]["cache"]
        else None,
        "load_s": max(record["load_s"] for record in records),
        "processes": len(records),
        "private_gib": mean("private") / GIB,
        "pss_gib": mean("pss") / GIB,
        "rss_gib": mean("rss") / GIB,
        "checkpoint_shared_gib": mean("checkpoint_shared") / GIB,
        "dlo_host_gib": mean("dlo_host_bytes") / GIB,
        "staging_gib": mean("staging_bytes") / GIB,
        "block_gib": records[0]["block_bytes"] / GIB,
        # Node total: what all processes keep privately, plus the shared file pages once.
        "node_gib": (
            sum(r["private"] for r in records) + max(r["checkpoint_shared"] for r in records)
        )
        / GIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rank-of", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache-root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        measure_rank(args.rank_of, args.out, args.cache_root)
        return
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("DLO_BENCH_DIR")) as root:
        mapped, ordinary = write_models(Path(root), args.layers, args.heads, args.head_dim)
        for processes in args.processes:
            for model in (ordinary, mapped):
                rows.append(summarize(run_case(model, processes)))
            cache_root = Path(root) / f"cache-{processes}"
            for _start in ("cold", "warm"):
                rows.append(summarize(run_case(ordinary, processes, cache_root)))
    header = (
        "| processes | backing (cache) | load, slowest rank | private / process | PSS / process "
        "| shared file pages | DLO host copy | staging | node total |"
    )
    print(header)
    print("|" + " --- |" * 9)
    for row in rows:
        cache = f" ({', '.join(row['cache'])})" if row["cache"] else ""
        print(
            f"| {row['processes']} | {row['backing']}{cache} | {row['load_s']:.1f} s "
            f"| {row['private_gib']:.2f} GiB "
            f"| {row['pss_gib']:.2f} GiB | {row['checkpoint_shared_gib']:.2f} GiB "
            f"| {row['dlo_host_gib']:.2f} GiB | {row['staging_gib']:.3f} GiB "
            f"| {row['node_gib']:.2f} GiB |"
        )
    print(f"streamed block bytes: {rows[0]['block_gib']:.2f} GiB")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
