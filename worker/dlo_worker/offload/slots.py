"""The two shared device slots, the copy and communication streams, and readiness events.

Exactly two slots exist per backend, each sized for the largest streamed block
(per dtype); every DiT of a pipeline shares them. A slot moves through
``released -> loading (CUDA) | ready (CPU) -> in use -> released`` (:class:`SlotState`),
and every step checks it starts from a state it may start from:

- *load*: rank-local, the copy stream waits until compute released the slot and
  copies the block host-to-device. With AllGather, this rank's shard is copied into
  one of a ring of shard buffers (:class:`ShardBuffer`), possibly several blocks
  early (``copy_shard``), and the communication stream waits for the release before
  rebuilding the full block in the slot with ``all_gather_into_tensor``. An event
  marks the slot ready.
- *use*: the compute stream waits on that event (never the host), so copies of
  block ``i + 1`` overlap compute of block ``i``.
- *release*: after the block ran, an event on the compute stream tells the next
  load that the slot may be overwritten.

On the CPU there are no streams: the same steps run synchronously, so CI
exercises the identical bookkeeping with gloo collectives. The streams and events exist
only on CUDA, in one :class:`CudaOrdering`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, overload

import torch
import torch.distributed as dist

from dlo_worker.offload.block import (
    BlockFeed,
    FillingFeed,
    HostCopy,
    StreamedBlock,
    whole_buffers,
)
from dlo_worker.offload.ranges import profiled


@dataclass
class TransferCounters:
    """Raw counters behind :meth:`DistributedLayerwiseOffloadBackend.stats`."""

    blocks_loaded: int = 0
    on_demand_loads: int = 0
    h2d_bytes: int = 0
    allgather_bytes: int = 0
    h2d_seconds: float = 0.0
    pack_bytes: int = 0
    pack_seconds: float = 0.0
    """Wall time of staging packs, first chunk start to last chunk end."""
    pack_wait_seconds: float = 0.0
    """Host time the hooks waited for a pack to finish."""
    exposed_wait_seconds: float = 0.0
    waits: int = 0
    pending_h2d: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=deque)
    pending_waits: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=deque)

    def drain(self, *, block: bool) -> None:
        """Fold finished CUDA timing events into the totals (``block`` waits for all)."""
        for pending, attribute in (
            (self.pending_h2d, "h2d_seconds"),
            (self.pending_waits, "exposed_wait_seconds"),
        ):
            while pending:
                start, end = pending[0]
                if not block and not end.query():
                    break
                end.synchronize()
                pending.popleft()
                setattr(self, attribute, getattr(self, attribute) + start.elapsed_time(end) / 1e3)


class SlotState(StrEnum):
    RELEASED = "released"
    """Compute no longer reads the slot. It may still hold a block whose weights are valid:
    that block runs again from here without a load."""
    LOADING = "loading"
    """A load into the slot was enqueued (CUDA): compute waits for its ready event."""
    READY = "ready"
    """The block was copied in synchronously (CPU)."""
    IN_USE = "in use"
    """The held block runs: compute reads the slot until it is released."""


class SlotStateError(RuntimeError):
    """A slot step from a state it may not start from: loading over weights compute still
    reads, running a slot that holds nothing. A bug in the hot path, never user input."""


@dataclass(eq=False)
class DeviceSlot:
    """One device buffer per dtype, the block it holds and where it is in its cycle."""

    index: int
    buffers: dict[torch.dtype, torch.Tensor]
    block: StreamedBlock | None = None
    state: SlotState = SlotState.RELEASED

    def move(self, to: SlotState, *, allowed_from: tuple[SlotState, ...]) -> None:
        if self.state not in allowed_from:
            held = self.block.name if self.block is not None else "nothing"
            raise SlotStateError(
                f"slot {self.index} is {self.state} (holding {held}) and cannot become {to}"
            )
        self.state = to


@dataclass(eq=False)
class ShardBuffer:
    """A device buffer per dtype for this rank's shard of one block (AllGather), between
    its host-to-device copy and the gather that rebuilds the block in a slot."""

    index: int
    buffers: dict[torch.dtype, torch.Tensor]
    block: StreamedBlock | None = None
    """The block whose shard was copied here and not gathered yet (``None``: free)."""


@dataclass(eq=False)
class SlotEvents:
    ready: torch.cuda.Event
    """Recorded when the load into the slot is done."""
    released: torch.cuda.Event
    """Recorded on the compute stream after the last read of the slot was enqueued."""


@dataclass(eq=False)
class ShardEvents:
    copied: torch.cuda.Event
    """Recorded when the copy into the shard buffer is done."""
    consumed: torch.cuda.Event
    """Recorded when the last gather out of the buffer is done (the next copy waits)."""


class CudaOrdering:
    """The copy and communication streams and the events that order copies, gathers and
    compute on a CUDA device (the CPU runs every step synchronously and has none)."""

    def __init__(self, device: torch.device, slots: int, shard_buffers: int) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self.comm_stream = torch.cuda.Stream(device)
        self.slots = [SlotEvents(torch.cuda.Event(), torch.cuda.Event()) for _ in range(slots)]
        for events in self.slots:
            # Recorded now (nothing pending), so a filling feed's own threads can record
            # and wait on them from the first load.
            events.ready.record(self.copy_stream)
            events.released.record(torch.cuda.current_stream(device))
        self.shards = [
            ShardEvents(torch.cuda.Event(), torch.cuda.Event()) for _ in range(shard_buffers)
        ]

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)


class SlotPair:
    """Owns both slots, the streams and the events; loads blocks and orders compute after them."""

    def __init__(
        self,
        device: torch.device,
        capacity: dict[torch.dtype, int],
        *,
        process_group: dist.ProcessGroup | None,
        shards: int,
        counters: TransferCounters,
        shard_buffers: int = 2,
    ) -> None:
        self.device = device
        self.process_group = process_group
        self.shards = shards
        self.counters = counters
        self.slots = tuple(
            DeviceSlot(
                index,
                {
                    dtype: torch.empty(numel, dtype=dtype, device=device)
                    for dtype, numel in capacity.items()
                },
            )
            for index in range(2)
        )
        shard_capacity = {dtype: -(-numel // shards) for dtype, numel in capacity.items()}
        self.shard_ring = [
            ShardBuffer(
                index,
                {
                    dtype: torch.empty(numel, dtype=dtype, device=device)
                    for dtype, numel in shard_capacity.items()
                },
            )
            for index in range(shard_buffers if shards > 1 else 0)
        ]
        self._next_shard_buffer = 0
        self.last_used = 1
        self._cuda = (
            CudaOrdering(device, len(self.slots), len(self.shard_ring))
            if device.type == "cuda"
            else None
        )

    @property
    def on_cuda(self) -> bool:
        return self._cuda is not None

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The stream host-to-device copies run on (``None`` on the CPU)."""
        return self._cuda.copy_stream if self._cuda is not None else None

    @property
    def device_bytes(self) -> int:
        slots = sum(t.nbytes for slot in self.slots for t in slot.buffers.values())
        shards = sum(t.nbytes for buffer in self.shard_ring for t in buffer.buffers.values())
        return slots + shards

    def index_of(self, block: StreamedBlock) -> int | None:
        for index, slot in enumerate(self.slots):
            if slot.block is block:
                return index
        return None

    def load(
        self, block: StreamedBlock, slot_index: int, upcoming: tuple[StreamedBlock, ...] = ()
    ) -> None:
        """Start moving ``block`` into slot ``slot_index`` (asynchronous on CUDA);
        ``upcoming`` are the blocks expected after it, nearest first (a staging feed
        starts packing them once this copy is enqueued). The schedule decides both."""
        with profiled("load", block.name):
            self._load(block, self.slots[slot_index], upcoming)

    def _load(
        self, block: StreamedBlock, slot: DeviceSlot, upcoming: tuple[StreamedBlock, ...]
    ) -> None:
        slot.move(
            SlotState.LOADING,
            allowed_from=(SlotState.RELEASED, SlotState.LOADING, SlotState.READY),
        )
        slot.block = block
        self.counters.blocks_loaded += 1
        if self.shards > 1:
            self._gather(block, slot)
        elif self._cuda is not None:
            self._load_cuda(block, slot, upcoming, self._cuda)
        else:
            self._load_synchronously(block, slot, upcoming)
        if self._cuda is None:
            slot.move(SlotState.READY, allowed_from=(SlotState.LOADING,))

    def _copy_host_to_device(
        self, copies: list[HostCopy], targets: dict[torch.dtype, torch.Tensor]
    ) -> None:
        for dtype, offset, tensor in copies:
            targets[dtype][offset : offset + tensor.numel()].copy_(tensor, non_blocking=True)
            self.counters.h2d_bytes += tensor.nbytes

    def _load_synchronously(
        self, block: StreamedBlock, slot: DeviceSlot, upcoming: tuple[StreamedBlock, ...]
    ) -> None:
        feed = _feed_of(block)
        if isinstance(feed, FillingFeed):
            started = time.perf_counter()
            feed.fill(block, slot.index, slot.buffers, None, None)
            feed.wait_filled(slot.index)
            self.counters.h2d_seconds += time.perf_counter() - started
            self.counters.h2d_bytes += block.layout.nbytes
            return
        copies = feed.copies(block, slot.index)
        started = time.perf_counter()
        self._copy_host_to_device(copies, slot.buffers)
        self.counters.h2d_seconds += time.perf_counter() - started
        feed.copied(block, slot.index, None, upcoming)

    def _load_cuda(
        self,
        block: StreamedBlock,
        slot: DeviceSlot,
        upcoming: tuple[StreamedBlock, ...],
        cuda: CudaOrdering,
    ) -> None:
        events = cuda.slots[slot.index]
        feed = _feed_of(block)
        if isinstance(feed, FillingFeed):
            # Its threads wait for the release, copy and record ``ready`` on the copy stream.
            feed.fill(block, slot.index, slot.buffers, events.released, events.ready)
            self.counters.h2d_bytes += block.layout.nbytes
            return
        # A staged block is packed first (a host wait), so the timed copy excludes packing.
        copies = feed.copies(block, slot.index)
        # The copy lands in the slot itself: wait until compute released it.
        cuda.copy_stream.wait_event(events.released)
        copy_finished = self._timed_copy(copies, slot.buffers, cuda)
        feed.copied(block, slot.index, copy_finished, upcoming)
        events.ready.record(cuda.copy_stream)

    def _timed_copy(
        self,
        copies: list[HostCopy],
        targets: dict[torch.dtype, torch.Tensor],
        cuda: CudaOrdering,
    ) -> torch.cuda.Event:
        """Copy on the copy stream between two timing events; returns the end event."""
        copy_started = torch.cuda.Event(enable_timing=True)
        copy_finished = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(cuda.copy_stream):
            copy_started.record()
            self._copy_host_to_device(copies, targets)
            copy_finished.record()
        self.counters.pending_h2d.append((copy_started, copy_finished))
        return copy_finished

    @overload
    def copy_shard(self, block: StreamedBlock, *, evict: Literal[True]) -> ShardBuffer: ...
    @overload
    def copy_shard(self, block: StreamedBlock, *, evict: bool = False) -> ShardBuffer | None: ...
    def copy_shard(self, block: StreamedBlock, *, evict: bool = False) -> ShardBuffer | None:
        """Copy this rank's shard of ``block`` into a free shard buffer (AllGather).

        Returns the buffer (also when the shard is already there), or ``None`` when every
        buffer holds a shard not gathered yet and ``evict`` is false. With ``evict`` (a
        load that cannot wait), the next buffer of the ring is taken over; its block is
        copied again when it is loaded. AllGather shards always come from the private
        arena (``block.arena_views``): checkpoint mappings are packed into it.
        """
        for buffer in self.shard_ring:
            if buffer.block is block:
                return buffer
        ring = len(self.shard_ring)
        order = [(self._next_shard_buffer + step) % ring for step in range(ring)]
        free = [index for index in order if self.shard_ring[index].block is None]
        if not free and not evict:
            return None
        index = free[0] if free else order[0]
        self._next_shard_buffer = (index + 1) % ring
        buffer = self.shard_ring[index]
        buffer.block = block
        if self._cuda is None:
            started = time.perf_counter()
            self._copy_host_to_device(whole_buffers(block.arena_views), buffer.buffers)
            self.counters.h2d_seconds += time.perf_counter() - started
            return buffer
        # Free once its last gather ran: the copy overlaps compute that reads the slots.
        events = self._cuda.shards[buffer.index]
        self._cuda.copy_stream.wait_event(events.consumed)
        self._timed_copy(whole_buffers(block.arena_views), buffer.buffers, self._cuda)
        events.copied.record(self._cuda.copy_stream)
        return buffer

    def copy_shards_ahead(self, upcoming: tuple[StreamedBlock, ...]) -> None:
        """Copy the shards of ``upcoming`` blocks (nearest first) while buffers are free;
        a block already in a slot needs none."""
        for block in upcoming:
            if self.index_of(block) is None and self.copy_shard(block) is None:
                return

    def _gather(self, block: StreamedBlock, slot: DeviceSlot) -> None:
        """Rebuild ``block`` in the slot from every rank's shard, once compute released it."""
        buffer = self.copy_shard(block, evict=True)
        cuda = self._cuda
        if cuda is not None:
            slot_events, shard_events = cuda.slots[slot.index], cuda.shards[buffer.index]
            cuda.comm_stream.wait_event(shard_events.copied)
            cuda.comm_stream.wait_event(slot_events.released)
            with torch.cuda.stream(cuda.comm_stream):
                self._all_gather(block, buffer, slot)
            slot_events.ready.record(cuda.comm_stream)
            shard_events.consumed.record(cuda.comm_stream)
        else:
            self._all_gather(block, buffer, slot)
        buffer.block = None

    def _all_gather(self, block: StreamedBlock, buffer: ShardBuffer, slot: DeviceSlot) -> None:
        with profiled("all_gather", block.name):
            self._all_gather_dtypes(block, buffer, slot)

    def _all_gather_dtypes(
        self, block: StreamedBlock, buffer: ShardBuffer, slot: DeviceSlot
    ) -> None:
        for dtype, arena_view in block.arena_views.items():
            shard = arena_view.numel()
            dist.all_gather_into_tensor(
                _as_collective_dtype(slot.buffers[dtype][: shard * self.shards]),
                _as_collective_dtype(buffer.buffers[dtype][:shard]),
                group=self.process_group,
            )
            self.counters.allgather_bytes += shard * self.shards * dtype.itemsize

    def wait_ready(self, slot_index: int) -> None:
        """The slot's block is about to run: order the current (compute) stream after its
        load (inside :meth:`exposed`, which times the stall); the slot is in use until
        :meth:`release`."""
        block = self.slots[slot_index].block
        if block is None:
            raise SlotStateError(f"slot {slot_index} holds no block to run")
        with profiled("wait", block.name):
            self._wait_ready(slot_index, block)

    def _wait_ready(self, slot_index: int, block: StreamedBlock) -> None:
        slot = self.slots[slot_index]
        slot.move(
            SlotState.IN_USE,
            allowed_from=(SlotState.LOADING, SlotState.READY, SlotState.RELEASED),
        )
        cuda = self._cuda
        if cuda is None:
            return
        feed = block.feed
        if isinstance(feed, FillingFeed):
            # ``ready`` must be recorded before compute waits for it (else the wait would
            # see its previous record).
            feed.wait_filled(slot_index)
        cuda.compute_stream().wait_event(cuda.slots[slot_index].ready)
        self.counters.waits += 1

    @contextmanager
    def exposed(self) -> Iterator[None]:
        """Time how long what runs inside keeps compute waiting (on CUDA; the CPU hooks
        time their synchronous copies themselves): one event on the compute stream before
        it and one after. Compute still running hides a host wait (a pack, a staging
        ring's enqueue) and a stream wait for a copy alike; what it does not hide, both
        events' span holds. Timing only the stream's wait missed the host waits, so a
        staged step looked as if compute never waited."""
        cuda = self._cuda
        if cuda is None:
            yield
            return
        compute = cuda.compute_stream()
        started = torch.cuda.Event(enable_timing=True)
        started.record(compute)
        yield
        finished = torch.cuda.Event(enable_timing=True)
        finished.record(compute)
        self.counters.pending_waits.append((started, finished))
        self.counters.drain(block=False)

    def release(self, slot_index: int) -> None:
        """Compute has enqueued everything that reads the slot; later loads wait for it."""
        self.slots[slot_index].move(SlotState.RELEASED, allowed_from=(SlotState.IN_USE,))
        if self._cuda is not None:
            self._cuda.slots[slot_index].released.record(self._cuda.compute_stream())

    def synchronize(self) -> None:
        if self._cuda is not None:
            torch.cuda.synchronize(self.device)
            self.counters.drain(block=True)

    def free(self) -> None:
        for slot in self.slots:
            slot.buffers.clear()
            slot.block = None
            slot.state = SlotState.RELEASED
        for buffer in self.shard_ring:
            buffer.buffers.clear()
            buffer.block = None


def _feed_of(block: StreamedBlock) -> BlockFeed | FillingFeed:
    feed = block.feed
    if feed is None:
        raise SlotStateError(f"{block.name} has no feed: the backend did not bind one")
    return feed


def _as_collective_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 buffers travel as bytes: gloo has no float8 type, and a gather only moves
    bytes, so the view changes nothing in what arrives."""
    if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
        return tensor.view(torch.uint8)
    return tensor
