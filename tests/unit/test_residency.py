"""Residency placement: fits the budget, keeps the most bytes, spreads streamed bytes."""

from __future__ import annotations

from itertools import pairwise

import pytest

from dlo_worker.offload.residency import resident_within_budget, spread_evenly
from tests.support.two_slot_timeline import step_seconds

GIB = 2**30
# Flux.1-dev: 19 double-stream blocks, then 38 single-stream blocks (bf16 bytes), each
# about the same FLOPs at any resolution; 0.173 s of compute per step at 1024x1024 and
# 55 GB/s pinned H2D on an H200 (docs/benchmarks.md).
FLUX_BLOCK_BYTES = [681_836_544] * 19 + [282_001_408] * 38
FLUX_COMPUTE = [0.173 / 57] * 57
H2D = 55e9
FLUX_NON_BLOCK_AND_SLOTS = 2 * 681_836_544 + int(0.2 * GIB)


def test_count_spread_is_even() -> None:
    assert spread_evenly(8, 2) == {2, 6}
    assert spread_evenly(5, 0) == set()
    assert spread_evenly(3, 9) == {0, 1, 2}


@pytest.mark.parametrize("available", range(0, 10))
def test_budget_placement_fits_and_leaves_no_block_that_would_fit(available: int) -> None:
    sizes = [2, 2, 2, 1, 1, 1]
    chosen = resident_within_budget(sizes, available)
    used = sum(sizes[index] for index in chosen)
    assert used <= available
    assert all(used + sizes[index] > available for index in set(range(6)) - chosen)


def test_budget_placement_spreads_streamed_bytes_not_block_counts() -> None:
    # Half the budget: the big leading blocks must not all stream (a count spread streams
    # a third of them and puts half the streamed bytes into the first third of the order).
    available = sum(FLUX_BLOCK_BYTES) // 2
    chosen = resident_within_budget(FLUX_BLOCK_BYTES, available)
    streamed = [0 if index in chosen else size for index, size in enumerate(FLUX_BLOCK_BYTES)]
    total = sum(streamed)
    for position in range(len(streamed)):
        so_far = sum(streamed[: position + 1])
        # Never ahead of an even share (the copies lag the compute that hides them) and
        # never a whole block behind it.
        assert so_far <= total * (position + 1) / len(streamed) + 1
        assert so_far >= total * position / len(streamed) - max(FLUX_BLOCK_BYTES)


@pytest.mark.parametrize("synchronized", [False, True], ids=["back-to-back", "synchronized"])
def test_flux_class_budgets_stay_within_five_percent_of_the_bound(synchronized: bool) -> None:
    """The issue's goal on the timeline model, at every half GiB from 4 to 24 GiB, also
    for a step timed on its own (the nearest-share spread reached 1.060x there at 15 GiB:
    it streamed the first block, so each synchronized step began with a bare copy)."""
    worst = 0.0
    for half_gib in range(8, 49):
        available = half_gib * GIB // 2 - FLUX_NON_BLOCK_AND_SLOTS
        chosen = resident_within_budget(FLUX_BLOCK_BYTES, available)
        streamed = sum(size for i, size in enumerate(FLUX_BLOCK_BYTES) if i not in chosen)
        bound = max(sum(FLUX_COMPUTE), streamed / H2D)
        step = step_seconds(FLUX_BLOCK_BYTES, chosen, FLUX_COMPUTE, H2D, synchronized=synchronized)
        worst = max(worst, step / bound)
    assert worst <= 1.05


def test_the_timeline_model_reproduces_the_count_spread_measurement() -> None:
    """Guards the model itself: the placement it replaced measured 1.12-1.14x at 16 GiB."""
    chosen = spread_evenly(57, 37)
    streamed = sum(size for i, size in enumerate(FLUX_BLOCK_BYTES) if i not in chosen)
    bound = max(sum(FLUX_COMPUTE), streamed / H2D)
    ratio = step_seconds(FLUX_BLOCK_BYTES, chosen, FLUX_COMPUTE, H2D) / bound
    assert 1.10 <= ratio <= 1.15


# FP8 Flux: half the bf16 bytes, 0.191 s of compute per step at 1024x1024 (the resident FP8
# step back to back on an H100, docs/benchmarks.md). Its double-stream blocks' copies
# outlast their compute, so an even spread of the streamed bytes needs about 2.4 GiB kept.
FP8_BLOCK_BYTES = [size // 2 for size in FLUX_BLOCK_BYTES]
FP8_COMPUTE = [0.191 / 57] * 57


def fp8_step(available: int) -> tuple[float, float]:
    """The modeled FP8 step and its bound with ``available`` bytes for resident blocks."""
    chosen = resident_within_budget(FP8_BLOCK_BYTES, available)
    streamed = sum(size for i, size in enumerate(FP8_BLOCK_BYTES) if i not in chosen)
    return (
        step_seconds(FP8_BLOCK_BYTES, chosen, FP8_COMPUTE, H2D),
        max(sum(FP8_COMPUTE), streamed / H2D),
    )


def test_budgets_below_an_even_spread_spread_the_blocks_they_keep() -> None:
    """Keeping the first double-stream blocks left the copies of the ones after them
    queued (1.16x the bound at 2 GiB); spread through the order they hide behind."""
    chosen = resident_within_budget(FP8_BLOCK_BYTES, 2 * GIB)
    assert sorted(chosen) == [1, 4, 7, 11, 14, 17]
    for tenths in (20, 22):
        step, bound = fp8_step(tenths * GIB // 10)
        assert step / bound <= 1.10


def test_more_memory_never_slows_the_fp8_step() -> None:
    steps = [fp8_step(tenths * GIB // 10)[0] for tenths in range(36)]
    assert all(later <= earlier + 1e-9 for earlier, later in pairwise(steps))
    assert steps[-1] == pytest.approx(sum(FP8_COMPUTE), rel=0.002)


def test_a_step_timed_on_its_own_hides_its_first_copy_behind_the_first_block() -> None:
    """From the budget that spreads FP8 Flux's copies evenly, the first block stays
    resident and its compute hides the first copy, so a synchronized step (which starts
    with no copy in flight) takes what one run back to back takes. Streaming the first
    block cost each synchronized step its copy, 1.5% of the bound."""
    for tenths in range(32, 60, 2):
        available = tenths * GIB // 10
        chosen = resident_within_budget(FP8_BLOCK_BYTES, available)
        assert 0 in chosen
        _, bound = fp8_step(available)
        alone = step_seconds(FP8_BLOCK_BYTES, chosen, FP8_COMPUTE, H2D, synchronized=True)
        assert alone / bound <= 1.005
