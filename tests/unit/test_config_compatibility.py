"""Each row of the compatibility table in docs/configuration.md (features, parallelism and
their combinations), as an accepted or rejected configuration.
"""

from __future__ import annotations

from typing import Any

import pytest

from dlo_worker.config import (
    ConfigError,
    HostBacking,
    OffloadPolicy,
    ShardingGroup,
    TransferMode,
)
from tests.support.configs import DLO, NO_ALLGATHER, config

ACCEPTED = {
    "dp-allgather": ({"data_parallel_size": 4}, DLO, {}),
    "dp-no-allgather": ({"data_parallel_size": 4}, NO_ALLGATHER, {}),
    "sp-allgather": ({"sequence_parallel_size": 2}, DLO, {}),
    "sp-no-allgather": ({"sequence_parallel_size": 2}, NO_ALLGATHER, {}),
    "tp-allgather-ordinary-loader": ({"tensor_parallel_size": 2}, DLO, {}),
    "tp-no-allgather-ordinary-loader": ({"tensor_parallel_size": 2}, NO_ALLGATHER, {}),
    "hsdp-no-allgather": ({"sequence_parallel_size": 2, "use_hsdp": True}, NO_ALLGATHER, {}),
    "fp8-allgather": ({"data_parallel_size": 2}, DLO, {"quantization": "fp8"}),
    "fp8-no-allgather": ({"data_parallel_size": 2}, NO_ALLGATHER, {"quantization": "fp8"}),
    "other-quantization-no-allgather": ({}, NO_ALLGATHER, {"quantization": "int8"}),
    "resident-layers-no-allgather": ({}, {**NO_ALLGATHER, "dlo_resident_layers": 3}, {}),
    "dp-sp-allgather": ({"data_parallel_size": 2, "sequence_parallel_size": 2}, DLO, {}),
    "dp-tp-sp-no-allgather": (
        {"data_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel_size": 2},
        NO_ALLGATHER,
        {},
    ),
    "runtime-cache-tp-no-allgather": (
        {"tensor_parallel_size": 2},
        {**NO_ALLGATHER, "dlo_enable_runtime_cache": True},
        {},
    ),
}

REJECTED = {
    "hsdp-allgather": (
        {"sequence_parallel_size": 2, "use_hsdp": True},
        DLO,
        {},
        ["--use-hsdp", "DLO AllGather"],
    ),
    "other-quantization-allgather": (
        {},
        DLO,
        {"quantization": "int8"},
        ["--quantization int8", "--dlo-no-use-allgather"],
    ),
    "resident-layers-allgather": (
        {},
        {**DLO, "dlo_resident_layers": 1},
        {},
        ["--dlo-resident-layers", "--dlo-no-use-allgather"],
    ),
    "hsdp-with-dp": (
        {"data_parallel_size": 2, "use_hsdp": True},
        NO_ALLGATHER,
        {},
        ["--use-hsdp", "--data-parallel-size"],
    ),
    "hsdp-with-tp": (
        {"tensor_parallel_size": 2, "use_hsdp": True},
        NO_ALLGATHER,
        {},
        ["--use-hsdp", "--tensor-parallel-size"],
    ),
}


@pytest.mark.parametrize("row", ACCEPTED)
def test_compatibility_row_is_accepted(row: str) -> None:
    parallel, offload, model = ACCEPTED[row]
    assert config(parallel, offload, model).effective().offload_policy == OffloadPolicy.DLO


@pytest.mark.parametrize("row", REJECTED)
def test_compatibility_row_is_rejected_naming_the_options(row: str) -> None:
    parallel, offload, model, named = REJECTED[row]
    with pytest.raises(ConfigError) as error:
        config(parallel, offload, model)
    for option in named:
        assert option in str(error.value)


@pytest.mark.parametrize("other_offload", ["enable_cpu_offload", "enable_layerwise_offload"])
@pytest.mark.parametrize("dlo", [DLO, NO_ALLGATHER], ids=["allgather", "no-allgather"])
def test_model_level_or_layerwise_offload_is_disabled_by_dlo_with_a_warning(
    other_offload: str, dlo: dict[str, Any]
) -> None:
    effective = config(offload={**dlo, other_offload: True}).effective()
    assert effective.offload_policy == OffloadPolicy.DLO
    flag = "--" + other_offload.replace("_", "-")
    assert any(flag in warning and "takes priority" in warning for warning in effective.warnings)


def test_tp_uses_the_ordinary_loader_only() -> None:
    for offload in (DLO, NO_ALLGATHER):
        effective = config({"tensor_parallel_size": 2}, offload).effective()
        assert effective.host_backing_candidates == [HostBacking.ORDINARY]


def test_tp_is_never_the_dlo_sharding_group() -> None:
    effective = config({"tensor_parallel_size": 4}, DLO).effective()
    assert (effective.dlo_sharding_group, effective.dlo_sharding_size) == (ShardingGroup.NONE, 1)
    assert effective.transfer_mode == TransferMode.RANK_LOCAL


def test_dp_plus_sp_shards_over_dp() -> None:
    effective = config({"data_parallel_size": 2, "sequence_parallel_size": 4}, DLO).effective()
    assert (effective.dlo_sharding_group, effective.dlo_sharding_size) == (
        ShardingGroup.DATA_PARALLEL,
        2,
    )


def test_sp_alone_shards_over_sp() -> None:
    effective = config({"sequence_parallel_size": 4}, DLO).effective()
    assert (effective.dlo_sharding_group, effective.dlo_sharding_size) == (
        ShardingGroup.SEQUENCE_PARALLEL,
        4,
    )
    assert effective.transfer_mode == TransferMode.ALLGATHER
