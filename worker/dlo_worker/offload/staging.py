"""Packing blocks from mapped checkpoint views, and the two bounded pinned staging slots.

A checkpoint-backed block has no flat host copy: its parameters are immutable views
of the mapped files (shared by every process on the node through the page cache).
To copy it to the device at full speed it is first *packed*, in layout order with
zeroed gaps, into a page-locked staging buffer. Packing is a host memcpy: it runs on
a small thread pool (``torch`` copies release the GIL) in chunks, so the pack rate is
bounded by memory bandwidth rather than by Python.

:class:`HostStaging` owns two staging buffers, paired with the two device slots.
Loading a block into device slot ``s`` waits for its pack into staging ``s``, copies
it, and immediately starts packing the block's successor into staging ``1 - s``
(after that buffer's previous copy finished), so packing runs two blocks ahead of
compute and the copy one block ahead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from dlo_worker.offload.block import HostCopy, MappedPiece, StreamedBlock, whole_buffers
from dlo_worker.offload.host import HostArena

if TYPE_CHECKING:
    from dlo_worker.offload.slots import TransferCounters

CHUNK_ALIGN = 4096
"""Chunk boundaries fall on multiples of this many elements (whole cache lines, pages)."""


def pack_range(pieces: list[MappedPiece], start: int, stop: int, target: torch.Tensor) -> None:
    """Write elements ``[start, stop)`` of the packed block into ``target`` (gaps zeroed).

    ``pieces`` are sorted by offset; ``target`` has ``stop - start`` elements.
    """
    cursor = start
    for offset, numel, source in pieces:
        low, high = max(offset, start), min(offset + numel, stop)
        if offset >= stop:
            break
        if high <= low:
            continue
        if low > cursor:
            target[cursor - start : low - start].zero_()
        target[low - start : high - start].copy_(source[low - offset : high - offset])
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


class HostStaging:
    """Two page-locked staging buffers per dtype, one per device slot; see the module doc."""

    def __init__(
        self,
        capacity: dict[torch.dtype, int],
        packer: Packer,
        counters: TransferCounters,
        *,
        page_lock: bool,
    ) -> None:
        self._arena = HostArena(
            {dtype: 2 * numel for dtype, numel in capacity.items()}, page_lock=page_lock
        )
        self.buffers = tuple(
            {dtype: self._arena.take(dtype, numel) for dtype, numel in capacity.items()}
            for _ in range(2)
        )
        self._packer = packer
        self._counters = counters
        self._pending: list[tuple[StreamedBlock, list[Future[tuple[float, float]]]] | None] = [
            None,
            None,
        ]
        self._copied: list[torch.cuda.Event | None] = [None, None]

    @property
    def nbytes(self) -> int:
        return self._arena.nbytes

    @property
    def page_locked(self) -> bool:
        return self._arena.page_locked

    def prefetch(self, block: StreamedBlock, index: int) -> None:
        """Start packing ``block`` into staging ``index`` (after its previous copy is done)."""
        pending = self._pending[index]
        if pending is not None and pending[0] is block:
            return
        self._finish(index)
        copied = self._copied[index]
        futures: list[Future[tuple[float, float]]] = []
        for dtype, pieces in block.mapped.items():
            numel = block.layout.by_dtype[dtype].numel
            target = self.buffers[index][dtype][:numel]
            before = copied.synchronize if copied is not None else None
            futures += self._packer.pack(pieces, 0, numel, target, before)
        self._pending[index] = (block, futures)

    def packed(self, block: StreamedBlock, index: int) -> dict[torch.dtype, torch.Tensor]:
        """Staging ``index`` holding ``block`` packed: waits for (or runs) its pack."""
        self.prefetch(block, index)
        waited = time.perf_counter()
        self._finish(index)
        self._counters.pack_wait_seconds += time.perf_counter() - waited
        return {
            dtype: self.buffers[index][dtype][: layout.numel]
            for dtype, layout in block.layout.by_dtype.items()
        }

    def copies(self, block: StreamedBlock, slot_index: int) -> list[HostCopy]:
        """:class:`~dlo_worker.offload.block.HostSource`: the block packed into staging."""
        return whole_buffers(self.packed(block, slot_index))

    def copied(
        self,
        block: StreamedBlock,
        slot_index: int,
        event: torch.cuda.Event | None,
        then: StreamedBlock | None,
    ) -> None:
        """The copy out of staging ``slot_index`` was enqueued (``event`` marks its end):
        start packing ``then`` into the other buffer once its previous copy is done."""
        self._copied[slot_index] = event
        if then is not None and then is not block and then.source is self:
            self.prefetch(then, 1 - slot_index)

    def _finish(self, index: int) -> None:
        """Wait for staging ``index``'s pending pack and count it."""
        pending = self._pending[index]
        if pending is None:
            return
        block, futures = pending
        self._pending[index] = None
        self._counters.pack_seconds += wait_all(futures)
        self._counters.pack_bytes += block.layout.nbytes

    def close(self) -> None:
        """Finish outstanding packs and drop the buffers (the caller synchronized copies)."""
        for index in range(2):
            self._finish(index)
        self._arena.close()
