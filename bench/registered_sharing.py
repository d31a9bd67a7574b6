"""Two workers on two GPUs of one node sharing one registered runtime-cache entry.

Each rank (a process with its own GPU) streams the Flux-class DiT rank-locally twice, both
ranks stepping at the same time: from a private pinned copy of the blocks (the pinned
path, one copy per process), then from the node's one runtime-cache entry, registered
read-only by both processes and copied directly. While the registered run is alive, each
rank reads the smaps of the entry's files: the node should hold about one copy (the sum of
the ranks' PSS over the entry), none of it private to a process.

    DLO_BENCH_DIR=/big/disk torchrun --nproc-per-node 2 bench/registered_sharing.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from flux_dlo import build_flux, flux_inputs, pinned_h2d_gbps, release, step_seconds

GIB = 2**30


def build_entry(root: Path, device: torch.device) -> tuple[Path, str]:
    """Rank 0: the model's runtime-cache entry under ``root`` and its config for skeletons."""
    from dlo_worker.runtime_cache import CacheRequest, attach_runtime_cache

    model = build_flux(device).to("cpu")
    release(device)
    model.save_config(str(root / "config"))
    entry, report = attach_runtime_cache(CacheRequest(root / "cache", 600.0), [("model", model)])
    if entry is None:
        raise SystemExit(f"the runtime cache fell back: {report.reason}")
    directory = entry.directory
    entry.close()
    return directory, report.key


def concurrent_steps(
    model: torch.nn.Module, inputs: dict, repeats: int, device: torch.device
) -> dict[int, float]:
    """Step times with every rank stepping at once (a barrier before each resolution)."""
    steps = {}
    for resolution, resolution_inputs in inputs.items():
        release(device)
        dist.barrier()
        steps[resolution] = step_seconds(model, resolution_inputs, repeats)
    return steps


def report_run(everyone: list[dict], entry_gib: float, device: torch.device, args) -> None:
    """Print (and write as JSON) every rank's steps and the node's memory over the entry."""
    report = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "entry_gib": entry_gib,
        "ranks": everyone,
        "node_entry_pss_gib": sum(r["entry_mapping"]["pss"] for r in everyone) / GIB,
        "node_entry_private_gib": sum(
            r["entry_mapping"]["private_clean"] + r["entry_mapping"]["private_dirty"]
            for r in everyone
        )
        / GIB,
    }
    for row in everyone:
        steps = ", ".join(
            f"{r}x{r} pinned {row['pinned_s'][r]:.3f} s, registered "
            f"{row['registered_s'][r]:.3f} s = {row['registered_over_pinned'][r]:.3f}x"
            for r in args.resolutions
        )
        print(
            f"rank {row['rank']}: {row['registration']} {row['registered_gib']:.2f} GiB in "
            f"{row['setup_s']:.1f} s; {steps}; entry mapping RSS "
            f"{row['entry_mapping']['rss'] / GIB:.2f} GiB, PSS "
            f"{row['entry_mapping']['pss'] / GIB:.2f} GiB"
        )
    print(
        f"node: entry {entry_gib:.2f} GiB on disk; PSS over the entry summed over ranks "
        f"{report['node_entry_pss_gib']:.2f} GiB, private "
        f"{report['node_entry_private_gib']:.2f} GiB"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from diffusers import FluxTransformer2DModel

    from dlo_worker.loader.components import diffusers_skeleton
    from dlo_worker.observability.memory import mapped_file_memory, process_memory
    from dlo_worker.offload import DistributedLayerwiseOffloadBackend, OffloadConfig, enable_dlo
    from dlo_worker.runtime_cache.entry import RuntimeCacheEntry, read_manifest

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    inputs = {r: flux_inputs(r, device) for r in args.resolutions}
    with tempfile.TemporaryDirectory(dir=os.environ.get("DLO_BENCH_DIR")) as scratch:
        shared = [Path(scratch) if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        root = shared[0]
        located = [build_entry(root, device) if rank == 0 else None]
        dist.broadcast_object_list(located, src=0)
        entry_dir, key = located[0]

        dist.barrier()
        h2d = pinned_h2d_gbps(device)
        model = build_flux(device)
        backend = enable_dlo(model, device=device, use_allgather=False)
        pinned = concurrent_steps(model, inputs, args.repeats, device)
        backend.disable()
        del model, backend
        gc.collect()
        release(device)

        started = time.perf_counter()
        entry = RuntimeCacheEntry(entry_dir, read_manifest(entry_dir, key), lambda: None)
        # Flux keeps no module in float32: the skeleton's dtypes are the entry's.
        skeleton = diffusers_skeleton(FluxTransformer2DModel, root / "config", torch.bfloat16)
        backend = DistributedLayerwiseOffloadBackend(
            OffloadConfig(use_allgather=False, pin_limit_bytes=2**40),
            device,
            entry,
        )
        backend.enable(skeleton)
        setup_s = time.perf_counter() - started
        registered = concurrent_steps(skeleton, inputs, args.repeats, device)
        stats = backend.stats()
        files = sorted(entry_dir.iterdir())
        entry_gib = sum(path.stat().st_size for path in files) / GIB
        mine = {
            "rank": rank,
            "pinned_h2d_gbps": h2d,
            "pinned_s": pinned,
            "registered_s": registered,
            "registered_over_pinned": {r: registered[r] / pinned[r] for r in pinned},
            "registration": stats.host_registration,
            "registered_gib": stats.registered_bytes / GIB,
            "setup_s": setup_s,
            "entry_mapping": vars(mapped_file_memory(files)),
            "process": vars(process_memory()),
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        backend.disable()
        dist.barrier()
    if rank == 0:
        report_run(everyone, entry_gib, device, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
