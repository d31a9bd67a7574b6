"""Staging through a cache-sized ring: mapped blocks packed and copied chunk by chunk.

Packing a whole block into a block-sized staging buffer touches every byte three times
in DRAM (page-cache read, staging write, the copy engine's read). Here the block is
packed in chunks of a few MiB into a ring of page-locked chunks that fits the CPU's
last-level cache, and each chunk is copied to the slot as soon as it is packed, so the
copy engine reads it from cache. Measured without a model on an H200 host, that moved
about 1.45x the bytes per second of block buffers (``bench/staging_ring_probe.py``).

The packers and the thread that orders the chunk copies on the copy stream are native
(``_staging_ring.c``, loaded with ctypes): a Python thread doing the same competes for
the interpreter with the thread that launches the model's kernels and could not keep
the copy engine busy. Without CUDA the same ring copies chunks with ``memcpy``, so the
CPU tests run the native code.

This is a *filling* source (:class:`~dlo_worker.offload.block.FillingFeed`): a load
hands the slot to the ring, which makes the copy stream wait for the slot's release,
copies every chunk and records the slot's ready event; compute waits until the ring has
enqueued that record before it orders itself after the event.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dlo_worker.errors import UserFixableError
from dlo_worker.native import NOT_BUILT, staging_ring_library
from dlo_worker.offload.block import StreamedBlock, coalesce
from dlo_worker.offload.feeds.arena import HostArena
from dlo_worker.offload.feeds.cuda_registrar import loaded_cudart

if TYPE_CHECKING:
    from dlo_worker.offload.slots import TransferCounters

logger = logging.getLogger(__name__)


class StagingRingUnavailableError(RuntimeError, UserFixableError):
    """The native staging ring is not built (``pip install`` needs a C compiler for it)."""


class StagingRingError(RuntimeError):
    """The native ring reported a failure (a CUDA status or its own error code)."""


class _CudaApi(ctypes.Structure):
    """``dlo_cuda_api`` of ``_staging_ring.c``: the CUDA runtime functions the ring calls."""

    _fields_ = (
        ("set_device", ctypes.c_void_p),
        ("memcpy_async", ctypes.c_void_p),
        ("event_create_with_flags", ctypes.c_void_p),
        ("event_destroy", ctypes.c_void_p),
        ("event_record", ctypes.c_void_p),
        ("event_synchronize", ctypes.c_void_p),
        ("stream_wait_event", ctypes.c_void_p),
    )


_CUDA_FUNCTIONS = {
    "set_device": "cudaSetDevice",
    "memcpy_async": "cudaMemcpyAsync",
    "event_create_with_flags": "cudaEventCreateWithFlags",
    "event_destroy": "cudaEventDestroy",
    "event_record": "cudaEventRecord",
    "event_synchronize": "cudaEventSynchronize",
    "stream_wait_event": "cudaStreamWaitEvent",
}


class _Piece(ctypes.Structure):
    _fields_ = (
        ("source", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
    )


class _Stats(ctypes.Structure):
    _fields_ = (
        ("packed_bytes", ctypes.c_uint64),
        ("pack_ns", ctypes.c_uint64),
        ("lane_idle_ns", ctypes.c_uint64),
        ("ring_full_wait_ns", ctypes.c_uint64),
        ("feeder_wait_ns", ctypes.c_uint64),
        ("feeder_idle_ns", ctypes.c_uint64),
        ("chunks", ctypes.c_uint64),
        ("copy_wait_ns", ctypes.c_uint64),
        ("feeder_enqueue_ns", ctypes.c_uint64),
    )


def check_built() -> None:
    """Refuse to start with the ring asked for where this installation did not build it."""
    if staging_ring_library() is None:
        raise StagingRingUnavailableError(
            f"--dlo-staging ring: {NOT_BUILT}; or stage with block buffers (--dlo-staging "
            "auto or buffers)"
        )


def load_library() -> ctypes.CDLL:
    """The built native ring; :class:`StagingRingUnavailableError` says why when it is missing."""
    path = staging_ring_library()
    if path is None:
        raise StagingRingUnavailableError(NOT_BUILT)
    library = ctypes.CDLL(str(path))
    library.dlo_ring_create.restype = ctypes.c_void_p
    library.dlo_ring_create.argtypes = [
        ctypes.POINTER(_CudaApi),
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
    ]
    library.dlo_ring_submit.restype = ctypes.c_int64
    library.dlo_ring_submit.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(_Piece),
        ctypes.c_uint64,
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    library.dlo_ring_wait.restype = ctypes.c_int
    library.dlo_ring_wait.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    library.dlo_ring_thread_ids.restype = ctypes.c_int
    library.dlo_ring_thread_ids.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int,
    ]
    library.dlo_ring_stats_read.restype = None
    library.dlo_ring_stats_read.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Stats)]
    library.dlo_ring_destroy.restype = None
    library.dlo_ring_destroy.argtypes = [ctypes.c_void_p]
    return library


def _cuda_api() -> _CudaApi:
    cudart = loaded_cudart()
    return _CudaApi(
        **{
            field: ctypes.cast(getattr(cudart, name), ctypes.c_void_p).value
            for field, name in _CUDA_FUNCTIONS.items()
        }
    )


@dataclass(frozen=True)
class RingCounters:
    """What the ring did so far (cumulative)."""

    packed_bytes: int
    pack_seconds: float
    """Summed over packers: time spent packing."""
    idle_seconds: float
    """Summed over packers: no chunk submitted to pack (the model computes)."""
    ring_full_wait_seconds: float
    """Summed over packers: a chunk to pack but its ring slot not free yet, its previous
    chunk still being copied out or not yet on the stream (``copy_wait_seconds`` says
    how much was the copy)."""
    copy_wait_seconds: float
    """The part of ``ring_full_wait_seconds`` spent waiting for the slot's copy to finish
    (the rest waited for the feeder to put the slot's previous chunk on the stream)."""
    feeder_wait_seconds: float
    """Time the copy-ordering thread waited for the next chunk's pack (the packers are
    behind the copy engine: with the copy engine idle, this is lost time)."""
    feeder_enqueue_seconds: float
    """Time the copy-ordering thread spent in CUDA calls putting copies on the stream."""
    chunks: int
    runqueue_wait_seconds: float | None
    """Summed over the packers and the feeder: time they were ready to run but waited for
    a CPU (the kernel's schedstat), or ``None`` where the kernel does not report it. A
    packer woken by a finished copy that waits here lets the queued copies run out: the
    host runs more busy threads than it has CPUs."""


def runqueue_wait_seconds(
    thread_ids: Sequence[int], tasks: Path = Path("/proc/self/task")
) -> float | None:
    """Seconds ``thread_ids`` spent runnable, waiting for a CPU, from each thread's
    ``schedstat`` (run time, run-queue wait, timeslices; nanoseconds); ``None`` where a
    file is missing or the kernel reports no run time for threads that ran (it keeps no
    scheduler statistics)."""
    ran = waited = 0
    for thread_id in thread_ids:
        try:
            run_ns, wait_ns, _ = (tasks / str(thread_id) / "schedstat").read_text().split()
            ran, waited = ran + int(run_ns), waited + int(wait_ns)
        except (OSError, ValueError):
            return None
    return waited / 1e9 if ran > 0 else None


class StagingRing:
    """:class:`~dlo_worker.offload.block.FillingFeed` of mapped views; see the module doc."""

    def __init__(
        self,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        counters: TransferCounters,
        *,
        lanes: int,
        chunk_bytes: int,
        chunks: int,
    ) -> None:
        self._library = load_library()
        self.lanes = lanes
        self.chunk_bytes = chunk_bytes
        self._counters = counters
        chunks = max(2, chunks)
        on_cuda = device.type == "cuda"
        self._arena = HostArena({torch.uint8: chunks * chunk_bytes}, page_lock=on_cuda)
        memory = self._arena.take(torch.uint8, chunks * chunk_bytes)
        self._api = _cuda_api() if on_cuda else None
        error = ctypes.c_int(0)
        handle = self._library.dlo_ring_create(
            ctypes.byref(self._api) if self._api is not None else None,
            (device.index or 0) if on_cuda else 0,
            stream.cuda_stream if stream is not None else None,
            memory.data_ptr(),
            chunk_bytes,
            chunks,
            lanes,
            ctypes.byref(error),
        )
        if not handle:
            self._arena.close()
            raise StagingRingError(f"creating the staging ring failed (error {error.value})")
        self._handle = handle
        ids = (ctypes.c_int64 * (lanes + 1))()
        count = self._library.dlo_ring_thread_ids(handle, ids, lanes + 1)
        self.thread_ids: tuple[int, ...] = tuple(ids[: min(count, lanes + 1)])
        """The kernel's ids of the ring's threads, its feeder and every packer, which keep
        running until :meth:`close`."""
        self._pieces: dict[int, list[tuple[torch.dtype, ctypes.Array[Any], int]]] = {}
        self._pending: dict[int, tuple[int, tuple[torch.cuda.Event, torch.cuda.Event] | None]] = {}
        """Per slot, the last job that fills it and was not waited for, with its timing
        events (CUDA)."""
        self._stream = stream

    @property
    def nbytes(self) -> int:
        return self._arena.nbytes

    @property
    def page_locked(self) -> bool:
        return self._arena.page_locked

    def fill(
        self,
        block: StreamedBlock,
        slot_index: int,
        buffers: dict[torch.dtype, torch.Tensor],
        after: torch.cuda.Event | None,
        ready: torch.cuda.Event | None,
    ) -> None:
        """Queue ``block``'s copy into slot ``slot_index`` (returns at once): the copy
        stream waits for ``after`` first and records ``ready`` after the last chunk."""
        timing = None
        if self._stream is not None:
            # Recorded once here so they exist; the ring records them again around the copies.
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for event in timing:
                event.record(self._stream)
        jobs = self._jobs(block)
        job = -1
        for index, (dtype, pieces, nbytes) in enumerate(jobs):
            first, last = index == 0, index == len(jobs) - 1
            job = self._library.dlo_ring_submit(
                self._handle,
                pieces,
                len(pieces),
                buffers[dtype].data_ptr(),
                nbytes,
                _event_handle(after) if first else None,
                _event_handle(timing[0]) if first and timing else None,
                _event_handle(ready) if last else None,
                _event_handle(timing[1]) if last and timing else None,
            )
            if job < 0:
                raise StagingRingError(f"the staging ring stopped (error {-job})")
        self._pending[slot_index] = (job, timing)

    def wait_filled(self, slot_index: int) -> None:
        """Return once the fill of slot ``slot_index`` is enqueued (the ready event recorded;
        without CUDA: copied). The wait releases the interpreter."""
        pending = self._pending.pop(slot_index, None)
        if pending is None:
            return
        job, timing = pending
        waited = time.perf_counter()
        status = self._library.dlo_ring_wait(self._handle, job)
        self._counters.pack_wait_seconds += time.perf_counter() - waited
        if status != 0:
            raise StagingRingError(f"the staging ring failed (status {status})")
        if timing is not None:
            # Only now: before the ring re-records them, they mark the wrong span.
            self._counters.pending_h2d.append(timing)

    def counters(self) -> RingCounters:
        stats = _Stats()
        self._library.dlo_ring_stats_read(self._handle, ctypes.byref(stats))
        return RingCounters(
            packed_bytes=stats.packed_bytes,
            pack_seconds=stats.pack_ns / 1e9,
            idle_seconds=stats.lane_idle_ns / 1e9,
            ring_full_wait_seconds=stats.ring_full_wait_ns / 1e9,
            copy_wait_seconds=stats.copy_wait_ns / 1e9,
            feeder_wait_seconds=stats.feeder_wait_ns / 1e9,
            feeder_enqueue_seconds=stats.feeder_enqueue_ns / 1e9,
            chunks=stats.chunks,
            runqueue_wait_seconds=runqueue_wait_seconds(self.thread_ids),
        )

    def _jobs(self, block: StreamedBlock) -> list[tuple[torch.dtype, ctypes.Array[Any], int]]:
        """Per dtype: the block's pieces as the ring reads them, and the packed size."""
        jobs = self._pieces.get(id(block))
        if jobs is None:
            jobs = []
            for dtype, pieces in block.mapped.items():
                merged = coalesce(pieces)
                array = (_Piece * len(merged))(
                    *(
                        _Piece(
                            piece.view.data_ptr(),
                            piece.offset * dtype.itemsize,
                            piece.numel * dtype.itemsize,
                        )
                        for piece in merged
                    )
                )
                jobs.append((dtype, array, block.layout.by_dtype[dtype].numel * dtype.itemsize))
            self._pieces[id(block)] = jobs
        return jobs

    def close(self) -> None:
        """Wait for queued fills, stop the threads and drop the ring (the caller then
        synchronizes before the mapped views go away)."""
        if self._handle is None:
            return
        for slot_index in list(self._pending):
            try:
                self.wait_filled(slot_index)
            except StagingRingError:
                logger.exception("a staging ring fill failed during close")
        self._library.dlo_ring_destroy(self._handle)
        self._handle = None
        self._pieces.clear()
        if self._api is not None:
            torch.cuda.synchronize()  # the last chunk copies may still read the ring
        self._arena.close()


def _event_handle(event: torch.cuda.Event | None) -> int | None:
    """The ``cudaEvent_t`` behind a torch event (``None`` without one)."""
    if event is None:
        return None
    return event.cuda_event or None
