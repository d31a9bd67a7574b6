"""The timeline model behind docs/benchmarks.md's FP8 lookahead table: Flux-class FP8
blocks at 1024x1024 on an H100 (19 copy-bound double blocks, 38 compute-bound single
blocks, about equal FLOPs each) with two device positions, as DLO streams today, and with
more."""

from __future__ import annotations

import pytest

from dlo_worker.offload.residency import resident_within_budget
from tests.support.two_slot_timeline import step_seconds

# Half the bf16 bytes of tests/unit/test_residency.py's Flux blocks; the resident FP8 step
# measured back to back on an H100 (docs/benchmarks.md, flux_fp8_triton_cast_h100.json).
FP8_BLOCK_BYTES = [681_836_544 // 2] * 19 + [282_001_408 // 2] * 38
FP8_COMPUTE = [0.191 / 57] * 57
H2D = 55e9
BOUND = sum(FP8_BLOCK_BYTES) / H2D


def ratio(positions: int, bytes_per_second: float = H2D) -> float:
    seconds = step_seconds(
        FP8_BLOCK_BYTES, set(), FP8_COMPUTE, bytes_per_second, positions=positions
    )
    return seconds / BOUND


def test_two_positions_is_the_default_and_falls_far_behind_the_copies() -> None:
    assert step_seconds(FP8_BLOCK_BYTES, set(), FP8_COMPUTE, H2D) == pytest.approx(ratio(2) * BOUND)
    assert ratio(2) == pytest.approx(1.139, abs=0.005)


@pytest.mark.parametrize(
    ("positions", "at_55", "at_52"),
    [(4, 1.108, 1.139), (6, 1.077, 1.108), (8, 1.046, 1.077), (10, 1.014, 1.058)],
)
def test_lookahead_reaches_the_bound_only_with_fast_copies(positions, at_55, at_52) -> None:
    assert ratio(positions) == pytest.approx(at_55, abs=0.005)
    assert ratio(positions, 52e9) == pytest.approx(at_52, abs=0.005)


def test_more_positions_never_slow_the_step() -> None:
    ratios = [ratio(positions) for positions in range(2, 13)]
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[-1] == pytest.approx(1.0, abs=0.002)


@pytest.mark.parametrize("positions", [4, 6, 8, 10])
def test_the_same_device_memory_does_more_as_resident_blocks(positions) -> None:
    """Why DLO spends spare device memory on resident blocks (``gpu_memory_budget_gib``)
    rather than on more slots: the memory of ``positions - 2`` more FP8 slots, holding
    blocks instead, removes their copies and lets the copies of the streamed blocks
    overlap their compute, at either copy rate."""
    extra = (positions - 2) * max(FP8_BLOCK_BYTES)
    resident = resident_within_budget(FP8_BLOCK_BYTES, extra)
    for bytes_per_second in (H2D, 52e9):
        lookahead = step_seconds(
            FP8_BLOCK_BYTES, set(), FP8_COMPUTE, bytes_per_second, positions=positions
        )
        kept = step_seconds(FP8_BLOCK_BYTES, resident, FP8_COMPUTE, bytes_per_second)
        assert kept < lookahead
