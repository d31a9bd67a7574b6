"""Flattened block layouts and shard arithmetic (pure: no I/O, no device).

A streamed block's parameters are packed, per dtype, into one flat buffer so a
block moves with one copy (or one AllGather) per dtype. Every tensor starts at a
256-byte aligned offset: kernels (cuBLAS, oneDNN) pick paths by pointer
alignment, and bitwise equality with resident execution needs the same paths.

For AllGather over ``N`` ranks the flat buffer is zero-padded to
``ceil(total / N) * N`` elements and rank ``r`` keeps elements
``[r * shard, (r + 1) * shard)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

ALIGN_BYTES = 256


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor of a block lives inside its dtype's flat buffer (in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class DTypeLayout:
    """All tensors of one dtype in a block, packed with aligned offsets."""

    dtype: torch.dtype
    spans: tuple[TensorSpan, ...]
    numel: int
    """Elements up to the end of the last tensor (alignment gaps included)."""

    def shard_numel(self, shards: int) -> int:
        return shard_numel(self.numel, shards)

    def padded_numel(self, shards: int) -> int:
        return shard_numel(self.numel, shards) * shards


@dataclass(frozen=True)
class BlockLayout:
    """The flattened layout of one streamed block, per dtype."""

    by_dtype: Mapping[torch.dtype, DTypeLayout]

    @property
    def nbytes(self) -> int:
        """Bytes a complete copy of the block moves (alignment gaps included)."""
        return sum(layout.numel * layout.dtype.itemsize for layout in self.by_dtype.values())

    def shard_nbytes(self, shards: int) -> int:
        """Bytes one rank keeps of this block when sharded ``shards`` ways."""
        return sum(
            layout.shard_numel(shards) * layout.dtype.itemsize for layout in self.by_dtype.values()
        )


def shard_numel(total: int, shards: int) -> int:
    """Elements per rank: ``ceil(total / shards)``."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return math.ceil(total / shards)


def shard_bounds(total: int, shards: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` element range rank ``rank`` owns in the padded buffer."""
    if not 0 <= rank < shards:
        raise ValueError(f"rank {rank} outside a group of {shards}")
    size = shard_numel(total, shards)
    return rank * size, (rank + 1) * size


def _aligned(offset: int, itemsize: int, align_bytes: int) -> int:
    step = max(1, align_bytes // itemsize)
    return -(-offset // step) * step


def build_block_layout(
    tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
    align_bytes: int = ALIGN_BYTES,
) -> BlockLayout:
    """Pack ``(name, shape, dtype)`` triples into per-dtype layouts, in the given order."""
    spans: dict[torch.dtype, list[TensorSpan]] = {}
    ends: dict[torch.dtype, int] = {}
    for name, shape, dtype in tensors:
        numel = math.prod(shape)
        offset = _aligned(ends.get(dtype, 0), dtype.itemsize, align_bytes)
        spans.setdefault(dtype, []).append(TensorSpan(name, tuple(shape), offset, numel))
        ends[dtype] = offset + numel
    return BlockLayout(
        {dtype: DTypeLayout(dtype, tuple(items), ends[dtype]) for dtype, items in spans.items()}
    )


def streamed_parameters(
    block: nn.Module, excluded: frozenset[int] | set[int] = frozenset()
) -> list[tuple[str, nn.Parameter]]:
    """A block's parameters that stream, in the order its layout packs them (``excluded``:
    ids of parameters that stay resident, e.g. an embedder the DiT also calls directly).

    The order is by name: safetensors writes a file's tensors sorted by name (per dtype),
    so a block of a checkpoint sits in its file in layout order, and the copies of a
    registered checkpoint coalesce into a few long ones (whenever tensor sizes keep the
    alignment, as every Flux tensor does). The runtime cache packs its entries in the
    same order, so a cached block is the device slot's image."""
    return sorted(
        (
            (name, parameter)
            for name, parameter in block.named_parameters(remove_duplicate=True)
            if id(parameter) not in excluded
        ),
        key=lambda item: item[0],
    )


def layout_of(named: Sequence[tuple[str, torch.Tensor]]) -> BlockLayout:
    """The packed layout of ``(name, tensor)`` pairs, in order."""
    return build_block_layout((name, tuple(tensor.shape), tensor.dtype) for name, tensor in named)


def slot_capacity(layouts: Iterable[BlockLayout], shards: int) -> dict[torch.dtype, int]:
    """Elements per dtype a device slot needs to hold the largest (padded) block."""
    capacity: dict[torch.dtype, int] = {}
    for layout in layouts:
        for dtype, dtype_layout in layout.by_dtype.items():
            capacity[dtype] = max(capacity.get(dtype, 0), dtype_layout.padded_numel(shards))
    return capacity
