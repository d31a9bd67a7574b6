"""Plain data types of streamed blocks (a leaf module: imports nothing else of offload/
but the pure layout).

One streamed block: its layout, its feed, and its parameters' two lives.

A streamed parameter is either *placeholder* (between runs: a tensor of its shape and
dtype on the device whose every element is one shared element, so it costs no memory) or
*materialized* (a view into one of the two device slots, while its block runs). The
``Parameter`` objects never change, so optimizers, hooks and ``state_dict`` keys keep
working; only ``param.data`` is repointed. Placeholders keep the shape because code that
adds to a model between runs reads it (diffusers' and PEFT's LoRA loading sizes each
adapter by its base layer's weight); what reads their values gets nothing real, so a
streamed DiT's ``state_dict`` shows them empty (:mod:`~dlo_worker.offload.adapters`), and
a disabled backend leaves them empty, so the model cannot run without being loaded again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from dlo_worker.offload.layout import BlockLayout


class MappedPiece(NamedTuple):
    """One parameter of a checkpoint-backed block: its flat layout range and its mapped view."""

    offset: int
    numel: int
    view: torch.Tensor
    """Flat, contiguous view of the mapped checkpoint (transform already applied)."""


def coalesce(pieces: list[MappedPiece]) -> list[MappedPiece]:
    """Merge pieces (sorted by offset) whose views sit in one storage exactly as far apart
    as their layout offsets, so a block packed in the slot's own layout (a runtime-cache
    entry) is one copy per dtype. The bytes between two merged pieces fill the layout's
    alignment gap, which nothing reads."""
    merged: list[MappedPiece] = []
    for piece in pieces:
        if merged and _adjacent(merged[-1], piece):
            last = merged[-1]
            numel = piece.offset + piece.numel - last.offset
            merged[-1] = MappedPiece(last.offset, numel, last.view.as_strided((numel,), (1,)))
        else:
            merged.append(piece)
    return merged


def _adjacent(first: MappedPiece, second: MappedPiece) -> bool:
    same_storage = (
        first.view.untyped_storage().data_ptr() == second.view.untyped_storage().data_ptr()
    )
    distance = (second.offset - first.offset) * first.view.element_size()
    return (
        same_storage
        and second.offset >= first.offset + first.numel
        and second.view.data_ptr() - first.view.data_ptr() == distance
    )


class StreamedParameter(NamedTuple):
    """A parameter of a streamed block and where it lives in its dtype's flat buffer."""

    parameter: nn.Parameter
    dtype: torch.dtype
    offset: int
    numel: int
    shape: tuple[int, ...]
    name: str
    """The parameter's name inside its block (``attn1.to_q.weight``)."""


class HostCopy(NamedTuple):
    """One host-to-device copy of a load: ``tensor`` lands at element ``offset`` of the
    slot's ``dtype`` buffer."""

    dtype: torch.dtype
    offset: int
    tensor: torch.Tensor


def whole_buffers(tensors: dict[torch.dtype, torch.Tensor]) -> list[HostCopy]:
    """One copy per dtype, each to the start of its buffer (a packed block or shard)."""
    return [HostCopy(dtype, 0, tensor) for dtype, tensor in tensors.items()]


class BlockFeed(Protocol):
    """How a streamed block's bytes reach a slot that loads it: copied from the private
    arena (``feeds.arena.ArenaFeed``), from mapped views packed into staging
    (``feeds.staging.HostStaging``), or from registered mapped views directly
    (``feeds.direct.DirectFeed``). A new copy path is one new implementation."""

    def copies(self, block: StreamedBlock, slot_index: int) -> list[HostCopy]:
        """The copies that fill slot ``slot_index`` with ``block`` (may wait for a pack)."""
        ...

    def copied(
        self,
        block: StreamedBlock,
        slot_index: int,
        event: torch.cuda.Event | None,
        upcoming: tuple[StreamedBlock, ...],
    ) -> None:
        """The copies out of ``copies`` were enqueued (``event`` marks its end on CUDA);
        ``upcoming`` are the blocks expected after ``block``, nearest first."""
        ...


@runtime_checkable
class FillingFeed(Protocol):
    """A feed that issues its own copies into the slot, from threads of its own
    (``feeds.ring.StagingRing``): the slot hands it the load and waits for it before
    compute orders itself after the slot's ready event."""

    def fill(
        self,
        block: StreamedBlock,
        slot_index: int,
        buffers: dict[torch.dtype, torch.Tensor],
        after: torch.cuda.Event | None,
        ready: torch.cuda.Event | None,
    ) -> None:
        """Queue filling ``buffers`` with ``block`` (returns at once); on CUDA the copies
        wait for ``after`` and ``ready`` is recorded after them."""
        ...

    def wait_filled(self, slot_index: int) -> None:
        """Return once the last fill of ``slot_index`` is enqueued (``ready`` recorded;
        without CUDA, copied)."""
        ...


@dataclass(eq=False)
class StreamedBlock:
    """A block that lives on the host and visits a device slot when it runs."""

    name: str
    module: nn.Module
    layout: BlockLayout
    parameters: list[StreamedParameter]
    """In layout order."""
    arena_views: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    """The flat complete block (rank-local) or this rank's shard (AllGather), per dtype."""
    mapped: dict[torch.dtype, list[MappedPiece]] = field(default_factory=dict)
    """Checkpoint-backed rank-local blocks: mapped views to pack through staging, per dtype."""
    feed: BlockFeed | FillingFeed | None = None
    """How this block's host bytes reach a slot (set by the backend once filled)."""
    slot_views: tuple[list[torch.Tensor], list[torch.Tensor]] = field(
        default_factory=lambda: ([], [])
    )
    """Per slot, the device view of every parameter (precomputed: no work on the hot path)."""
    placeholder_views: list[torch.Tensor] = field(default_factory=list)
    """Every parameter's placeholder: its shape over one element (precomputed)."""

    def materialize(self, slot_index: int) -> None:
        for (parameter, *_), view in zip(self.parameters, self.slot_views[slot_index], strict=True):
            parameter.data = view

    def to_placeholders(self) -> None:
        for (parameter, *_), view in zip(self.parameters, self.placeholder_views, strict=True):
            parameter.data = view

    def bind_placeholders(self, anchors: dict[torch.dtype, torch.Tensor]) -> None:
        """Give every parameter a placeholder of its shape over ``anchors``' element of its
        dtype (stride 0 in every dimension: writing into it fails)."""
        self.placeholder_views[:] = [
            anchors[dtype].as_strided(shape, (0,) * len(shape))
            for _, dtype, _, _, shape, _ in self.parameters
        ]

    def to_empty(self) -> None:
        """Leave every parameter an empty tensor of its dtype (DLO disabled: nothing to run).
        Only once placeholders were bound: an enable that failed before leaves the
        parameters as it found them."""
        if not self.placeholder_views:
            return
        for parameter, dtype, *_ in self.parameters:
            parameter.data = torch.empty(0, dtype=dtype, device=parameter.device)
        self.placeholder_views.clear()

    def bind_slot_views(self, slot_index: int, buffers: dict[torch.dtype, torch.Tensor]) -> None:
        self.slot_views[slot_index][:] = [
            buffers[dtype][offset : offset + numel].view(shape)
            for _, dtype, offset, numel, shape, _ in self.parameters
        ]
