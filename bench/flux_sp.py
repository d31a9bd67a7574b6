"""Sequence parallelism with DLO on the Flux-class DiT: SP=2 DLO against SP=2 resident.

Run under torchrun, one process per GPU; every rank runs the same request, as one SP
group of the worker does (``--sequence-parallel-size 2``). Same model and inputs as
``bench/flux_dlo.py`` (random bf16 weights, 57 blocks), in one process per rank:

- SP resident: the whole DiT on every GPU, diffusers' Ulysses context parallelism;
- SP DLO: DLO enabled first (AllGather over the SP group: each rank holds half of every
  block in pinned host memory), then the same context parallelism, as the worker does;
- the bound: streamed bytes / (ranks x pinned H2D measured while every rank copies) plus
  one measured all-gather of the largest block; limit = max(SP resident step, bound).

    torchrun --nproc-per-node 2 bench/flux_sp.py --resolutions 1024 2048 --json flux_sp.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from flux_dlo import (
    allgather_seconds,
    build_flux,
    flux_inputs,
    peak_gib,
    pinned_h2d_gbps,
    release,
    step_seconds,
)

from dlo_worker.config import ParallelOptions
from dlo_worker.offload import enable_dlo
from dlo_worker.pipeline import sequence_parallel


def with_sequence_parallelism(model: torch.nn.Module, device: torch.device, size: int) -> None:
    sequence_parallel.apply(
        SimpleNamespace(components={"transformer": model}),
        ParallelOptions(sequence_parallel_size=size),
        device,
        ("transformer",),
    )


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    dist.barrier()
    bandwidth = pinned_h2d_gbps(device)  # every rank copies at once, as DLO's ranks do
    report: dict = {
        "gpu": torch.cuda.get_device_name(device),
        "sequence_parallel_size": world,
        "torch": torch.__version__,
        "pinned_h2d_gbps": bandwidth,
        "results": {},
    }
    # diffusers' context-parallel output hook gathers tensors, not output dataclasses
    # (pipelines call their DiT with return_dict=False too).
    inputs = {
        resolution: {**flux_inputs(resolution, device), "return_dict": False}
        for resolution in args.resolutions
    }

    model = build_flux(device)
    with_sequence_parallelism(model, device, world)
    resident = {}
    for resolution in args.resolutions:
        release(device)
        resident[resolution] = (
            step_seconds(model, inputs[resolution], args.repeats),
            peak_gib(device),
        )
    del model
    release(device)

    model = build_flux(device)
    backend = enable_dlo(model, device=device, use_allgather=True, process_group=dist.group.WORLD)
    with_sequence_parallelism(model, device, world)
    layouts = backend.block_layouts()
    block_bytes = sum(layout.nbytes for layout in layouts)
    gather_s = allgather_seconds(max(layout.nbytes for layout in layouts), device)
    bound_s = block_bytes / (world * bandwidth * 1e9) + gather_s
    for resolution in args.resolutions:
        release(device)
        dlo_s = step_seconds(model, inputs[resolution], args.repeats)
        resident_s, resident_peak = resident[resolution]
        report["results"][resolution] = {
            "sp_resident_s": resident_s,
            "sp_resident_peak_gib": resident_peak,
            "transfer_bound_s": bound_s,
            "sp_dlo_s": dlo_s,
            "sp_dlo_peak_gib": peak_gib(device),
            "dlo_over_sp_resident": dlo_s / resident_s,
            "dlo_over_limit": dlo_s / max(resident_s, bound_s),
        }
    stats = backend.stats()
    report["dlo"] = {
        "block_gib": block_bytes / 2**30,
        "shards": stats.shards,
        "host_gib_per_rank": stats.host_bytes / 2**30,
        "achieved_h2d_gbps": stats.h2d_gbps,
        "on_demand_loads": stats.on_demand_loads,
        "allgather_s_largest_block": gather_s,
    }
    backend.disable()
    dist.destroy_process_group()
    return report


def print_report(report: dict) -> None:
    dlo = report["dlo"]
    print(
        f"# {report['gpu']} x{report['sequence_parallel_size']}, torch {report['torch']}, "
        f"pinned H2D {report['pinned_h2d_gbps']:.1f} GB/s per GPU (all copying), blocks "
        f"{dlo['block_gib']:.2f} GiB in {dlo['shards']} shards, H2D achieved "
        f"{dlo['achieved_h2d_gbps']:.1f} GB/s, on-demand loads {dlo['on_demand_loads']}"
    )
    for resolution, row in report["results"].items():
        print(
            f"{resolution}x{resolution}: SP={report['sequence_parallel_size']} resident "
            f"{row['sp_resident_s']:.3f} s (peak {row['sp_resident_peak_gib']:.1f} GiB) | bound "
            f"{row['transfer_bound_s']:.3f} s | SP DLO {row['sp_dlo_s']:.3f} s (peak "
            f"{row['sp_dlo_peak_gib']:.1f} GiB) = {row['dlo_over_sp_resident']:.3f}x SP resident, "
            f"{row['dlo_over_limit']:.3f}x limit"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="Also write rank 0's report as JSON here.")
    args = parser.parse_args()
    report = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print_report(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
