"""Why a worker Pod cannot run, read off its status, and how long a failing engine waits
before its next restart (pure: no I/O).

A start-up failure (a model directory that is not a pipeline, a read-only cache root),
an image that cannot be pulled, a Secret that is missing or a Pod no node can take was
visible only in Pod events and in the logs of Pods deleted seconds later, while the
deployment looked Healthy and its engine restarted every few seconds. The worker writes
its one-line error to ``/dev/termination-log`` (and the container falls back to its last
log lines), so the terminated state carries the cause; the waiting state and the Pod's
``PodScheduled`` condition carry the others; where the scheduler finds no node with room
for a request the operator derived, the message says which field sets it
(:func:`unschedulable_problem`). A volume that cannot be mounted (a
missing model directory, a PVC that does not bind) leaves the Pod ``ContainerCreating``
and is reported only in the Pod's ``FailedMount`` Events: a Pod stuck creating longer
than :data:`MOUNT_REPORT_AFTER_S` has its Events read (:func:`mount_problem`). Restarts
of an engine that keeps failing back off exponentially, as a kubelet's CrashLoopBackOff
does, and the backoff resets once the engine has served for :data:`BACKOFF_RESET_S`.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlo_operator.render.pod_spec import (
    GPU_RESOURCE,
    RANK_CPUS,
    WORKER_BUSY_THREADS,
    WORKER_PACK_THREADS,
)

IMAGE_PULL_REASONS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"}
)
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError"})
MAX_MESSAGE_CHARACTERS = 400
CREATING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})
MOUNT_EVENT_REASONS = frozenset({"FailedMount", "FailedAttachVolume", "FailedMapVolume"})
MOUNT_REPORT_AFTER_S = 20.0
"""A Pod still creating its containers this long after it was scheduled has its Events
read: the kubelet retries a failed mount, so a first failure may clear by itself."""

REQUEST_FIELDS = {
    "cpu": (
        f"resources.cpuPerRank or resources.cpu (by default {RANK_CPUS} per rank, or where "
        f"ranks pack their blocks offload.staging.packThreads, else {WORKER_PACK_THREADS}, "
        f"+ {WORKER_BUSY_THREADS})"
    ),
    "memory": (
        "resources.memoryPerRank or resources.memory (the default adds the pinned budget "
        "and shmSize)"
    ),
    "ephemeral-storage": "resources.ephemeralStorage",
    GPU_RESOURCE: "gpusPerNode",
}
"""The spec fields that set each request of a worker Pod, named where no node has room."""
INSUFFICIENT = re.compile(r"Insufficient ([a-z0-9./-]+?)[,.]?(?=\s|$)")
"""The scheduler's ``<n> Insufficient <resource>`` in a ``PodScheduled`` message."""

BACKOFF_BASE_S = 10.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_S = 600.0
"""A kubelet's CrashLoopBackOff: 10 s, doubling, at most 5 minutes, reset after 10 minutes
of running."""


@dataclass(frozen=True)
class PodProblem:
    """Why a Pod does not run: a short ``reason`` (the Degraded condition's) and what the
    cluster or the worker said."""

    reason: str
    """``ImagePullFailed``, ``ConfigError``, ``Unschedulable``, ``VolumeMountFailed`` or
    ``Exited`` (a container ended with a non-zero exit: reconcile calls it
    ``StartupFailed`` or ``EngineFailed``)."""
    message: str


def pod_problem(
    status: Mapping[str, Any], requests: Mapping[str, str] | None = None
) -> PodProblem | None:
    """The first reason this Pod status shows for not running, if any; ``requests`` are
    the worker container's, named where the scheduler found no room for them."""
    containers = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for container in containers:
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        name = container.get("name", "")
        if waiting.get("reason") in IMAGE_PULL_REASONS:
            return PodProblem("ImagePullFailed", _said(name, waiting["reason"], waiting))
        if waiting.get("reason") in CONFIG_REASONS:
            return PodProblem("ConfigError", _said(name, waiting["reason"], waiting))
        terminated = state.get("terminated") or {}
        if terminated.get("exitCode", 0) != 0:
            code = terminated["exitCode"]
            return PodProblem("Exited", _said(name, f"exited {code}", terminated))
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            return unschedulable_problem(condition.get("message") or "", requests or {})
    return None


def unschedulable_problem(message: str, requests: Mapping[str, str]) -> PodProblem:
    """The scheduler's message, then, for each request it found no room for, the Pod's
    request and the fields that set it: the scheduler names only the resource, and the
    operator derives the CPU and memory requests (the CPU one from the pack threads)."""
    hints = [
        f"the Pod requests {resource} {requests[resource]}: set {REQUEST_FIELDS[resource]}"
        for resource in dict.fromkeys(INSUFFICIENT.findall(message))
        if resource in REQUEST_FIELDS and resource in requests
    ]
    said = message.strip() or "unschedulable"
    if not hints:
        return PodProblem("Unschedulable", _cut(said))
    hint = "; ".join(hints)
    room = max(MAX_MESSAGE_CHARACTERS - len(hint) - 2, 40)
    return PodProblem("Unschedulable", f"{_cut(said.rstrip('.'), room)}; {hint}")


def creating_since(status: Mapping[str, Any]) -> datetime.datetime | None:
    """When the Pod was scheduled, if its containers are still being created (volumes
    mounting, images pulling) and nothing else explains the wait."""
    scheduled = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("status") == "True"
        ),
        None,
    )
    containers = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    waiting = [((c.get("state") or {}).get("waiting") or {}).get("reason") for c in containers]
    if scheduled is None or not any(reason in CREATING_REASONS for reason in waiting):
        return None
    return parse_time(scheduled.get("lastTransitionTime"))


def mount_problem(events: list[Mapping[str, Any]]) -> PodProblem | None:
    """The latest volume failure among one Pod's Events, if any."""
    failures = [e for e in events if e.get("reason") in MOUNT_EVENT_REASONS]
    if not failures:
        return None
    latest = max(failures, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return PodProblem("VolumeMountFailed", _cut(f"{latest['reason']}: {latest.get('message', '')}"))


def _said(container: str, what: str, state: Mapping[str, Any]) -> str:
    """``container <name> <what>: <its message's last line>``."""
    lines = [line.strip() for line in (state.get("message") or "").splitlines() if line.strip()]
    detail = lines[-1] if lines else state.get("reason") or ""
    return _cut(
        f"container {container} {what}: {detail}" if detail else f"container {container} {what}"
    )


def _cut(text: str, limit: int = MAX_MESSAGE_CHARACTERS) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


def restart_delay_s(consecutive_restarts: int) -> float:
    """How long a failed engine waits before restart number ``consecutive_restarts + 1``
    of a row: none for the first, then 10 s doubling up to 5 minutes."""
    if consecutive_restarts <= 0:
        return 0.0
    return min(BACKOFF_BASE_S * 2 ** (consecutive_restarts - 1), BACKOFF_MAX_S)


def parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
