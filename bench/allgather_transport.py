"""How an all-gather over NVLink slows the host-to-device copies it runs beside.

DLO with AllGather copies each rank's shard of a block over PCIe while the previous
block is gathered over NVLink. Measured in the Flux DP=2 benchmark, the copies ran at
51-52.5 GB/s during gathers against 54.5-55.5 GB/s alone. This benchmark isolates that,
per rank, for a Flux double-stream block (680 MB gathered, 340 MB shard per rank on two
GPUs), for two transports:

- ``nccl``: ``all_gather_into_tensor`` (SM kernels pushing over NVLink);
- ``copy_engine``: the shards sit in symmetric memory; each rank pulls its peers' shards
  with copy-engine copies between two device barriers (no SMs), as PyTorch's
  low-contention all-gather does.

Run:  torchrun --nproc-per-node 2 bench/allgather_transport.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

BLOCK_BYTES = 681_836_544
H2D_BYTES = 2**30
H2D_REPEATS = 10


def _timed(stream: torch.cuda.Stream, work, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    with torch.cuda.stream(stream):
        for _ in range(repeats):
            work()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


class CopyEngineGather:
    """Pull every peer's shard out of symmetric memory with copy-engine copies."""

    def __init__(self, shard_numel: int, device: torch.device, group) -> None:
        self.shard = symm_mem.empty(shard_numel, dtype=torch.bfloat16, device=device)
        self.handle = symm_mem.rendezvous(self.shard, group)
        self.peers = [
            self.handle.get_buffer(rank, (shard_numel,), torch.bfloat16)
            for rank in range(self.handle.world_size)
        ]

    def __call__(self, full: torch.Tensor) -> None:
        chunks = full.chunk(len(self.peers))
        self.handle.barrier(channel=0)
        for rank, peer in enumerate(self.peers):
            chunks[rank].copy_(peer)
        self.handle.barrier(channel=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    group = dist.group.WORLD

    host = torch.empty(H2D_BYTES, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(H2D_BYTES, dtype=torch.uint8, device=device)
    shard_numel = BLOCK_BYTES // 2 // world
    nccl_shard = torch.empty(shard_numel, dtype=torch.bfloat16, device=device)
    full = torch.empty(shard_numel * world, dtype=torch.bfloat16, device=device)
    copy_engine = CopyEngineGather(shard_numel, device, group)
    transports = {
        "nccl": lambda: dist.all_gather_into_tensor(full, nccl_shard, group=group),
        "copy_engine": lambda: copy_engine(full),
    }
    copy_stream, gather_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def h2d() -> None:
        target.copy_(host, non_blocking=True)

    for work in (h2d, *transports.values()):
        _timed(gather_stream, work, 2)
    dist.barrier()
    report: dict = {"world_size": world, "torch": torch.__version__, "rank": {}}
    row = {"h2d_alone_gbps": H2D_BYTES / _timed(copy_stream, h2d, H2D_REPEATS) / 1e9}
    for name, gather in transports.items():
        dist.barrier()
        row[f"{name}_gather_ms"] = _timed(gather_stream, gather, 10) * 1e3
        # Enough gathers to outlast the copies, started together with them.
        gathers = int(H2D_REPEATS * H2D_BYTES / 54e9 / (row[f"{name}_gather_ms"] / 1e3)) + 4
        dist.barrier()
        torch.cuda.synchronize()
        with torch.cuda.stream(gather_stream):
            for _ in range(gathers):
                gather()
        row[f"h2d_during_{name}_gbps"] = H2D_BYTES / _timed(copy_stream, h2d, H2D_REPEATS) / 1e9
        torch.cuda.synchronize()
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        report["rank"] = {str(rank): values for rank, values in enumerate(rows)}
        print(json.dumps(report, indent=2))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
