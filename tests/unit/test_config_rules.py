"""Every validation rule of the worker configuration, one behaviour per test."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from dlo_worker.config import (
    HostBacking,
    OffloadPolicy,
    ParallelOptions,
    ShardingGroup,
    TransferMode,
    WorkerConfig,
    dlo_sharding_group,
    load_settings,
)
from dlo_worker.config import effective as effective_module
from tests.support.configs import DLO, NO_ALLGATHER, config, rejected


def test_defaults_match_the_design_doc() -> None:
    offload = WorkerConfig().offload
    assert offload.dlo_use_allgather is True
    assert offload.dlo_resident_layers == 0
    assert offload.dlo_enable_runtime_cache is False
    assert offload.dlo_runtime_cache_pin_limit_gib == 0
    assert offload.dlo_runtime_cache_lock_timeout > 0
    assert WorkerConfig().effective().offload_policy == OffloadPolicy.NONE


def test_config_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    probe = "import sys, dlo_worker.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_hsdp_with_allgather_is_rejected() -> None:
    message = rejected(parallel={"sequence_parallel_size": 2, "use_hsdp": True}, offload=DLO)
    assert "--use-hsdp" in message
    assert "--dlo-no-use-allgather" in message


def test_hsdp_with_allgather_is_rejected_even_without_a_sharding_group() -> None:
    message = rejected(parallel={"use_hsdp": True}, offload=DLO)
    assert "--use-hsdp" in message


@pytest.mark.parametrize("method", ["fp8-blockwise", "int8", "nf4"])
def test_quantization_other_than_per_tensor_fp8_with_allgather_is_rejected(method: str) -> None:
    message = rejected(model={"quantization": method}, offload=DLO)
    assert f"--quantization {method}" in message
    assert "--dlo-no-use-allgather" in message


def test_per_tensor_fp8_with_allgather_is_accepted() -> None:
    """FP8 blocks are gathered over DP like any other; only a checkpoint mapping is ruled
    out (the quantized weights are not the checkpoint's bytes)."""
    effective = config({"data_parallel_size": 2}, DLO, {"quantization": "fp8"}).effective()
    assert effective.transfer_mode == TransferMode.ALLGATHER
    assert (effective.dlo_sharding_group, effective.dlo_sharding_size) == (
        ShardingGroup.DATA_PARALLEL,
        2,
    )
    assert effective.host_backing_candidates == [HostBacking.ORDINARY]


def test_resident_layers_require_no_allgather() -> None:
    message = rejected(offload={**DLO, "dlo_resident_layers": 2})
    assert "--dlo-resident-layers" in message
    assert "--dlo-no-use-allgather" in message


def test_resident_layers_must_not_be_negative() -> None:
    message = rejected(offload={**NO_ALLGATHER, "dlo_resident_layers": -1})
    assert "--dlo-resident-layers" in message


def test_resident_layers_are_reported_in_the_effective_config() -> None:
    effective = config(offload={**NO_ALLGATHER, "dlo_resident_layers": 2}).effective()
    assert effective.dlo_resident_layers == 2


@pytest.mark.parametrize(
    ("parallel", "offload"),
    [({}, DLO), ({"data_parallel_size": 2}, NO_ALLGATHER)],
    ids=["no-sharding-group", "no-allgather"],
)
def test_shard_buffers_apply_only_to_allgather_over_a_group(
    parallel: dict[str, Any], offload: dict[str, Any]
) -> None:
    message = rejected(parallel=parallel, offload={**offload, "dlo_allgather_shard_buffers": 6})
    assert "--dlo-allgather-shard-buffers applies only to DLO AllGather" in message


@pytest.mark.parametrize("value", [1, 65])
def test_shard_buffers_stay_between_two_and_sixty_four(value: int) -> None:
    message = rejected(
        parallel={"data_parallel_size": 2}, offload={**DLO, "dlo_allgather_shard_buffers": value}
    )
    assert "--dlo-allgather-shard-buffers" in message


def test_shard_buffers_with_allgather_over_dp_are_accepted() -> None:
    accepted = config(
        parallel={"data_parallel_size": 2}, offload={**DLO, "dlo_allgather_shard_buffers": 2}
    )
    assert accepted.offload.dlo_allgather_shard_buffers == 2


def test_runtime_cache_requires_no_allgather() -> None:
    message = rejected(offload={**DLO, "dlo_enable_runtime_cache": True})
    assert "--dlo-enable-runtime-cache" in message
    assert "--dlo-no-use-allgather" in message


@pytest.mark.parametrize("method", ["fp8-blockwise", "int8", "nf4"])
def test_runtime_cache_rejects_quantization_other_than_per_tensor_fp8(method: str) -> None:
    message = rejected(
        offload={**NO_ALLGATHER, "dlo_enable_runtime_cache": True}, model={"quantization": method}
    )
    assert "--dlo-enable-runtime-cache" in message
    assert f"--quantization {method}" in message


def test_fp8_weights_may_live_in_the_runtime_cache_but_never_in_a_checkpoint_mapping() -> None:
    effective = config(
        offload={**NO_ALLGATHER, "dlo_enable_runtime_cache": True}, model={"quantization": "fp8"}
    ).effective()
    assert effective.host_backing_candidates == [HostBacking.RUNTIME_CACHE, HostBacking.ORDINARY]


def test_runtime_cache_rejects_hsdp() -> None:
    message = rejected(
        parallel={"sequence_parallel_size": 2, "use_hsdp": True},
        offload={**NO_ALLGATHER, "dlo_enable_runtime_cache": True},
    )
    assert "--dlo-enable-runtime-cache" in message
    assert "--use-hsdp" in message


def test_positive_pin_limit_registers_a_checkpoint_mapping_without_the_runtime_cache() -> None:
    effective = config(offload={**NO_ALLGATHER, "dlo_runtime_cache_pin_limit_gib": 4}).effective()
    assert effective.host_backing_candidates == [HostBacking.CHECKPOINT_MMAP, HostBacking.ORDINARY]


def test_positive_pin_limit_is_refused_with_allgather() -> None:
    message = rejected(
        parallel={"data_parallel_size": 2},
        offload={
            "enable_distributed_layerwise_offload": True,
            "dlo_runtime_cache_pin_limit_gib": 4,
        },
    )
    assert "--dlo-runtime-cache-pin-limit-gib" in message
    assert "--dlo-no-use-allgather" in message


def test_positive_pin_limit_with_runtime_cache_prefers_the_registered_cache() -> None:
    effective = config(
        offload={
            **NO_ALLGATHER,
            "dlo_enable_runtime_cache": True,
            "dlo_runtime_cache_pin_limit_gib": 48,
        }
    ).effective()
    assert effective.host_backing_candidates == [HostBacking.RUNTIME_CACHE, HostBacking.ORDINARY]


def test_runtime_cache_without_budget_still_prefers_checkpoint_mmap() -> None:
    effective = config(offload={**NO_ALLGATHER, "dlo_enable_runtime_cache": True}).effective()
    assert effective.host_backing_candidates == [
        HostBacking.CHECKPOINT_MMAP,
        HostBacking.RUNTIME_CACHE,
        HostBacking.ORDINARY,
    ]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "inf", "nan", "-inf"])
@pytest.mark.parametrize(
    "field",
    [
        "dlo_runtime_cache_lock_timeout",
        "dlo_runtime_cache_pin_limit_gib",
        "dlo_runtime_cache_size_budget_gib",
    ],
)
def test_numbers_must_be_finite(field: str, value: object) -> None:
    message = rejected(offload={**NO_ALLGATHER, "dlo_enable_runtime_cache": True, field: value})
    assert "--" + field.replace("_", "-") in message
    assert "finite" in message


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--dlo-runtime-cache-lock-timeout", 0),
        ("--dlo-runtime-cache-lock-timeout", -1),
        ("--dlo-runtime-cache-lock-timeout", -0.5),
        ("--dlo-runtime-cache-size-budget-gib", 0),
        ("--dlo-runtime-cache-size-budget-gib", -1),
    ],
)
def test_runtime_cache_lock_timeout_and_size_budget_must_be_positive(
    flag: str, value: float
) -> None:
    field = flag.removeprefix("--").replace("-", "_")
    message = rejected(offload={**NO_ALLGATHER, "dlo_enable_runtime_cache": True, field: value})
    assert f"{flag} must be > 0" in message


@pytest.mark.parametrize("mode", ["off", "required"])
def test_skip_load_modes_require_the_runtime_cache(mode: str) -> None:
    message = rejected(offload={**NO_ALLGATHER, "dlo_runtime_cache_skip_load": mode})
    assert "--dlo-runtime-cache-skip-load requires --dlo-enable-runtime-cache" in message


def test_an_unknown_skip_load_mode_is_rejected() -> None:
    message = rejected(
        offload={
            **NO_ALLGATHER,
            "dlo_enable_runtime_cache": True,
            "dlo_runtime_cache_skip_load": "sometimes",
        }
    )
    assert "--dlo-runtime-cache-skip-load" in message


def test_size_budget_requires_the_runtime_cache() -> None:
    message = rejected(offload={**NO_ALLGATHER, "dlo_runtime_cache_size_budget_gib": 100})
    assert "--dlo-runtime-cache-size-budget-gib requires --dlo-enable-runtime-cache" in message


def test_pin_limit_must_not_be_negative() -> None:
    message = rejected(
        offload={
            **NO_ALLGATHER,
            "dlo_enable_runtime_cache": True,
            "dlo_runtime_cache_pin_limit_gib": -1,
        }
    )
    assert "--dlo-runtime-cache-pin-limit-gib must be >= 0" in message


@pytest.mark.parametrize("root", ["relative/cache", "/var/cache/../tmp"])
def test_runtime_cache_root_must_be_absolute_and_normalized(root: str) -> None:
    message = rejected(
        offload={**NO_ALLGATHER, "dlo_enable_runtime_cache": True, "dlo_runtime_cache_root": root}
    )
    assert "--dlo-runtime-cache-root must be an absolute path" in message


@pytest.mark.parametrize("size_field", ["data_parallel_size", "tensor_parallel_size"])
def test_hsdp_with_dp_or_tp_is_rejected(size_field: str) -> None:
    message = rejected(parallel={size_field: 2, "use_hsdp": True}, offload=NO_ALLGATHER)
    assert "--use-hsdp" in message
    assert "--" + size_field.replace("_", "-") in message


def test_hsdp_with_sp_only_is_accepted_without_allgather() -> None:
    effective = config(
        {"sequence_parallel_size": 4, "use_hsdp": True, "hsdp_replicate_size": 2}, NO_ALLGATHER
    ).effective()
    assert effective.transfer_mode == TransferMode.RANK_LOCAL
    assert effective.host_backing_candidates == [HostBacking.ORDINARY]


def test_hsdp_sizes_must_multiply_to_the_world_size() -> None:
    message = rejected(
        parallel={"sequence_parallel_size": 4, "use_hsdp": True, "hsdp_shard_size": 3},
        offload=NO_ALLGATHER,
    )
    assert "--hsdp-shard-size 3" in message
    assert "world size 4" in message


def test_hsdp_sizes_require_hsdp() -> None:
    message = rejected(parallel={"hsdp_replicate_size": 2})
    assert "require --use-hsdp" in message


@pytest.mark.parametrize(
    "offload",
    [
        {"dlo_resident_layers": 1},
        {"dlo_enable_runtime_cache": True},
        {"dlo_use_allgather": False},
        {"dlo_runtime_cache_pin_limit_gib": 1.0},
    ],
)
def test_dlo_options_without_dlo_are_rejected(offload: dict[str, Any]) -> None:
    message = rejected(offload=offload)
    assert "--enable-distributed-layerwise-offload" in message


def test_cpu_offload_and_layerwise_offload_without_dlo_are_alternatives() -> None:
    message = rejected(offload={"enable_cpu_offload": True, "enable_layerwise_offload": True})
    assert "--enable-cpu-offload" in message
    assert "--enable-layerwise-offload" in message


@pytest.mark.parametrize(
    ("parallel", "use_allgather", "expected"),
    [
        ({}, True, (ShardingGroup.NONE, 1)),
        ({"data_parallel_size": 2}, True, (ShardingGroup.DATA_PARALLEL, 2)),
        ({"sequence_parallel_size": 3}, True, (ShardingGroup.SEQUENCE_PARALLEL, 3)),
        (
            {"data_parallel_size": 2, "sequence_parallel_size": 3},
            True,
            (ShardingGroup.DATA_PARALLEL, 2),
        ),
        ({"tensor_parallel_size": 8}, True, (ShardingGroup.NONE, 1)),
        ({"data_parallel_size": 4}, False, (ShardingGroup.NONE, 1)),
        ({"sequence_parallel_size": 4}, False, (ShardingGroup.NONE, 1)),
    ],
)
def test_effective_sharding_group_is_a_pure_function_of_the_config(
    parallel: dict[str, int], use_allgather: bool, expected: tuple[ShardingGroup, int]
) -> None:
    assert dlo_sharding_group(ParallelOptions(**parallel), use_allgather) == expected


def test_group_of_size_one_transfers_rank_locally_even_with_allgather() -> None:
    effective = config(offload=DLO).effective()
    assert effective.transfer_mode == TransferMode.RANK_LOCAL


def test_unknown_options_are_rejected() -> None:
    message = rejected(offload={**DLO, "dlo_use_allgathr": True})
    assert "--dlo-use-allgathr is not a known option" in message


def test_every_violation_is_reported_in_one_line() -> None:
    message = rejected(
        parallel={"sequence_parallel_size": 2, "use_hsdp": True},
        offload={**DLO, "dlo_resident_layers": 1},
        model={"quantization": "int8"},
    )
    assert message.count(";") >= 2
    assert "--use-hsdp" in message
    assert "--quantization int8" in message
    assert "--dlo-resident-layers" in message


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:"])
def test_device_must_be_known(device: str) -> None:
    assert "--device" in rejected(model={"device": device})


def test_the_effective_configuration_is_resolved_once_at_validation() -> None:
    built = config(offload=DLO)
    assert built.effective() is built.effective()


def test_the_loader_sees_the_runtime_cache_only_where_streamed_dits_may_use_it(
    tmp_path: Path,
) -> None:
    model = {"model": str(tmp_path)}
    cached = {
        **NO_ALLGATHER,
        "dlo_enable_runtime_cache": True,
        "dlo_runtime_cache_root": str(tmp_path / "cache"),
        "dlo_runtime_cache_size_budget_gib": 0.5,
    }
    settings = load_settings(config(offload=cached, model=model))
    assert settings.streams_dit
    assert HostBacking.RUNTIME_CACHE in settings.host_backings
    assert settings.runtime_cache is not None
    assert settings.runtime_cache.root == tmp_path / "cache"
    assert settings.runtime_cache.size_budget_bytes == 2**29
    resident = load_settings(config(model=model))
    assert not resident.streams_dit
    assert resident.runtime_cache is None
    assert resident.host_backings == (HostBacking.ORDINARY,)


def test_loading_needs_a_model_directory() -> None:
    with pytest.raises(ValueError, match="--model is required"):
        load_settings(config(offload=DLO))


def test_the_staging_ring_is_the_default_where_built_and_buffers_elsewhere(monkeypatch) -> None:
    assert config(offload=DLO).effective().dlo_staging == "ring"
    assert config().effective().dlo_staging is None
    monkeypatch.setattr(effective_module, "staging_ring_library", lambda: None)
    assert config(offload=DLO).effective().dlo_staging == "buffers"
    # Asked for where it was not built: refused when the worker starts, not here (the
    # operator validates specs without the worker's native library).
    assert config(offload={**DLO, "dlo_staging": "ring"}).effective().dlo_staging == "ring"


def test_a_ring_chunk_size_with_block_buffers_is_refused() -> None:
    message = rejected(offload={**DLO, "dlo_staging": "buffers", "dlo_staging_chunk_mib": 4})
    assert "--dlo-staging-chunk-mib sizes the staging ring" in message


def test_the_device_budget_refuses_the_options_that_size_the_dit_share_themselves() -> None:
    budget = {"max_gpu_memory_gib": 24}
    for option, flag in (
        ({"dlo_gpu_memory_budget_gib": 10}, "--dlo-gpu-memory-budget-gib"),
        ({"dlo_resident_layers": 2}, "--dlo-resident-layers"),
    ):
        message = rejected(offload={**NO_ALLGATHER, **budget, **option})
        assert f"{flag} and --max-gpu-memory-gib both size" in message
        assert f"drop {flag}" in message
    assert config(offload=budget).offload.max_gpu_memory_gib == 24
    assert config(offload={**NO_ALLGATHER, **budget}).effective().offload_policy == "dlo"


@pytest.mark.parametrize("value", [0, -1, math.inf])
def test_the_device_budget_is_a_positive_finite_size(value: float) -> None:
    message = rejected(offload={"max_gpu_memory_gib": value})
    assert "--max-gpu-memory-gib must be" in message


def test_rank_local_planning_and_streamed_text_encoders_refuse_allgather() -> None:
    dp2 = {"data_parallel_size": 2}
    for option, flag in (
        ({"max_gpu_memory_gib": 24}, "--max-gpu-memory-gib"),
        ({"dlo_stream_text_encoders": "text_encoder_2"}, "--dlo-stream-text-encoders"),
    ):
        message = rejected(parallel=dp2, offload={**DLO, **option})
        assert message.startswith(flag)
        assert "add --dlo-no-use-allgather" in message
        assert config(parallel=dp2, offload={**NO_ALLGATHER, **option})


def test_streamed_text_encoders_are_a_dlo_option_parsed_from_commas() -> None:
    chosen = config(offload={**DLO, "dlo_stream_text_encoders": "text_encoder_2, text_encoder"})
    assert chosen.offload.dlo_stream_text_encoders == ("text_encoder_2", "text_encoder")
    assert load_settings(
        chosen.model_copy(update={"model": chosen.model.model_copy(update={"model": Path("/m")})})
    ).streamed_text_encoders == ("text_encoder_2", "text_encoder")
    message = rejected(offload={"dlo_stream_text_encoders": "text_encoder_2"})
    assert "--dlo-stream-text-encoders apply only to DLO" in message


def test_adapters_loaded_while_serving_are_refused_with_the_device_budget() -> None:
    from dlo_worker.config.rules import runtime_lora_errors

    (message,) = runtime_lora_errors(config(offload={"max_gpu_memory_gib": 24}))
    assert message.startswith("--lora-load-dir with --max-gpu-memory-gib")
