"""Fold the events that arrive during a reconcile pass into one pass after it.

Creating a deployment's children makes its Pods and Services emit a burst of watch events
(ADDED, scheduled, running, ready), each of which asks for a pass. Passes over one
deployment must not overlap (two would both see an engine missing and create it), and
running one per event would repeat the same reads a dozen times for nothing: a pass reads
the current state, so one pass after the burst sees everything the burst changed.

:class:`Coalescer` keeps, per key, whether a pass runs and whether another was asked for
meanwhile. A caller that finds a pass running records the request and returns at once;
the running caller repeats its pass until no request arrived during the last one. This is
the workqueue rule of Kubernetes controllers (a key is queued at most once, and a key
changed while being processed is processed again), without the queue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass
class _KeyState:
    running: bool = False
    again: bool = False


class Coalescer:
    """Per-key mutual exclusion that folds concurrent requests into one repeat."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._states: dict[Hashable, _KeyState] = {}

    def run(self, key: Hashable, work: Callable[[], T]) -> T | None:
        """Run ``work`` for ``key``, again while requests arrived during it; returns its
        last result, or None when a pass was already running (it will repeat for us)."""
        with self._guard:
            state = self._states.setdefault(key, _KeyState())
            if state.running:
                state.again = True
                return None
            state.running = True
        try:
            while True:
                result = work()
                with self._guard:
                    if not state.again:
                        state.running = False
                        return result
                    state.again = False
        except BaseException:
            with self._guard:
                # A failed pass ends the run; a request that came during it is not lost:
                # the next event or the timer starts a fresh run.
                state.running = False
                state.again = False
            raise

    def running(self, key: Hashable) -> bool:
        """Whether a pass over ``key`` is running now."""
        with self._guard:
            state = self._states.get(key)
            return state is not None and state.running

    def forget(self, key: Hashable) -> None:
        """Drop the state of a deleted object (keys otherwise live as long as the process)."""
        with self._guard:
            state = self._states.get(key)
            if state is not None and not state.running:
                del self._states[key]
