"""Shard arithmetic and flattened layouts (pure functions, no device)."""

from __future__ import annotations

import pytest
import torch

from dlo_worker.offload.layout import (
    ALIGN_BYTES,
    build_block_layout,
    shard_bounds,
    shard_numel,
    slot_capacity,
)


@pytest.mark.parametrize(
    ("total", "shards", "expected"), [(10, 1, 10), (10, 2, 5), (10, 3, 4), (1, 4, 1), (0, 2, 0)]
)
def test_shard_numel_is_ceil_of_total_over_shards(total: int, shards: int, expected: int) -> None:
    assert shard_numel(total, shards) == expected


def test_shards_cover_the_padded_buffer_without_overlap() -> None:
    total, shards = 1001, 3
    bounds = [shard_bounds(total, shards, rank) for rank in range(shards)]
    assert bounds == [(0, 334), (334, 668), (668, 1002)]
    assert bounds[-1][1] >= total


def test_shard_bounds_reject_a_rank_outside_the_group() -> None:
    with pytest.raises(ValueError, match="rank 3 outside a group of 3"):
        shard_bounds(10, 3, 3)


def test_every_tensor_starts_at_an_aligned_offset_grouped_by_dtype() -> None:
    layout = build_block_layout(
        [
            ("a", (3, 5), torch.float32),
            ("b", (7,), torch.bfloat16),
            ("c", (2, 2), torch.float32),
            ("d", (1,), torch.bfloat16),
        ]
    )
    fp32, bf16 = layout.by_dtype[torch.float32], layout.by_dtype[torch.bfloat16]
    assert [span.name for span in fp32.spans] == ["a", "c"]
    assert [span.name for span in bf16.spans] == ["b", "d"]
    for dtype_layout in (fp32, bf16):
        for span in dtype_layout.spans:
            assert (span.offset * dtype_layout.dtype.itemsize) % ALIGN_BYTES == 0
    assert fp32.spans[1].offset == ALIGN_BYTES // 4
    assert fp32.numel == ALIGN_BYTES // 4 + 4
    assert layout.nbytes == fp32.numel * 4 + bf16.numel * 2


def test_shard_bytes_are_ceil_per_dtype() -> None:
    layout = build_block_layout([("w", (10,), torch.float32), ("v", (5,), torch.bfloat16)])
    assert layout.shard_nbytes(3) == 4 * 4 + 2 * 2


def test_slot_capacity_holds_the_largest_padded_block_per_dtype() -> None:
    small = build_block_layout([("w", (10,), torch.float32)])
    large = build_block_layout([("w", (31,), torch.float32), ("v", (4,), torch.bfloat16)])
    assert slot_capacity([small, large], 1) == {torch.float32: 31, torch.bfloat16: 4}
    assert slot_capacity([small, large], 2) == {torch.float32: 32, torch.bfloat16: 4}
