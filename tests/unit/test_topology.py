"""Rank layout and the DLO group the configuration selects (pure)."""

from __future__ import annotations

import dataclasses

from dlo_worker.config import OffloadOptions, ParallelOptions, ShardingGroup, build_config
from dlo_worker.offload import OffloadConfig
from dlo_worker.process.topology import group_ranks, rank_coordinates
from dlo_worker.process.worker import BACKEND_OPTIONS, offload_config_for


def test_tp_is_innermost_then_sp_then_dp() -> None:
    parallel = ParallelOptions(
        data_parallel_size=2, sequence_parallel_size=2, tensor_parallel_size=2
    )
    coordinates = [rank_coordinates(rank, parallel) for rank in range(8)]
    assert [
        (c.data_parallel_rank, c.sequence_parallel_rank, c.tensor_parallel_rank)
        for c in coordinates
    ] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]


def test_dp_and_sp_groups_partition_the_world() -> None:
    parallel = ParallelOptions(data_parallel_size=2, sequence_parallel_size=3)
    groups = group_ranks(parallel)
    assert groups[ShardingGroup.DATA_PARALLEL] == [[0, 3], [1, 4], [2, 5]]
    assert groups[ShardingGroup.SEQUENCE_PARALLEL] == [[0, 1, 2], [3, 4, 5]]


def test_offload_config_takes_the_group_the_worker_config_selects() -> None:
    dp_group, sp_group = object(), object()
    groups = {ShardingGroup.DATA_PARALLEL: dp_group, ShardingGroup.SEQUENCE_PARALLEL: sp_group}
    dlo = {"enable_distributed_layerwise_offload": True}
    by_dp = build_config(
        {"parallel": {"data_parallel_size": 2, "sequence_parallel_size": 2}, "offload": dlo}
    )
    by_sp = build_config({"parallel": {"sequence_parallel_size": 2}, "offload": dlo})
    rank_local = build_config(
        {
            "parallel": {"data_parallel_size": 2},
            "offload": {
                **dlo,
                "dlo_use_allgather": False,
                "dlo_resident_layers": 2,
                "dlo_block_paths": "blocks, more_blocks",
            },
        }
    )
    assert offload_config_for(by_dp, groups).process_group is dp_group
    assert offload_config_for(by_sp, groups).process_group is sp_group
    local = offload_config_for(rank_local, groups)
    assert local.process_group is None
    assert local.resident_layers == 2
    assert local.block_paths == ("blocks", "more_blocks")


def test_every_backend_option_names_a_worker_option_and_a_backend_field() -> None:
    backend_fields = {field.name for field in dataclasses.fields(OffloadConfig)}
    for option in BACKEND_OPTIONS:
        assert option.option in OffloadOptions.model_fields, option
        assert option.field in backend_fields, option
    assert len({option.field for option in BACKEND_OPTIONS}) == len(BACKEND_OPTIONS)


def test_gib_options_reach_the_backend_as_bytes() -> None:
    config = build_config(
        {
            "offload": {
                "enable_distributed_layerwise_offload": True,
                "dlo_use_allgather": False,
                "dlo_gpu_memory_budget_gib": 1.5,
                "dlo_runtime_cache_pin_limit_gib": 2,
            }
        }
    )
    backend = offload_config_for(config, {})
    assert backend.gpu_memory_budget_bytes == 3 * 2**29
    assert backend.pin_limit_bytes == 2 * 2**30
    assert backend.use_allgather is False


def test_staging_options_reach_the_backend_and_unset_ones_keep_its_machine_defaults() -> None:
    dlo = {"enable_distributed_layerwise_offload": True, "dlo_use_allgather": False}
    chosen = offload_config_for(
        build_config(
            {
                "offload": {
                    **dlo,
                    "dlo_staging": "ring",
                    "dlo_staging_chunk_mib": 2,
                    "dlo_pack_threads": 3,
                }
            }
        ),
        {},
    )
    assert (chosen.staging, chosen.staging_ring_chunk_bytes, chosen.pack_threads) == (
        "ring",
        2 * 2**20,
        3,
    )
    assert chosen.ring_chunk_bytes == 2 * 2**20
    default = offload_config_for(build_config({"offload": dlo}), {})
    assert default.staging == "auto"
    assert default.staging_ring_chunk_bytes is None
    assert default.pack_threads == OffloadConfig().pack_threads
