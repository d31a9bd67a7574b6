"""Checkpoint-backed DLO: bitwise equal to resident, in both transfer modes and every layout.

The demo pipeline is rewritten as single-file, sharded (index + 4 shards) and fused-QKV
(the adapter's layout) checkpoints. For each, the worker's real loading path
(DiffusersPipelineLoader -> MappedCheckpoint -> backend) must produce the resident
outputs bit for bit, rank-locally (mapped views + pinned staging) and with AllGather
over two gloo processes (shards packed from the mapping, mapping then closed).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from dlo_worker.cli.main import main as worker_main
from dlo_worker.config import HostBacking, load_settings
from dlo_worker.loader.checkpoint import CheckpointError
from dlo_worker.loader.diffusers_loader import DiffusersPipelineLoader
from dlo_worker.loader.mapped_checkpoint import HostWeightsError
from dlo_worker.observability import metrics
from dlo_worker.offload import DiscoveryError, OffloadConfig
from dlo_worker.offload.feeds.ring import runqueue_wait_seconds
from dlo_worker.offload.setup import StreamSetup
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
from tests.support.ports import free_port
from tests.support.ranks import spawn_ranks

VARIANTS = ("single", "sharded", "fused")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def variants(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    copy = checkpoints.copy_pipeline
    return {
        "single": demo_model_dir,
        "sharded": checkpoints.shard(copy(demo_model_dir, root / "sharded")),
        "fused": checkpoints.fuse_qkv(copy(demo_model_dir, root / "fused")),
        "mixed": checkpoints.add_foreign_tensor(copy(demo_model_dir, root / "mixed")),
    }


@pytest.fixture(scope="module")
def resident(demo_model_dir: Path) -> list[torch.Tensor]:
    outputs, worker = run_worker(worker_config(demo_model_dir, dlo=False))
    assert worker.backing.backing == HostBacking.ORDINARY
    return outputs


def assert_bitwise(outputs: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))


@pytest.mark.parametrize("variant", VARIANTS)
def test_resident_loading_reads_every_layout(variant, variants, resident) -> None:
    outputs, worker = run_worker(worker_config(variants[variant], dlo=False))
    assert_bitwise(outputs, resident)
    assert worker.backing.backing == HostBacking.ORDINARY


@pytest.mark.parametrize("variant", VARIANTS)
def test_rank_local_checkpoint_backing_is_bitwise_equal(variant, variants, resident) -> None:
    """By default the mapping is staged through the native ring (built here)."""
    started = REGISTRY.get_sample_value(
        "dlo_staging_starts_total", {"staging": "ring", "reason": "default"}
    )
    outputs, worker = run_worker(worker_config(variants[variant], dlo=True))
    assert_bitwise(outputs, resident)
    stats = worker.stats
    assert worker.backing.backing == HostBacking.CHECKPOINT_MMAP
    assert stats.host_backing == "checkpoint-mmap"
    assert stats.host_bytes == 0  # no private copy of the blocks
    assert (stats.staging, stats.staging_reason) == ("ring", "default")
    config = OffloadConfig()
    assert stats.ring_chunk_bytes == config.ring_chunk_bytes
    assert stats.staging_bytes == 2 * config.pack_threads * config.ring_chunk_bytes
    assert stats.ring_chunks > 0
    assert stats.ring_copy_wait_seconds <= stats.ring_full_wait_seconds
    # The ring's threads' wait for a CPU, wherever this kernel keeps scheduler statistics.
    kernel_reports = runqueue_wait_seconds([threading.get_native_id()]) is not None
    assert (stats.ring_runqueue_wait_seconds is not None) == kernel_reports
    assert stats.pack_gbps > 0
    assert stats.host_registration == "off"
    assert (
        REGISTRY.get_sample_value(
            "dlo_staging_starts_total", {"staging": "ring", "reason": "default"}
        )
        == (started or 0) + 1
    )
    for activity in ("pack", "copy_wait", "feeder_enqueue", "runqueue_wait"):
        seconds = REGISTRY.get_sample_value("dlo_staging_ring_seconds", {"activity": activity})
        assert seconds is not None, activity
    if variant == "fused":
        assert "adapters: fused-qkv" in worker.backing.reason


def test_block_buffers_when_asked_for_are_bitwise_equal(variants, resident) -> None:
    outputs, worker = run_worker(
        worker_config(variants["sharded"], dlo=True, dlo_staging="buffers")
    )
    assert_bitwise(outputs, resident)
    stats = worker.stats
    assert (stats.staging, stats.staging_reason) == ("buffers", "configured")
    assert stats.staging_bytes == OffloadConfig().staging_buffers * stats.largest_block_bytes
    assert stats.ring_chunks == stats.ring_chunk_bytes == 0
    assert stats.pack_gbps > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_native_staging_ring_is_bitwise_equal(variant, variants, resident) -> None:
    """The loader's checkpoint mapping streamed through the chunk ring (its CPU mode: memcpy
    for the copy engine), with 4 KiB chunks so every block is many chunks and pieces
    straddle them."""
    outputs, stats, smallest_block = run_staging_ring(variants[variant], CPU, torch.float32, 4096)
    assert_bitwise(outputs, resident)
    assert stats.staging == "ring"
    assert stats.host_bytes == 0
    assert stats.bytes_streamed >= stats.blocks_loaded * smallest_block > 0
    assert stats.pack_gbps > 0


def test_a_registration_budget_on_the_cpu_stages_and_says_why(variants, resident) -> None:
    """Registration needs a CUDA device: the CPU keeps staging, logged and counted."""
    counted = REGISTRY.get_sample_value("dlo_host_registrations_total", {"result": "cpu"}) or 0
    config = worker_config(variants["single"], dlo=True, dlo_runtime_cache_pin_limit_gib=1)
    outputs, worker = run_worker(config)
    assert_bitwise(outputs, resident)
    assert worker.stats.host_registration == "cpu"
    assert worker.stats.registered_bytes == 0
    assert worker.stats.staging_bytes > 0
    assert (
        REGISTRY.get_sample_value("dlo_host_registrations_total", {"result": "cpu"}) == counted + 1
    )


@pytest.mark.parametrize(("variant", "registrable"), [("single", True), ("fused", False)])
def test_only_mappings_without_adapters_are_registrable(variant, registrable, variants) -> None:
    config = worker_config(variants[variant], dlo=True)
    loader = DiffusersPipelineLoader(
        load_settings(config), dtype=torch.float32, device=torch.device("cpu")
    )
    loader.load()
    mapped = loader.take_host_weights()
    try:
        assert mapped.registrable is registrable
    finally:
        mapped.close()


def test_the_dit_is_never_materialized_and_the_mapping_is_taken_once(variants) -> None:
    loader = DiffusersPipelineLoader(
        load_settings(worker_config(variants["sharded"], dlo=True)),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    pipeline = loader.load()
    assert all(parameter.is_meta for parameter in pipeline.transformer.parameters())
    assert not any(parameter.is_meta for parameter in pipeline.vae.parameters())
    mapped = loader.take_host_weights()
    assert mapped is not None
    assert loader.take_host_weights() is None
    assert len(mapped.coverage.files) == 4
    assert mapped.coverage.nbytes == sum(
        parameter.numel() * parameter.element_size()
        for parameter in pipeline.transformer.state_dict(keep_vars=True).values()
    )
    mapped.close()
    with pytest.raises(HostWeightsError, match="closed"):
        mapped.tensor("transformer", "proj_out_2.weight")


def test_a_mixed_source_falls_back_as_a_unit_and_is_counted(variants, resident) -> None:
    counter = metrics.HOST_BACKING_FALLBACKS.labels(reason="mixed")
    before = counter._value.get()
    outputs, worker = run_worker(worker_config(variants["mixed"], dlo=True))
    assert_bitwise(outputs, resident)
    assert worker.backing.backing == HostBacking.ORDINARY
    assert "text_encoder.embeddings.weight" in worker.backing.reason
    assert worker.stats.host_backing == "ordinary"
    assert counter._value.get() == before + 1


def test_a_dtype_conversion_falls_back_to_ordinary_loading(variants) -> None:
    config = worker_config(variants["single"], dlo=True, model={"dtype": "bfloat16"})
    loader = DiffusersPipelineLoader(
        load_settings(config), dtype=torch.bfloat16, device=torch.device("cpu")
    )
    pipeline = loader.load()
    assert loader.take_host_weights() is None
    assert loader.decision.backing == HostBacking.ORDINARY
    assert "stores float32 but the runtime dtype is bfloat16" in loader.decision.reason
    assert pipeline.transformer.proj_out_2.weight.dtype == torch.bfloat16


def test_block_paths_dlo_cannot_use_fail_before_any_weight_loads(variants) -> None:
    config = worker_config(variants["single"], dlo=True, dlo_block_paths=["no_such_blocks"])
    with pytest.raises(DiscoveryError, match="no_such_blocks"):
        DiffusersPipelineLoader(
            load_settings(config), dtype=torch.float32, device=torch.device("cpu")
        ).load()


def test_failing_to_consume_a_mapping_is_a_hard_error(
    variants, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the backend fails after the loader handed over a mapping."""

    def fail(*_args: object) -> None:
        raise RuntimeError("injected: host fill failed")

    monkeypatch.setattr(StreamSetup, "fill_host", fail)
    config = worker_config(variants["single"], dlo=True)
    with pytest.raises(HostWeightsError, match="DiT was not loaded ordinarily"):
        run_worker(config)


def test_corrupt_checkpoints_are_clear_errors(variants, tmp_path: Path) -> None:
    broken = checkpoints.copy_pipeline(variants["sharded"], tmp_path / "broken")
    shard = next((broken / "transformer").glob("*-00002-of-00004.safetensors"))
    shard.unlink()
    with pytest.raises(CheckpointError, match="named in the index is missing"):
        run_worker(worker_config(broken, dlo=True))


# --- AllGather over two gloo processes ------------------------------------------------------


def _allgather_rank(rank: int, world_size: int, port: int, model: str, expected: str) -> None:
    join_world_as(rank, world_size, port)
    torch.set_num_threads(1)
    config = worker_config(
        Path(model), dlo=True, allgather=True, parallel={"data_parallel_size": world_size}
    )
    with Worker(config) as worker:
        mapping_closed = worker.backend.host_weights.closed
        outputs = transformer_outputs(worker.pipeline.transformer)
        stats = worker.backend.stats()
    assert_bitwise(outputs, torch.load(expected))
    assert mapping_closed  # every rank prepared its shard, then released the mapping
    assert stats.host_backing == "checkpoint-mmap"
    assert stats.transfer_mode == "allgather"
    assert stats.shards == world_size
    assert stats.staging_bytes == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_allgather_checkpoint_backing_is_bitwise_equal(
    variant, variants, resident, tmp_path: Path
) -> None:
    spawn_against_resident(_allgather_rank, variants[variant], resident, tmp_path)


def test_generate_names_a_truncated_checkpoint_and_exits_2(
    variants, tmp_path: Path, capsys
) -> None:
    broken = checkpoints.copy_pipeline(variants["single"], tmp_path / "truncated")
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    code = worker_main(
        ["generate", "--model", str(broken), "--device", "cpu", "--out", str(tmp_path / "x.png")]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"{weights}: " in err
    assert "the file is truncated; copy it again" in err
    assert "copy it again" in err
    assert not (tmp_path / "x.png").exists()


def test_generate_reports_the_chosen_backing(variants, tmp_path: Path, capsys) -> None:
    out = tmp_path / "x.png"
    code = worker_main(
        [
            "generate",
            "--model",
            str(variants["fused"]),
            "--device",
            "cpu",
            "--steps",
            "1",
            "--out",
            str(out),
            "--enable-distributed-layerwise-offload",
            "--dlo-no-use-allgather",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "host backing: checkpoint-mmap - transformer: checkpoint-mmap (" in printed
    assert "adapters: fused-qkv" in printed


# --- Page sharing between processes on one node ---------------------------------------------


def _sharing_rank(rank: int, world_size: int, port: int, model: str, out: str) -> None:
    import json

    import torch.distributed as dist

    from dlo_worker.observability.memory import mapped_file_memory

    join_world_as(rank, world_size, port)
    torch.set_num_threads(1)
    config = worker_config(Path(model), dlo=True, parallel={"data_parallel_size": world_size})
    with Worker(config) as worker:
        files = worker.backend.host_weights.coverage.files
        transformer_outputs(worker.pipeline.transformer)
        dist.barrier()  # every process has streamed every block
        usage = mapped_file_memory(files)
        dist.barrier()  # nobody unmaps before everyone measured
    Path(out, f"{rank}.json").write_text(
        json.dumps(
            {
                # Freshly written files may still be dirty in the page cache: shared either way.
                "shared": usage.shared_clean + usage.shared_dirty,
                "private": usage.private,
                "copied_on_write": usage.anonymous,
                "file_bytes": sum(file.stat().st_size for file in files),
            }
        )
    )


def test_processes_share_the_checkpoint_pages(variants, tmp_path: Path) -> None:
    import json

    spawn_ranks(_sharing_rank, (2, free_port(), str(variants["sharded"]), str(tmp_path)), 2)
    for rank in range(2):
        usage = json.loads((tmp_path / f"{rank}.json").read_text())
        assert usage["copied_on_write"] == 0  # the mapping was never written to
        assert usage["private"] == 0  # every resident page is also mapped by the other process
        assert usage["shared"] >= 0.9 * usage["file_bytes"]
