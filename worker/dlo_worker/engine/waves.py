"""Request waves: how the ranks of one engine share the requests its leader receives.

Global rank 0 (the leader) owns intake. It repeatedly takes a *wave* from the queue,
one lane per data-parallel rank, broadcasts it to every rank over a gloo control group
(CPU objects only, so an idle engine never holds a device collective open), runs its
own lane, and gathers the encoded images. With sequence parallelism a lane belongs to a
whole SP group: its ranks run the same request together and the group's first rank
reports the images. An idle leader broadcasts an empty wave every
``heartbeat_s`` so the followers' waits stay far inside the control group's timeout.

With DLO AllGather over DP (``lockstep``) every rank must run the same block sequence,
so a wave only holds requests with the same :func:`~dlo_worker.engine.request.wave_key`
(sizes and image counts may differ) and idle ranks run a dummy copy of the wave's first
request whose image is discarded. Otherwise (resident or rank-local DLO) idle ranks
simply sit the wave out and requests mix freely.

Stopping: :meth:`Engine.request_stop` (SIGTERM on the leader) closes intake at once, from
a watcher thread, even while a wave runs; the leader keeps taking waves until the queue is
empty, then broadcasts a stop message that every
rank obeys. Followers ignore their own SIGTERM and wait for that message, because the
leader's drain needs them.

A rank that dies (``kill -9``, the OOM killer) fails the next collective of the control
group on every other rank: the engine stops (:class:`~dlo_worker.errors.
EngineStoppedError`), the leader first answering the requests of the wave and of the
queue with that error (``503`` over HTTP, another replica can take them).
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from dlo_worker.engine.generation import change_adapters, generate_images
from dlo_worker.engine.request import AdapterChange, GenerationRequest, wave_key
from dlo_worker.engine.stages import record_device_peak, stage_fields
from dlo_worker.errors import EngineStoppedError
from dlo_worker.observability import metrics
from dlo_worker.pipeline.lora import LoraSetupError

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# Followers wait at most this long for the leader: a wave's gather waits for the slowest
# rank, so it must exceed the longest generation the engine serves.
CONTROL_TIMEOUT = timedelta(minutes=30)


class IntakeClosedError(RuntimeError):
    """The engine is loading or draining and takes no new requests."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``--max-queued-requests`` allows."""


class GenerationFailedError(RuntimeError):
    """The pipeline raised while running a request (the message says why)."""


class AdapterChangeError(RuntimeError):
    """An adapter could not be loaded (the message names the file and the reason)."""


@dataclass(frozen=True)
class Wave:
    """One lane per DP rank: a request, or None when the rank sits the wave out.

    ``discarded`` names the lanes that run a dummy copy only to keep a lockstep wave
    in step; their images are dropped. ``change`` is a wave of its own that every rank
    makes (an adapter loaded or unloaded) instead of running requests. ``stop`` ends
    every rank's loop.
    """

    lanes: tuple[GenerationRequest | None, ...] = ()
    discarded: frozenset[int] = frozenset()
    change: AdapterChange | None = None
    stop: bool = False

    @property
    def empty(self) -> bool:
        return self.change is None and all(lane is None for lane in self.lanes)


def choose_wave(
    pending: list[GenerationRequest], width: int, lockstep: bool
) -> tuple[list[int], Wave]:
    """Choose which pending requests (by index, oldest first) run in the next wave (pure).

    Returns the chosen indices, in lane order, and the wave. The oldest request always
    runs, so a request is never starved by later ones with a different key.
    """
    if not pending:
        return [], Wave(lanes=(None,) * width)
    head_key = wave_key(pending[0])
    chosen = [
        index
        for index, request in enumerate(pending)
        if not lockstep or wave_key(request) == head_key
    ][:width]
    lanes: list[GenerationRequest | None] = [pending[index] for index in chosen]
    idle = range(len(lanes), width)
    if lockstep:
        lanes.extend(pending[0] for _ in idle)
        return chosen, Wave(lanes=tuple(lanes), discarded=frozenset(idle))
    lanes.extend(None for _ in idle)
    return chosen, Wave(lanes=tuple(lanes))


def _next_wave(
    pending: list[GenerationRequest | AdapterChange], width: int, lockstep: bool
) -> tuple[list[int], Wave]:
    """:func:`choose_wave` among the requests queued before the first adapter change, or
    that change alone when it is the oldest: a change waits for every request queued
    before it, and requests queued after it wait for it (pure)."""
    if pending and isinstance(head := pending[0], AdapterChange):
        return [0], Wave(lanes=(None,) * width, change=head)
    requests: list[GenerationRequest] = []
    for item in pending:
        if isinstance(item, AdapterChange):
            break
        requests.append(item)
    return choose_wave(requests, width, lockstep)


@dataclass(eq=False)
class Submission:
    """A queued request, or adapter change. Its future resolves to the request's PNGs (an
    empty list for a change); cancelling a request before its wave starts (the client went
    away) drops it."""

    request: GenerationRequest | AdapterChange
    future: Future[list[bytes]] = field(default_factory=Future)
    enqueued_at: float = field(default_factory=time.monotonic)

    def mark_running(self) -> bool:
        """Commit to running the request; False if it was cancelled first."""
        return self.future.running() or self.future.set_running_or_notify_cancel()

    def fail(self, error: Exception) -> None:
        """Answer with ``error``, counted as a failed request (a change counts where its
        route answers)."""
        self.future.set_exception(error)
        if isinstance(self.request, GenerationRequest):
            metrics.REQUESTS.labels(outcome="failed").inc()


class RequestQueue:
    """The leader's bounded FIFO between HTTP handler threads and the engine loop."""

    def __init__(self, max_pending: int) -> None:
        self._max_pending = max_pending
        self._pending: deque[Submission] = deque()
        self._open = False
        self._changed = threading.Condition()

    @property
    def accepting(self) -> bool:
        return self._open

    def open(self) -> None:
        with self._changed:
            self._open = True

    def close(self) -> None:
        """Stop intake; already queued requests still run."""
        with self._changed:
            self._open = False
            self._changed.notify_all()

    def submit(self, request: GenerationRequest | AdapterChange) -> Future[list[bytes]]:
        with self._changed:
            if not self._open:
                raise IntakeClosedError(
                    "the engine is not accepting requests (loading or draining)"
                )
            if len(self._pending) >= self._max_pending:
                raise QueueFullError(
                    f"{len(self._pending)} requests are already queued "
                    "(--max-queued-requests); retry later"
                )
            submission = Submission(request)
            self._pending.append(submission)
            metrics.QUEUE_DEPTH.set(len(self._pending))
            self._changed.notify_all()
            return submission.future

    def __len__(self) -> int:
        with self._changed:
            return len(self._pending)

    def take_wave(
        self, width: int, lockstep: bool, timeout: float
    ) -> tuple[list[Submission], Wave]:
        """The next wave, waiting up to ``timeout`` for a first request. Requests whose
        future was cancelled (their client went away) are dropped and counted."""
        with self._changed:
            if not self._pending and self._open:
                self._changed.wait(timeout)
            while True:
                self._drop_cancelled_locked()
                chosen, wave = _next_wave([s.request for s in self._pending], width, lockstep)
                # Once running, a future can no longer be cancelled: the request runs.
                if all(self._pending[index].mark_running() for index in chosen):
                    break
            taken = [self._pending[index] for index in chosen]
            for submission in taken:
                self._pending.remove(submission)
            metrics.QUEUE_DEPTH.set(len(self._pending))
            return taken, wave

    def fail_pending(self, error: Exception) -> None:
        """Close intake and answer every queued request with ``error``: the engine that
        would have run them stopped."""
        with self._changed:
            self._open = False
            while self._pending:
                submission = self._pending.popleft()
                if submission.future.set_running_or_notify_cancel():
                    submission.fail(error)
            metrics.QUEUE_DEPTH.set(0)
            self._changed.notify_all()

    def drop_cancelled(self) -> int:
        """Drop and count the requests whose client went away; returns how many."""
        with self._changed:
            return self._drop_cancelled_locked()

    def _drop_cancelled_locked(self) -> int:
        cancelled = [s for s in self._pending if s.future.cancelled()]
        for submission in cancelled:
            self._pending.remove(submission)
            metrics.REQUESTS.labels(outcome="dropped_disconnected").inc()
            logger.info("request dropped: its client went away before its wave")
        metrics.QUEUE_DEPTH.set(len(self._pending))
        return len(cancelled)


class ControlChannel:
    """Leader-to-ranks messages on a dedicated gloo group (a no-op with one process)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        # Every rank is in this group, so new_group never answers "not a member" here.
        group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if world_size > 1 else None
        self._group = group if isinstance(group, dist.ProcessGroup) else None

    def broadcast(self, wave: Wave | None) -> Wave:
        """The leader passes its wave; the followers pass None and receive it."""
        if self._group is None:
            assert wave is not None
            return wave
        box: list[Wave | None] = [wave]
        try:
            dist.broadcast_object_list(box, src=0, group=self._group)
        except RuntimeError as error:
            raise _rank_lost(error) from error
        received = box[0]
        if received is None:
            raise RuntimeError("rank 0 broadcast no wave; every follower waits for the leader's")
        return received

    def gather(self, result: list[bytes] | str | None) -> list[list[bytes] | str | None]:
        """Every rank's result at the leader (followers get an empty list)."""
        if self._group is None:
            return [result]
        is_leader = dist.get_rank() == 0
        results: list[list[bytes] | str | None] | None = (
            [None] * self.world_size if is_leader else None
        )
        try:
            dist.gather_object(result, results, dst=0, group=self._group)
        except RuntimeError as error:
            raise _rank_lost(error) from error
        return results or []


def _rank_lost(error: RuntimeError) -> EngineStoppedError:
    """A failed control collective: some rank of the engine is gone (gloo says which
    address closed; the launcher's log says which rank)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # gloo's "[.../pair.cc:561] Connection closed by peer [ADDR]:PORT. This is typically..."
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0][:200]
    return EngineStoppedError(
        f"the engine stopped: a rank of its group is gone ({reason}); retry the request"
    )


def encode_png(image: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # type: ignore[attr-defined]
    return buffer.getvalue()


class Engine:
    """Runs waves until stopped. One instance per rank; only the leader has a queue."""

    def __init__(
        self,
        pipeline: DiffusionPipeline,
        *,
        rank: int,
        world_size: int,
        lockstep: bool,
        queue: RequestQueue | None,
        sequence_parallel_size: int = 1,
        on_intake_closed: Callable[[], None] = lambda: None,
        after_request: Callable[[], None] = lambda: None,
    ) -> None:
        self.pipeline = pipeline
        # A server logs one structured line per request instead of a progress bar per step.
        pipeline.set_progress_bar_config(disable=True)
        self.rank = rank
        self.world_size = world_size
        self.sequence_parallel_size = sequence_parallel_size
        # Ranks are laid out DP-major (dlo_worker.process.topology): an SP group is a run of
        # neighbouring ranks, and a wave has one lane per group.
        self.lanes = world_size // sequence_parallel_size
        self.lane = rank // sequence_parallel_size
        self.reports = rank % sequence_parallel_size == 0
        self.lockstep = lockstep
        self.queue = queue
        self.channel = ControlChannel(world_size)
        self._on_intake_closed = on_intake_closed
        self._after_request = after_request
        self._stop_requested = threading.Event()
        self._intake_lock = threading.Lock()
        self._undo: AdapterChange | None = None
        """The leader's: an adapter some ranks loaded and others could not, unloaded by
        the next wave."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def request_stop(self) -> None:
        """Ask for the drain. Only sets an event, so it is safe in a signal handler: the
        leader's intake watcher closes intake at once (readiness turns 503 ``draining``
        even while a wave runs) and the loop finishes what is queued."""
        self._stop_requested.set()

    def _close_intake_on_stop(self) -> None:
        """The leader's watcher thread: a signal handler must not take the queue's lock."""
        self._stop_requested.wait()
        self._close_intake()

    def _close_intake(self) -> None:
        with self._intake_lock:
            if self.queue is None or not self.queue.accepting:
                return
            self.queue.close()
            self._on_intake_closed()
            logger.info("intake closed, draining", extra={"fields": {"queued": len(self.queue)}})

    def run(self) -> None:
        """Serve until the leader's stop message, then return (the caller disables DLO)."""
        if self.is_leader and self.queue is None:
            raise ValueError("the leader needs a request queue")
        logger.info(
            "engine serving",
            extra={"fields": {"rank": self.rank, "lockstep": self.lockstep}},
        )
        if self.is_leader:
            threading.Thread(
                target=self._close_intake_on_stop, name="dlo-intake-watcher", daemon=True
            ).start()
        waves_run = 0
        taken: list[Submission] = []
        try:
            while True:
                taken, wave = self._next_wave()
                wave = self.channel.broadcast(wave)
                if wave.stop:
                    break
                if wave.empty:
                    continue
                waves_run += 1  # every rank counts the same broadcast waves
                if wave.change is not None:
                    results = self.channel.gather(self._make_change(wave.change))
                    if self.is_leader:
                        self._deliver_change(taken, wave.change, results)
                    continue
                started = time.monotonic()
                result = self._run_lane(wave, waves_run)
                results = self.channel.gather(result)
                if self.is_leader:
                    self._deliver(taken, wave, results, time.monotonic() - started)
        except EngineStoppedError as error:
            if self.is_leader:
                self._fail_everything(taken, error)
            raise
        logger.info("engine drained", extra={"fields": {"rank": self.rank}})

    def _fail_everything(self, taken: list[Submission], error: EngineStoppedError) -> None:
        """Answer the wave's requests and every queued one with ``error`` before the engine
        stops, so no client waits for an answer that will not come."""
        self._close_intake()
        for submission in taken:
            if not submission.future.done():
                submission.fail(error)
        if self.queue is not None:
            self.queue.fail_pending(error)

    def _next_wave(self) -> tuple[list[Submission], Wave | None]:
        if not self.is_leader or self.queue is None:
            return [], None
        if self._undo is not None:
            undo, self._undo = self._undo, None
            return [], Wave(lanes=(None,) * self.lanes, change=undo)
        if self._stop_requested.is_set():
            self._close_intake()
            if len(self.queue) == 0:
                return [], Wave(stop=True)
        return self.queue.take_wave(self.lanes, self.lockstep, HEARTBEAT_S)

    def _make_change(self, change: AdapterChange) -> str | None:
        """Make an adapter change on this rank: None, or why it failed."""
        try:
            change_adapters(self.pipeline, change)
        except LoraSetupError as error:
            return str(error)
        return None

    def _deliver_change(
        self,
        taken: list[Submission],
        change: AdapterChange,
        results: list[list[bytes] | str | None],
    ) -> None:
        """Resolve the change's future: done when every rank made it, else the first
        rank's reason. Ranks read the same file and fail alike; should some load it and
        others not (memory), the next wave unloads it everywhere, so no rank keeps an
        adapter the others lack."""
        failures = [result for result in results if isinstance(result, str)]
        if failures and change.path is not None and len(failures) < len(results):
            self._undo = AdapterChange(change.name, None)
        for submission in taken:  # none for an undo
            if failures:
                submission.future.set_exception(AdapterChangeError(failures[0]))
            else:
                submission.future.set_result([])

    def _run_lane(self, wave: Wave, number: int) -> list[bytes] | str | None:
        """This rank's images as PNG bytes, an error message, or None when idle, discarded
        or not its SP group's reporting rank."""
        request = wave.lanes[self.lane]
        if request is None:
            return None
        discarded = self.lane in wave.discarded
        started = time.monotonic()
        try:
            generated = generate_images(self.pipeline, request)
            encoding = time.perf_counter()
            pngs = [encode_png(image) for image in generated.images]
            png_seconds = time.perf_counter() - encoding
        except Exception as error:  # a failed request must not take the engine down
            logger.exception("request failed", extra={"fields": {"rank": self.rank}})
            return f"{type(error).__name__}: {error}"
        metrics.REQUEST_STAGE_SECONDS.labels(stage="png").observe(png_seconds)
        record_device_peak()
        self._after_request()
        fields: dict[str, object] = {
            "rank": self.rank,
            "lane": self.lane,
            "wave": number,
            "steps": request.steps,
            "width": request.width,
            "height": request.height,
            "num_images": request.num_images,
            "seed": request.seed,
            "discarded": discarded,
            "seconds": round(time.monotonic() - started, 3),
            **stage_fields({**generated.stage_seconds, "png": png_seconds}),
        }
        if request.loras is not None:  # name:scale of each adapter, "-" for none
            choices = (f"{choice.name}:{choice.scale:g}" for choice in request.loras)
            fields["loras"] = ",".join(choices) or "-"
        logger.info("request done", extra={"fields": fields})
        return None if discarded or not self.reports else pngs

    def _deliver(
        self,
        taken: list[Submission],
        wave: Wave,
        results: list[list[bytes] | str | None],
        seconds: float,
    ) -> None:
        metrics.WAVE_SECONDS.observe(seconds)
        metrics.WAVE_OCCUPANCY.observe(len(taken) / max(len(wave.lanes), 1))
        for lane, submission in enumerate(taken):
            result = results[lane * self.sequence_parallel_size]
            if isinstance(result, list):
                submission.future.set_result(result)
                metrics.REQUESTS.labels(outcome="ok").inc()
            else:
                submission.future.set_exception(GenerationFailedError(str(result)))
                metrics.REQUESTS.labels(outcome="failed").inc()
            metrics.REQUEST_SECONDS.observe(time.monotonic() - submission.enqueued_at)
