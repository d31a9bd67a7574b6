"""A work queue of deployment keys, as Kubernetes controllers keep one (client-go's
``workqueue``): watch events only add a key; worker threads take keys and run one
reconcile pass each.

A key waits in the queue at most once, so the burst of events one deployment's children
emit while it waits (a Pod added, scheduled, running, ready) costs one pass, not one per
event; a key added while a worker processes it is queued again when that worker is done,
so no change goes unseen; and no two workers hold the same key at once. The kopf handlers
that feed it are ``async`` and never block the event loop or kopf's thread pool, so a
deployment's events never wait behind another deployment's passes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

logger = logging.getLogger(__name__)


class WorkQueue:
    """Deduplicating FIFO of keys with the dirty/processing rule of client-go."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._queue: deque[Hashable] = deque()
        self._dirty: set[Hashable] = set()
        self._processing: set[Hashable] = set()
        self._shutting_down = False

    def add(self, key: Hashable) -> None:
        with self._changed:
            if key in self._dirty or self._shutting_down:
                return
            self._dirty.add(key)
            if key in self._processing:
                return  # queued again by done()
            self._queue.append(key)
            self._changed.notify()

    def get(self, timeout: float | None = None) -> Hashable | None:
        """The next key (now being processed), or None on shutdown or timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not self._queue and not self._shutting_down:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._changed.wait(remaining)
            if self._shutting_down:
                return None
            key = self._queue.popleft()
            self._processing.add(key)
            self._dirty.discard(key)
            return key

    def done(self, key: Hashable) -> None:
        with self._changed:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._changed.notify()

    def __len__(self) -> int:
        with self._changed:
            return len(self._queue)

    def shut_down(self) -> None:
        with self._changed:
            self._shutting_down = True
            self._changed.notify_all()


RETRY_S = 2.0
"""A failed pass (the API server unreachable or throttling) is queued again after this."""


def start_workers(
    queue: WorkQueue, work: Callable[[Hashable], object], count: int, name: str
) -> list[threading.Thread]:
    """``count`` daemon threads that process keys until the queue shuts down; a failing
    pass is logged in one line and its key queued again after :data:`RETRY_S`."""

    def loop() -> None:
        while True:
            key = queue.get()
            if key is None:
                return
            try:
                work(key)
            except Exception as error:  # one line, not a traceback per failing pass
                logger.warning("reconcile pass of %s failed, retrying: %s", key, error)
                retry = threading.Timer(RETRY_S, queue.add, args=(key,))
                retry.daemon = True
                retry.start()
            finally:
                queue.done(key)

    threads = [
        threading.Thread(target=loop, name=f"{name}-{index}", daemon=True) for index in range(count)
    ]
    for thread in threads:
        thread.start()
    return threads
