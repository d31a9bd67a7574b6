"""DLO is bitwise identical to resident execution on the CPU, in every transfer mode.

AllGather runs in real gloo process groups of 2 and 3 ranks (3 makes the shard
padding uneven).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dlo_worker.offload import enable_dlo
from dlo_worker.offload.layout import shard_numel
from tests.support.equivalence import RANK_LOCAL_CASES, check_allgather_rank, run_equivalence
from tests.support.ranks import spawn_ranks
from tests.support.tiny_models import plain_stack, tiny_dit, tiny_flux

CPU = torch.device("cpu")


@pytest.mark.parametrize("case", RANK_LOCAL_CASES)
def test_rank_local_streaming_is_bitwise_equal_to_resident(case: str) -> None:
    model, options = RANK_LOCAL_CASES[case]
    result = run_equivalence(model, CPU, **options)
    assert result.bitwise_equal
    assert result.stats.transfer_mode == "rank-local"
    assert result.stats.on_demand_loads == 0


@pytest.mark.parametrize("resident_layers", [1, 2, 4])
def test_resident_leading_layers_are_bitwise_equal(resident_layers: int) -> None:
    result = run_equivalence("plain", CPU, blocks=5, resident_layers=resident_layers)
    assert result.bitwise_equal
    assert result.stats.resident_blocks == resident_layers
    assert result.stats.streamed_blocks == 5 - resident_layers


def test_resident_layers_span_flux_block_lists() -> None:
    result = run_equivalence("flux", CPU, resident_layers=3)
    assert result.bitwise_equal
    assert result.stats.streamed_blocks == 2


def test_allgather_with_group_of_one_runs_rank_locally() -> None:
    result = run_equivalence("dit", CPU, use_allgather=True)
    assert result.bitwise_equal
    assert result.stats.transfer_mode == "rank-local"
    assert result.stats.allgather_bytes == 0


def test_exactly_two_slots_sized_for_the_largest_block() -> None:
    # Flux's double-stream and single-stream blocks differ in size.
    result = run_equivalence("flux", CPU)
    assert len(set(result.block_bytes)) > 1
    assert result.stats.largest_block_bytes == max(result.block_bytes)
    assert result.stats.device_slot_bytes == 2 * max(result.block_bytes)


def test_parameters_keep_their_identity_and_are_placeholders_between_runs() -> None:
    case = plain_stack(blocks=3)
    before = {name: (id(p), p.shape) for name, p in case.model.named_parameters()}
    backend = enable_dlo(case.model, device=CPU)
    with torch.inference_mode():
        case.forward()
    assert {name: (id(p), p.shape) for name, p in case.model.named_parameters()} == before
    for layer in case.model.layers:
        # Their shape over one element: no memory of their own.
        assert all(p.untyped_storage().nbytes() == p.element_size() for p in layer.parameters())
    assert (
        case.model.embed.weight.untyped_storage().nbytes() > case.model.embed.weight.element_size()
    )
    backend.disable()
    for layer in case.model.layers:
        assert all(p.numel() == 0 for p in layer.parameters())


def test_skipped_blocks_are_learned_out_of_the_order_and_stay_equal() -> None:
    case = plain_stack(blocks=5)
    reference = copy.deepcopy(case.model)
    for model in (case.model, reference):
        model.skip = {1, 3}
    with torch.inference_mode():
        expected = [reference(**case.inputs) for _ in range(3)]
    backend = enable_dlo(case.model, device=CPU)
    with torch.inference_mode():
        actual = [case.model(**case.inputs) for _ in range(3)]
    stats = backend.stats()
    backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))
    assert stats.order_changes == 1  # blocks 1 and 3 never run: learned on the first forward


def test_two_dits_of_one_pipeline_share_the_two_slots() -> None:
    """Like Wan 2.2: transformer and transformer_2 alternate and share one slot pair."""
    first, second = tiny_dit(0, blocks=3), tiny_dit(1, blocks=4)
    references = copy.deepcopy(first.model), copy.deepcopy(second.model)
    pipeline = SimpleNamespace(
        transformer=first.model,
        transformer_2=second.model,
        components={"transformer": first.model, "transformer_2": second.model},
    )
    with torch.inference_mode():
        expected = [
            ref(**case.inputs).sample for ref, case in zip(references, (first, second), strict=True)
        ] * 2
    backend = enable_dlo(pipeline, device=CPU, use_allgather=False)
    with torch.inference_mode():
        actual = [case.model(**case.inputs).sample for _ in range(2) for case in (first, second)]
    stats = backend.stats()
    backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))
    assert stats.streamed_blocks == 7
    # Each DiT's first block is loaded when its forward starts, before any block runs.
    assert stats.on_demand_loads == 0


def test_disable_is_idempotent_and_leaves_no_hooks() -> None:
    case = tiny_flux()
    backend = enable_dlo(case.model, device=CPU)
    backend.disable()
    backend.disable()
    for module in case.model.modules():
        assert not module._forward_pre_hooks
        assert not module._forward_hooks
    assert backend.stats().host_bytes == 0
    assert backend.stats().device_slot_bytes == 0


def test_stats_count_streamed_bytes_and_waits() -> None:
    result = run_equivalence("plain", CPU, blocks=4, forwards=2)
    stats = result.stats
    # Priming loads block 0; each of the 8 block runs refills its slot with the block after
    # next as it finishes, so the last one already loads block 1 of the next forward.
    assert stats.blocks_loaded == 1 + 8 + 1
    assert stats.bytes_streamed == sum(result.block_bytes) * 10 // 4
    assert stats.exposed_wait_seconds > 0
    assert stats.h2d_gbps > 0


# --- AllGather over real gloo process groups ---------------------------------------------


def _allgather_rank(rank: int, world_size: int, store_path: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    torch.set_num_threads(1)
    try:
        for name, options, result in check_allgather_rank(CPU):
            expected_host = _expected_shard_bytes(name, options, world_size)
            assert result.stats.host_bytes == expected_host, (name, expected_host)
    finally:
        dist.destroy_process_group()


def _expected_shard_bytes(name: str, options: dict, world_size: int) -> int:
    """ceil(total / N) per dtype per block, from an independent layout of the same model."""
    from tests.support.tiny_models import BUILDERS

    case = BUILDERS[name](0, **options)
    backend = enable_dlo(case.model, device=CPU, use_allgather=False)
    total = sum(
        shard_numel(dtype_layout.numel, world_size) * dtype_layout.dtype.itemsize
        for layout in backend.block_layouts()
        for dtype_layout in layout.by_dtype.values()
    )
    backend.disable()
    return total


@pytest.mark.parametrize("world_size", [2, 3])
def test_allgather_over_gloo_is_bitwise_equal_and_keeps_one_nth_on_the_host(
    world_size: int, tmp_path: Path
) -> None:
    spawn_ranks(_allgather_rank, (world_size, str(tmp_path / "store")), world_size)
