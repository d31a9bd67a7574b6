"""What this operator is doing to Pods that its watch has not shown yet (client-go's
ReplicaSet "expectations").

Passes read a deployment's Pods from the watch-fed index, not from a LIST, so a pass
that runs right after another may read an index that does not show that pass's own
creations and deletions yet. Reconcile must not take a Pod it just created for a lost
rank (that restarts the engine), nor a Pod it just deleted for a live one (that deletes
it again and counts the restart twice). So each creation and deletion is recorded
*before* its API call (the watch event can arrive before the call returns) and dropped
again if the call fails; a watch event of that Pod ends it (the index is updated before
the event handlers run, so from then on the index shows it), and passes read the index
with these overlaid. Pods are matched by name: reconcile creates a name again only once
the index no longer shows the old Pod of that name. An expectation also lapses after
:data:`EXPECTATION_TIMEOUT_S` and :meth:`PodExpectations.lapsed` then makes the timer
run a pass, so a lost event (or a call that got no answer) costs that long, never a
stuck deployment.

Pure bookkeeping under one lock; the clock is an argument so tests need not sleep.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from dlo_operator.reconcile import ObservedPod

EXPECTATION_TIMEOUT_S = 60.0

Key = tuple[str, str]
"""(namespace, deployment name)."""


@dataclass(frozen=True)
class _Created:
    pod: ObservedPod
    at: float


class PodExpectations:
    """Creations and deletions per deployment, until the watch shows them."""

    def __init__(self, timeout_s: float = EXPECTATION_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._created: dict[Key, dict[str, _Created]] = {}
        self._deleted: dict[Key, dict[str, float]] = {}

    def creating(self, key: Key, pod: ObservedPod, now: float) -> None:
        """``pod`` (as rendered) is about to be created for the deployment ``key``.
        Reconcile creates a name only once the index no longer shows the old Pod of that
        name, so an expectation of that old Pod's deletion is over too."""
        with self._lock:
            self._created.setdefault(key, {})[pod.name] = _Created(pod, now)
            self._deleted.get(key, {}).pop(pod.name, None)

    def deleting(self, key: Key, name: str, now: float) -> None:
        """Pod ``name`` is about to be deleted."""
        with self._lock:
            self._deleted.setdefault(key, {})[name] = now

    def failed(self, key: Key, name: str) -> None:
        """The API server refused to create or delete Pod ``name``: no watch event will
        end its expectation."""
        with self._lock:
            self._created.get(key, {}).pop(name, None)
            self._deleted.get(key, {}).pop(name, None)

    def observed(self, key: Key, event_type: str | None, pod: ObservedPod) -> None:
        """A watch event of ``pod``: the index now shows it as it is."""
        with self._lock:
            self._created.get(key, {}).pop(pod.name, None)
            if event_type == "DELETED" or pod.terminating:
                self._deleted.get(key, {}).pop(pod.name, None)

    def overlay(self, key: Key, indexed: list[ObservedPod], now: float) -> list[ObservedPod]:
        """The Pods a pass should see: the index's, plus Pods created but not shown yet,
        with Pods deleted but still shown live marked terminating."""
        with self._lock:
            created = self._expire(self._created, key, now, lambda item: item.at)
            deleted = self._expire(self._deleted, key, now, lambda at: at)
            pods = [
                dataclasses.replace(pod, terminating=True)
                if pod.name in deleted and not pod.terminating
                else pod
                for pod in indexed
            ]
            shown = {pod.name for pod in indexed}
            pods += [item.pod for name, item in created.items() if name not in shown]
            return pods

    def lapsed(self, key: Key, now: float) -> bool:
        """Whether an expectation of ``key`` has run out with no event to end it: the pass
        that drops it is due (it may create or delete what the expectation held back)."""
        with self._lock:
            return any(
                now - at >= self._timeout_s
                for at in [
                    *(item.at for item in self._created.get(key, {}).values()),
                    *self._deleted.get(key, {}).values(),
                ]
            )

    def forget(self, key: Key) -> None:
        """The deployment is gone."""
        with self._lock:
            self._created.pop(key, None)
            self._deleted.pop(key, None)

    def _expire(self, table: dict, key: Key, now: float, since) -> dict:
        entries = table.get(key, {})
        for name in [
            name for name, value in entries.items() if now - since(value) >= self._timeout_s
        ]:
            del entries[name]
        if not entries:
            table.pop(key, None)
        return dict(entries)
