"""Checkpoint-backed DLO on CUDA (bf16): pinned staging rank-locally, NCCL AllGather on two GPUs.

The demo pipeline's transformer is stored in bfloat16 (the CUDA runtime dtype) as
single-file, sharded and fused-QKV checkpoints; every variant must match resident
execution bit for bit through the worker's own loading path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dlo_worker.config import HostBacking
from dlo_worker.offload import OffloadConfig
from dlo_worker.process.worker import Worker
from tests.support import checkpoints
from tests.support.checkpoints import (
    run_staging_ring,
    run_worker,
    spawn_against_resident,
    transformer_outputs,
    worker_config,
)
from tests.support.launch import join_world_as

VARIANTS = ("single", "sharded", "fused")


@pytest.fixture(scope="module")
def variants(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return checkpoints.bfloat16_variants(demo_model_dir, tmp_path_factory.mktemp("cuda-variants"))


@pytest.fixture(scope="module")
def resident(variants: dict[str, Path]) -> list[torch.Tensor]:
    outputs, _ = run_worker(worker_config(variants["single"], dlo=False, device="cuda"))
    return outputs


@pytest.mark.parametrize("variant", VARIANTS)
def test_rank_local_staging_on_cuda_is_bitwise_equal(variant, variants, resident) -> None:
    """Block buffers, asked for (the ring is the default)."""
    config = worker_config(variants[variant], dlo=True, device="cuda", dlo_staging="buffers")
    outputs, worker = run_worker(config)
    assert all(torch.equal(a, b) for a, b in zip(outputs, resident, strict=True))
    assert worker.backing.backing == HostBacking.CHECKPOINT_MMAP
    stats = worker.stats
    assert stats.host_bytes == 0
    assert stats.staging_bytes == OffloadConfig().staging_buffers * stats.largest_block_bytes
    assert stats.on_demand_loads == 0  # the staging buffers prefetch like the pinned arena
    assert stats.staging == "buffers"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_default_staging_on_cuda_is_the_ring(variant, variants, resident) -> None:
    outputs, worker = run_worker(worker_config(variants[variant], dlo=True, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(outputs, resident, strict=True))
    stats = worker.stats
    assert (stats.staging, stats.staging_reason) == ("ring", "default")
    assert stats.on_demand_loads == 0
    assert stats.ring_chunks > 0
    assert stats.ring_feeder_enqueue_seconds > 0  # the feeder's CUDA calls, timed
    assert stats.ring_copy_wait_seconds <= stats.ring_full_wait_seconds
    assert stats.h2d_gbps > 0


@pytest.mark.parametrize("registered", [False, True], ids=["ring", "registered"])
def test_fp8_from_the_runtime_cache_on_cuda_is_bitwise_equal(
    registered: bool, variants, tmp_path: Path
) -> None:
    """FP8 block weights in a runtime-cache entry, staged through the ring or registered,
    write the resident FP8 outputs; the second start binds the entry without loading."""
    fp8 = {"quantization": "fp8"}
    expected, _ = run_worker(worker_config(variants["single"], dlo=False, device="cuda", model=fp8))
    cached = {
        "dlo_enable_runtime_cache": True,
        "dlo_runtime_cache_root": str(tmp_path / "cache"),
        "dlo_runtime_cache_pin_limit_gib": 1.0 if registered else 0.0,
    }
    config = worker_config(variants["single"], dlo=True, device="cuda", model=fp8, **cached)
    for start in ("built entry", "skip-load hit"):
        outputs, worker = run_worker(config)
        assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True)), start
        assert worker.backing.backing == HostBacking.RUNTIME_CACHE
        assert start.split()[0] in worker.backing.reason
        stats = worker.stats
        assert stats.host_registration == ("registered" if registered else "off")
        assert stats.staging == ("none" if registered else "ring")


@pytest.mark.parametrize("chunk_bytes", [4096, OffloadConfig().ring_chunk_bytes])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_native_staging_ring_on_cuda_is_bitwise_equal(
    variant, chunk_bytes, variants, resident
) -> None:
    """The ring's threads wait for the slot's release, copy every chunk and record the
    ready event on the copy stream; compute orders itself after that event."""
    outputs, stats, smallest_block = run_staging_ring(
        variants[variant], torch.device("cuda", 0), torch.bfloat16, chunk_bytes
    )
    assert all(torch.equal(a, b) for a, b in zip(outputs, resident, strict=True))
    assert stats.staging == "ring"
    assert stats.on_demand_loads == 0
    assert stats.bytes_streamed >= stats.blocks_loaded * smallest_block > 0
    assert stats.h2d_gbps > 0  # the ring's own timing events around each fill


def _allgather_rank(rank: int, world_size: int, port: int, model: str, expected: str) -> None:
    join_world_as(rank, world_size, port)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    config = worker_config(
        Path(model),
        dlo=True,
        allgather=True,
        device=f"cuda:{rank}",
        parallel={"data_parallel_size": world_size},
    )
    with Worker(config) as worker:
        closed = worker.backend.host_weights.closed
        outputs = transformer_outputs(worker.pipeline.transformer)
        stats = worker.backend.stats()
    assert all(torch.equal(a, b) for a, b in zip(outputs, torch.load(expected), strict=True))
    assert closed
    assert (stats.host_backing, stats.transfer_mode, stats.shards) == (
        "checkpoint-mmap",
        "allgather",
        world_size,
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("variant", ["sharded", "fused"])
def test_nccl_allgather_from_the_checkpoint_is_bitwise_equal(
    variant, variants, resident, tmp_path: Path
) -> None:
    spawn_against_resident(_allgather_rank, variants[variant], resident, tmp_path)
