"""The two shared device slots, the copy and communication streams, and readiness events.

Exactly two slots exist per backend, each sized for the largest streamed block
(per dtype); every DiT of a pipeline shares them. A slot moves through
``released -> loading -> ready -> in use -> released``:

- *load*: rank-local, the copy stream waits until compute released the slot and
  copies the block host-to-device. With AllGather, this rank's shard is copied into
  one of a ring of shard buffers (:class:`ShardBuffer`), possibly several blocks
  early (``stage``), and the communication stream waits for the release before
  rebuilding the full block in the slot with ``all_gather_into_tensor``. An event
  marks the slot ready.
- *use*: the compute stream waits on that event (never the host), so copies of
  block ``i + 1`` overlap compute of block ``i``.
- *release*: after the block ran, an event on the compute stream tells the next
  load that the slot may be overwritten.

On the CPU there are no streams: the same steps run synchronously, so CI
exercises the identical bookkeeping with gloo collectives.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dlo_worker.offload.block import FillingSource, HostCopy, StreamedBlock, whole_buffers


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
    pending_h2d: deque = field(default_factory=deque)
    pending_waits: deque = field(default_factory=deque)

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


@dataclass(eq=False)
class DeviceSlot:
    """One device buffer per dtype, plus the state of the block it holds."""

    buffers: dict[torch.dtype, torch.Tensor]
    block: StreamedBlock | None = None
    ready: torch.cuda.Event | None = None
    released: torch.cuda.Event | None = None


@dataclass(eq=False)
class ShardBuffer:
    """A device buffer per dtype for this rank's shard of one block (AllGather), between
    its host-to-device copy and the gather that rebuilds the block in a slot."""

    buffers: dict[torch.dtype, torch.Tensor]
    block: StreamedBlock | None = None
    """The block staged here and not gathered yet; ``None`` when the buffer is free."""
    staged: torch.cuda.Event | None = None
    """Recorded when the copy into the buffer is done."""
    consumed: torch.cuda.Event | None = None
    """Recorded when the last gather out of the buffer is done (the next copy waits)."""


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
        self.on_cuda = device.type == "cuda"
        self.slots = tuple(
            DeviceSlot(
                buffers={
                    dtype: torch.empty(numel, dtype=dtype, device=device)
                    for dtype, numel in capacity.items()
                }
            )
            for _ in range(2)
        )
        shard_capacity = {dtype: -(-numel // shards) for dtype, numel in capacity.items()}
        self.shard_ring = [
            ShardBuffer(
                {
                    dtype: torch.empty(numel, dtype=dtype, device=device)
                    for dtype, numel in shard_capacity.items()
                }
            )
            for _ in range(shard_buffers if shards > 1 else 0)
        ]
        self._next_shard_buffer = 0
        self.last_used = 1
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.comm_stream = torch.cuda.Stream(device) if shards > 1 else None
            for slot in self.slots:
                slot.ready = torch.cuda.Event()
                slot.released = torch.cuda.Event()
                # Created now (a record of nothing pending), so a filling source's own
                # threads can record and wait on them from the first load.
                slot.ready.record(self.copy_stream)
                slot.released.record(torch.cuda.current_stream(device))
            for buffer in self.shard_ring:
                buffer.staged = torch.cuda.Event()
                buffer.consumed = torch.cuda.Event()

    @property
    def device_bytes(self) -> int:
        return sum(
            tensor.nbytes
            for holder in (*self.slots, *self.shard_ring)
            for tensor in holder.buffers.values()
        )

    def index_of(self, block: StreamedBlock) -> int | None:
        for index, slot in enumerate(self.slots):
            if slot.block is block:
                return index
        return None

    def load(
        self, block: StreamedBlock, slot_index: int, upcoming: tuple[StreamedBlock, ...] = ()
    ) -> None:
        """Start moving ``block`` into slot ``slot_index`` (asynchronous on CUDA);
        ``upcoming`` are the blocks expected after it, nearest first (a staged source
        starts packing them once this copy is enqueued). The schedule decides both."""
        self.slots[slot_index].block = block
        self.counters.blocks_loaded += 1
        if self.shards > 1:
            self._gather(block, slot_index)
        elif self.on_cuda:
            self._load_cuda(block, slot_index, upcoming)
        else:
            self._load_synchronously(block, slot_index, upcoming)

    def _copy_host_to_device(
        self, copies: list[HostCopy], targets: dict[torch.dtype, torch.Tensor]
    ) -> None:
        for dtype, offset, source in copies:
            targets[dtype][offset : offset + source.numel()].copy_(source, non_blocking=True)
            self.counters.h2d_bytes += source.nbytes

    def _load_synchronously(
        self, block: StreamedBlock, slot_index: int, upcoming: tuple[StreamedBlock, ...]
    ) -> None:
        if isinstance(block.source, FillingSource):
            started = time.perf_counter()
            block.source.fill(block, slot_index, self.slots[slot_index].buffers, None, None)
            block.source.wait_filled(slot_index)
            self.counters.h2d_seconds += time.perf_counter() - started
            self.counters.h2d_bytes += block.layout.nbytes
            return
        copies = block.source.copies(block, slot_index)
        started = time.perf_counter()
        self._copy_host_to_device(copies, self.slots[slot_index].buffers)
        self.counters.h2d_seconds += time.perf_counter() - started
        block.source.copied(block, slot_index, None, upcoming)

    def _load_cuda(
        self, block: StreamedBlock, slot_index: int, upcoming: tuple[StreamedBlock, ...]
    ) -> None:
        slot = self.slots[slot_index]
        if isinstance(block.source, FillingSource):
            # Its threads wait for the release, copy and record ``ready`` on the copy stream.
            block.source.fill(block, slot_index, slot.buffers, slot.released, slot.ready)
            self.counters.h2d_bytes += block.layout.nbytes
            return
        # A staged block is packed first (a host wait), so the timed copy excludes packing.
        copies = block.source.copies(block, slot_index)
        # The copy lands in the slot itself: wait until compute released it.
        self.copy_stream.wait_event(slot.released)
        copy_finished = self._timed_copy(copies, slot.buffers)
        block.source.copied(block, slot_index, copy_finished, upcoming)
        slot.ready.record(self.copy_stream)

    def _timed_copy(
        self, copies: list[HostCopy], targets: dict[torch.dtype, torch.Tensor]
    ) -> torch.cuda.Event:
        """Copy on the copy stream between two timing events; returns the end event."""
        copy_started = torch.cuda.Event(enable_timing=True)
        copy_finished = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            copy_started.record()
            self._copy_host_to_device(copies, targets)
            copy_finished.record()
        self.counters.pending_h2d.append((copy_started, copy_finished))
        return copy_finished

    def stage(self, block: StreamedBlock, *, evict: bool = False) -> ShardBuffer | None:
        """Copy this rank's shard of ``block`` into a free shard buffer (AllGather).

        Returns the buffer (also when the shard is already staged), or ``None`` when every
        buffer holds a shard not gathered yet and ``evict`` is false. With ``evict`` (a
        load that cannot wait), the next buffer of the ring is taken over; its block is
        copied again when it is loaded. AllGather shards always come from the private
        arena (``block.host_source``): checkpoint plans are packed into it.
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
        if not self.on_cuda:
            started = time.perf_counter()
            self._copy_host_to_device(whole_buffers(block.host_source), buffer.buffers)
            self.counters.h2d_seconds += time.perf_counter() - started
            return buffer
        # Free once its last gather ran: the copy overlaps compute that reads the slots.
        self.copy_stream.wait_event(buffer.consumed)
        self._timed_copy(whole_buffers(block.host_source), buffer.buffers)
        buffer.staged.record(self.copy_stream)
        return buffer

    def stage_ahead(self, upcoming: tuple[StreamedBlock, ...]) -> None:
        """Copy the shards of ``upcoming`` blocks (nearest first) while buffers are free;
        a block already in a slot needs none."""
        for block in upcoming:
            if self.index_of(block) is None and self.stage(block) is None:
                return

    def _gather(self, block: StreamedBlock, slot_index: int) -> None:
        """Rebuild ``block`` in the slot from every rank's shard, once compute released it."""
        slot = self.slots[slot_index]
        buffer = self.stage(block, evict=True)
        if self.on_cuda:
            self.comm_stream.wait_event(buffer.staged)
            self.comm_stream.wait_event(slot.released)
            with torch.cuda.stream(self.comm_stream):
                self._all_gather(block, buffer, slot)
            slot.ready.record(self.comm_stream)
            buffer.consumed.record(self.comm_stream)
        else:
            self._all_gather(block, buffer, slot)
        buffer.block = None

    def _all_gather(self, block: StreamedBlock, buffer: ShardBuffer, slot: DeviceSlot) -> None:
        for dtype, source in block.host_source.items():
            shard = source.numel()
            dist.all_gather_into_tensor(
                _as_collective_dtype(slot.buffers[dtype][: shard * self.shards]),
                _as_collective_dtype(buffer.buffers[dtype][:shard]),
                group=self.process_group,
            )
            self.counters.allgather_bytes += shard * self.shards * dtype.itemsize

    def wait_ready(self, slot_index: int) -> None:
        """Order the current (compute) stream after the slot's load; time the stall."""
        if not self.on_cuda:
            return
        block = self.slots[slot_index].block
        if isinstance(block.source, FillingSource):
            # ``ready`` must be recorded before compute waits for it (else the wait would
            # see its previous record).
            block.source.wait_filled(slot_index)
        stall_started = torch.cuda.Event(enable_timing=True)
        stall_finished = torch.cuda.Event(enable_timing=True)
        compute = torch.cuda.current_stream(self.device)
        stall_started.record(compute)
        compute.wait_event(self.slots[slot_index].ready)
        stall_finished.record(compute)
        self.counters.pending_waits.append((stall_started, stall_finished))
        self.counters.waits += 1
        self.counters.drain(block=False)

    def release(self, slot_index: int) -> None:
        """Compute has enqueued everything that reads the slot; later loads wait for it."""
        if self.on_cuda:
            self.slots[slot_index].released.record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            self.counters.drain(block=True)

    def free(self) -> None:
        for holder in (*self.slots, *self.shard_ring):
            holder.buffers.clear()
            holder.block = None


def _as_collective_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 buffers travel as bytes: gloo has no float8 type, and a gather only moves
    bytes, so the view changes nothing in what arrives."""
    if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
        return tensor.view(torch.uint8)
    return tensor
