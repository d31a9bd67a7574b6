"""Registered direct transfer on CUDA: the mapped weights are registered read-only with the
driver and copied straight into the slots, bitwise equal to resident execution.

Sources: an exactly matching checkpoint mapping and a runtime-cache entry. A budget too
small, a checkpoint adapter and a registration that fails in the middle (a range that is
already registered) all fall back to staging with the reason recorded, leaving nothing
registered. Shutdown unregisters before the mappings close and before the process
groups are destroyed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file

from dlo_worker.config import HostBacking
from dlo_worker.offload.feeds.cuda_registrar import HOST_REGISTER_READ_ONLY, CudaHostRegistrar
from dlo_worker.offload.feeds.registration import (
    RegisteredRanges,
    RegistrationRefusedError,
    SharedFileViews,
    extent_of,
    mapping_of,
    page_ranges,
    read_mappings,
)
from tests.support import checkpoints
from tests.support.checkpoints import run_worker, worker_config
from tests.support.launch import join_world_as
from tests.support.ports import free_port

GIB = 1.0


@pytest.fixture(scope="module")
def variants(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return checkpoints.bfloat16_variants(demo_model_dir, tmp_path_factory.mktemp("registered"))


@pytest.fixture(scope="module")
def resident(variants: dict[str, Path]) -> list[torch.Tensor]:
    outputs, _ = run_worker(worker_config(variants["single"], dlo=False, device="cuda"))
    return outputs


def assert_bitwise(outputs: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))


@pytest.mark.parametrize("variant", ["single", "sharded"])
def test_a_registered_checkpoint_is_copied_directly_and_bitwise_equal(
    variant, variants, resident
) -> None:
    config = worker_config(
        variants[variant], dlo=True, device="cuda", dlo_runtime_cache_pin_limit_gib=GIB
    )
    outputs, worker = run_worker(config)
    assert_bitwise(outputs, resident)
    stats = worker.stats
    assert worker.backing.backing == HostBacking.CHECKPOINT_MMAP
    assert stats.host_registration == "registered"
    assert stats.registered_bytes > 0
    assert (stats.staging_bytes, stats.host_bytes, stats.pack_gbps) == (0, 0, 0.0)
    assert stats.on_demand_loads == 0


def test_a_registered_runtime_cache_entry_is_bitwise_equal(
    variants, resident, tmp_path: Path
) -> None:
    config = worker_config(
        variants["single"],
        dlo=True,
        device="cuda",
        dlo_enable_runtime_cache=True,
        dlo_runtime_cache_root=str(tmp_path / "cache"),
        dlo_runtime_cache_pin_limit_gib=GIB,
    )
    for _start in ("build", "hit"):  # the first start publishes the entry, the second maps it
        outputs, worker = run_worker(config)
        assert_bitwise(outputs, resident)
        assert worker.backing.backing == HostBacking.RUNTIME_CACHE
        assert worker.stats.host_registration == "registered"
        assert worker.stats.staging_bytes == 0


@pytest.mark.parametrize(
    ("variant", "budget", "reason"),
    [("single", 1e-6, "budget"), ("fused", GIB, "adapter")],
)
def test_refused_registration_stages_and_says_why(
    variant, budget, reason, variants, resident
) -> None:
    config = worker_config(
        variants[variant], dlo=True, device="cuda", dlo_runtime_cache_pin_limit_gib=budget
    )
    outputs, worker = run_worker(config)
    assert_bitwise(outputs, resident)
    assert worker.stats.host_registration == reason
    assert worker.stats.registered_bytes == 0
    assert worker.stats.staging_bytes > 0


def test_a_failure_in_the_middle_unregisters_every_earlier_range(tmp_path: Path) -> None:
    """Two mapped files; the second file's range is already registered, so registering
    it again fails: the first must be unregistered and the CUDA error cleared."""
    translator = SharedFileViews()
    views = []
    for index in range(2):
        path = tmp_path / f"{index}.safetensors"
        save_file({"w": torch.randn(1 << 20)}, str(path))
        with safe_open(str(path), framework="pt") as handle:
            private = handle.get_tensor("w")
        views.append(translator.view_of(private, mapping_of(private, read_mappings())))
    mappings = read_mappings()
    ranges = page_ranges(extent_of(view, mappings) for view in views)
    cudart = torch.cuda.cudart()
    taken = ranges[-1]
    assert int(cudart.cudaHostRegister(taken.start, taken.nbytes, HOST_REGISTER_READ_ONLY)) == 0
    registrar = CudaHostRegistrar(torch.device("cuda", 0))
    try:
        with pytest.raises(RegistrationRefusedError) as refused:
            RegisteredRanges.register(views, registrar, budget_bytes=1 << 30, timeout_s=60)
        assert refused.value.reason == "failed"
        first = next(view for view in views if extent_of(view, mappings).start < taken.start)
        assert not registrar.is_pinned(first)  # rolled back
        torch.ones(4, device="cuda").sum().item()  # no sticky error left for torch
    finally:
        assert int(cudart.cudaHostUnregister(taken.start)) == 0


ORDER = (
    "host ranges registered",
    "host ranges unregistered",
    "checkpoint mapping closed",
    "dlo disabled",
    "process groups destroyed",
)


def _registered_rank(rank: int, world_size: int, port: int, model: str, log: str) -> None:
    join_world_as(rank, world_size, port)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    handler = logging.FileHandler(f"{log}.{rank}")
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    config = worker_config(
        Path(model),
        dlo=True,
        device=f"cuda:{rank}",
        parallel={"data_parallel_size": world_size},
        dlo_runtime_cache_pin_limit_gib=GIB,
    )
    _, worker = run_worker(config)
    handler.close()
    assert worker.stats.host_registration == "registered"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_register_one_mapping_and_unregister_before_teardown(
    variants, tmp_path: Path
) -> None:
    """Two DP ranks on two GPUs register the same checkpoint pages (shared through the page
    cache); each unregisters before its mapping closes and before the process groups go."""
    log = str(tmp_path / "rank.log")
    mp.spawn(_registered_rank, args=(2, free_port(), str(variants["single"]), log), nprocs=2)
    for rank in range(2):
        lines = Path(f"{log}.{rank}").read_text().splitlines()
        positions = [lines.index(message) for message in ORDER]
        assert positions == sorted(positions), (rank, lines)
