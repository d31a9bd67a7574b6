"""Packing blocks from mapped checkpoint views, and the ring of pinned staging buffers.

A checkpoint-backed block has no flat host copy: its parameters are immutable views
of the mapped files (shared by every process on the node through the page cache).
To copy it to the device at full speed it is first *packed*, in layout order with
zeroed gaps, into a page-locked staging buffer. Packing is a host memcpy: it runs on
a small thread pool (``torch`` copies release the GIL) in chunks, so the pack rate is
bounded by memory bandwidth rather than by Python.

:class:`HostStaging` owns a ring of ``depth`` staging buffers (at least two), used in
order. Loading a block waits for its pack, copies it out of its buffer, and starts
packing the blocks expected next into the free buffers; a buffer is free once the copy
out of it was enqueued, and each pack into it first waits for that copy to finish. Packs
therefore run up to ``depth - 1`` blocks ahead of the copies: the pack and the copy read
and write the same host memory at similar rates, and the extra buffer absorbs a block
whose pack runs slow instead of leaving the copy engine idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, overload

import torch

from dlo_worker.offload.block import HostCopy, MappedPiece, StreamedBlock, whole_buffers
from dlo_worker.offload.feeds.arena import HostArena

if TYPE_CHECKING:
    from dlo_worker.offload.slots import TransferCounters

CHUNK_ALIGN = 4096
"""Chunk boundaries fall on multiples of this many elements (whole cache lines, pages)."""


def pack_range(pieces: list[MappedPiece], start: int, stop: int, target: torch.Tensor) -> None:
    """Write elements ``[start, stop)`` of the packed block into ``target`` (gaps zeroed).

    ``pieces`` are sorted by offset; ``target`` has ``stop - start`` elements.
    """
    cursor = start
    for offset, numel, view in pieces:
        low, high = max(offset, start), min(offset + numel, stop)
        if offset >= stop:
            break
        if high <= low:
            continue
        if low > cursor:
            target[cursor - start : low - start].zero_()
        target[low - start : high - start].copy_(view[low - offset : high - offset])
        cursor = high
    if cursor < stop:
        target[cursor - start :].zero_()


def chunk_bounds(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into at most ``parts`` aligned, non-empty chunks."""
    size = -(-(stop - start) // max(parts, 1))
    size = max(CHUNK_ALIGN, -(-size // CHUNK_ALIGN) * CHUNK_ALIGN)
    return [(low, min(low + size, stop)) for low in range(start, stop, size)]


class Packer:
    """A thread pool that packs byte ranges of blocks; shared by staging and shard setup."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dlo-pack")

    def pack(
        self,
        pieces: list[MappedPiece],
        start: int,
        stop: int,
        target: torch.Tensor,
        before: Callable[[], None] | None = None,
    ) -> list[Future[tuple[float, float]]]:
        """Pack ``[start, stop)`` into ``target`` in parallel chunks; ``before`` runs first in
        each chunk (e.g. waiting for the buffer's previous device copy)."""

        def pack_chunk(low: int, high: int) -> tuple[float, float]:
            if before is not None:
                before()
            began = time.perf_counter()
            pack_range(pieces, low, high, target[low - start : high - start])
            return began, time.perf_counter()

        return [
            self._pool.submit(pack_chunk, low, high)
            for low, high in chunk_bounds(start, stop, self.threads)
        ]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def wait_all(futures: list[Future[tuple[float, float]]]) -> float:
    """Wait for every chunk; returns the seconds from the first chunk's start to the last's end."""
    spans = [future.result() for future in futures]
    return max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0


@dataclass(eq=False)
class StagingBuffer:
    """One page-locked buffer per dtype and the block packed (or being packed) into it."""

    tensors: dict[torch.dtype, torch.Tensor]
    block: StreamedBlock | None = None
    """The block packed here and not copied out yet; ``None`` when the buffer is free."""
    packing: list[Future[tuple[float, float]]] = field(default_factory=list)
    """The pack's chunks, until a load waits for them."""
    copied: torch.cuda.Event | None = None
    """The end of the last copy out of the buffer (the next pack waits for it)."""


class HostStaging:
    """The ring of page-locked staging buffers; see the module doc."""

    def __init__(
        self,
        capacity: dict[torch.dtype, int],
        packer: Packer,
        counters: TransferCounters,
        *,
        page_lock: bool,
        depth: int = 3,
    ) -> None:
        if depth < 2:
            raise ValueError(f"staging needs at least two buffers, got {depth}")
        self._arena = HostArena(
            {dtype: depth * numel for dtype, numel in capacity.items()}, page_lock=page_lock
        )
        self.buffers = [
            StagingBuffer(
                {dtype: self._arena.take(dtype, numel) for dtype, numel in capacity.items()}
            )
            for _ in range(depth)
        ]
        self._next = 0
        self._packer = packer
        self._counters = counters

    @property
    def nbytes(self) -> int:
        return self._arena.nbytes

    @property
    def page_locked(self) -> bool:
        return self._arena.page_locked

    def holding(self, block: StreamedBlock) -> StagingBuffer | None:
        return next((buffer for buffer in self.buffers if buffer.block is block), None)

    @overload
    def prefetch(self, block: StreamedBlock, *, evict: Literal[True]) -> StagingBuffer: ...
    @overload
    def prefetch(self, block: StreamedBlock, *, evict: bool = False) -> StagingBuffer | None: ...
    def prefetch(self, block: StreamedBlock, *, evict: bool = False) -> StagingBuffer | None:
        """Start packing ``block`` into the next buffer of the ring (after the copy out of
        it finished). Returns the buffer (also when ``block`` is already there), or ``None``
        when the next buffer still holds a packed block not copied yet and ``evict`` is
        false. With ``evict`` (a load that cannot wait) that block is dropped; it is packed
        again when it is loaded."""
        held = self.holding(block)
        if held is not None:
            return held
        buffer = self.buffers[self._next]
        if buffer.block is not None:
            if not evict:
                return None
            self._finish(buffer)
            buffer.block = None
        self._next = (self._next + 1) % len(self.buffers)
        copied = buffer.copied
        before = copied.synchronize if copied is not None else None
        for dtype, pieces in block.mapped.items():
            numel = block.layout.by_dtype[dtype].numel
            target = buffer.tensors[dtype][:numel]
            buffer.packing += self._packer.pack(pieces, 0, numel, target, before)
        buffer.block = block
        return buffer

    def copies(self, block: StreamedBlock, _slot_index: int) -> list[HostCopy]:
        """:class:`~dlo_worker.offload.block.BlockFeed`: the block packed into staging
        (waits for, or runs, its pack)."""
        buffer = self.prefetch(block, evict=True)
        waited = time.perf_counter()
        self._finish(buffer)
        self._counters.pack_wait_seconds += time.perf_counter() - waited
        return whole_buffers(
            {
                dtype: buffer.tensors[dtype][: layout.numel]
                for dtype, layout in block.layout.by_dtype.items()
            }
        )

    def copied(
        self,
        block: StreamedBlock,
        _slot_index: int,
        event: torch.cuda.Event | None,
        upcoming: tuple[StreamedBlock, ...],
    ) -> None:
        """The copy out of ``block``'s buffer was enqueued (``event`` marks its end): the
        buffer is free for the next pack, and the next blocks start packing into the free
        buffers."""
        buffer = self.holding(block)
        if buffer is not None:
            buffer.copied = event
            buffer.block = None
        for later in upcoming[: len(self.buffers) - 1]:
            if later is block or later.feed is not self:
                continue
            if self.prefetch(later) is None:
                return

    def _finish(self, buffer: StagingBuffer) -> None:
        """Wait for the buffer's pending pack and count it."""
        if not buffer.packing:
            return
        futures, buffer.packing = buffer.packing, []
        self._counters.pack_seconds += wait_all(futures)
        if buffer.block is not None:
            self._counters.pack_bytes += buffer.block.layout.nbytes

    def close(self) -> None:
        """Finish outstanding packs and drop the buffers (the caller synchronized copies)."""
        for buffer in self.buffers:
            self._finish(buffer)
            buffer.block = None
        self._arena.close()
