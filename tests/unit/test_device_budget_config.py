"""How a device plan becomes the options that carry it out (pure)."""

from __future__ import annotations

from dlo_worker.config import OffloadPolicy, TransferMode
from dlo_worker.loader.device_plan import GIB, DevicePlan, Placement
from dlo_worker.process.device_budget import planned_config, plans_placement
from tests.support.configs import DLO, NO_ALLGATHER, config

STREAMED = Placement.STREAMED
RESIDENT = Placement.RESIDENT


def plan(transformer: Placement, t5: Placement, streamed_weights: int | None) -> DevicePlan:
    placements = {"text_encoder": RESIDENT, "text_encoder_2": t5, "transformer": transformer}
    return DevicePlan(12 * GIB, 2 * GIB, placements, streamed_weights, 3 * GIB)


def test_a_resident_plan_leaves_the_configuration_as_it_is() -> None:
    budget = config(offload={"max_gpu_memory_gib": 12})
    assert planned_config(budget, plan(RESIDENT, RESIDENT, None)) is budget


def test_a_streaming_plan_turns_rank_local_dlo_on_with_the_dit_share_and_t5() -> None:
    budget = config(parallel={"data_parallel_size": 2}, offload={"max_gpu_memory_gib": 12})
    planned = planned_config(budget, plan(STREAMED, STREAMED, 7 * GIB))
    effective = planned.effective()
    assert effective.offload_policy == OffloadPolicy.DLO
    assert effective.transfer_mode == TransferMode.RANK_LOCAL
    assert planned.offload.dlo_gpu_memory_budget_gib == 7
    assert planned.offload.dlo_stream_text_encoders == ("text_encoder_2",)
    assert planned.offload.max_gpu_memory_gib is None
    assert planned.parallel.data_parallel_size == 2


def test_dlo_asked_for_on_one_gpu_streams_rank_local_blocks() -> None:
    asked = config(offload={**DLO, "max_gpu_memory_gib": 12})
    planned = planned_config(asked, plan(STREAMED, RESIDENT, 9 * GIB))
    assert planned.effective().transfer_mode == TransferMode.RANK_LOCAL
    assert planned.offload.dlo_use_allgather is False


def test_dlo_asked_for_keeps_its_own_options() -> None:
    asked = config(offload={**NO_ALLGATHER, "max_gpu_memory_gib": 12, "dlo_pack_threads": 3})
    planned = planned_config(asked, plan(STREAMED, RESIDENT, 9 * GIB))
    assert planned.offload.dlo_pack_threads == 3
    assert planned.offload.dlo_stream_text_encoders == ()
    assert planned.offload.dlo_gpu_memory_budget_gib == 9


def test_diffusers_offload_modes_place_components_themselves_under_a_budget() -> None:
    assert plans_placement(config(offload={"max_gpu_memory_gib": 12}))
    assert plans_placement(config(offload={**NO_ALLGATHER, "max_gpu_memory_gib": 12}))
    assert not plans_placement(config())
    for mode in ("enable_cpu_offload", "enable_layerwise_offload"):
        assert not plans_placement(config(offload={mode: True, "max_gpu_memory_gib": 12}))
