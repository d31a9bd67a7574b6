"""Desired vs observed -> actions and status (pure; the kopf handlers only apply the result).

Engines are the unit of every action, as in LeaderWorkerSet: a collective cannot
survive a lost rank, so a failed or missing Pod restarts its whole engine, a spec
change replaces engines one at a time (only while every other engine is ready),
and scaling adds or removes whole engines, highest index first. Pods are deleted
ranks > 0 before rank 0 so the leader outlives its workers.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dlo_operator.api import (
    Condition,
    DiffusionDeploymentSpec,
    DiffusionDeploymentStatus,
    EngineStatus,
)
from dlo_operator.render import (
    ANNOTATION_SPEC_HASH,
    LABEL_ENGINE,
    LABEL_NODE_RANK,
    Owner,
    pod_name,
    pods_per_engine,
    render_client_service,
    render_engine,
    selector,
    spec_hash,
)
from dlo_operator.workerconfig import InvalidSpecError, validate


class EnginePhase(StrEnum):
    PENDING = "Pending"
    """Some Pods are missing or not Ready yet."""
    READY = "Ready"
    FAILED = "Failed"
    """A Pod failed or vanished: the engine is being restarted."""
    UPDATING = "Updating"
    """Its Pods run an older spec and are being replaced."""


@dataclass(frozen=True)
class ObservedPod:
    """What reconcile needs to know about one child Pod."""

    name: str
    engine: int
    node_rank: int
    spec_hash: str
    phase: str
    ready: bool
    terminating: bool

    @classmethod
    def from_manifest(cls, pod: Mapping[str, Any]) -> ObservedPod:
        metadata, status = pod["metadata"], pod.get("status") or {}
        labels, annotations = metadata.get("labels", {}), metadata.get("annotations") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        return cls(
            name=metadata["name"],
            engine=int(labels[LABEL_ENGINE]),
            node_rank=int(labels[LABEL_NODE_RANK]),
            spec_hash=annotations.get(ANNOTATION_SPEC_HASH, ""),
            phase=status.get("phase", "Pending"),
            ready=conditions.get("Ready") == "True",
            terminating=bool(metadata.get("deletionTimestamp")),
        )


@dataclass(frozen=True)
class Event:
    reason: str
    message: str
    warning: bool = False


@dataclass
class Actions:
    """What to do now; the next reconcile (triggered by the changes) continues from there."""

    create: list[dict[str, Any]] = field(default_factory=list)
    """Objects to create (an existing one is left as it is)."""
    delete_pods: list[str] = field(default_factory=list)
    """Pod names in deletion order."""
    status: DiffusionDeploymentStatus = field(default_factory=DiffusionDeploymentStatus)
    events: list[Event] = field(default_factory=list)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(
    previous: Mapping[str, Condition],
    kind: str,
    *,
    true: bool,
    reason: str,
    message: str,
    generation: int,
) -> Condition:
    """A condition whose transition time only moves when its status changes."""
    status = "True" if true else "False"
    earlier = previous.get(kind)
    changed = earlier is None or earlier.status != status
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=_now() if changed else earlier.last_transition_time,
        observed_generation=generation,
    )


def deletion_order(pods: Iterable[ObservedPod]) -> list[str]:
    """Ranks > 0 first, rank 0 (the leader) last; engines highest first."""
    ordered = sorted(pods, key=lambda pod: (-pod.engine, pod.node_rank == 0, -pod.node_rank))
    return [pod.name for pod in ordered if not pod.terminating]


def _engine_phase(pods: list[ObservedPod], expected: int, current_hash: str) -> EnginePhase:
    """Judged on the Pods not already being deleted."""
    live = [pod for pod in pods if not pod.terminating]
    if not live:
        return EnginePhase.PENDING
    if any(pod.phase in ("Failed", "Succeeded") for pod in live) or _lost_a_rank(live, expected):
        return EnginePhase.FAILED
    if any(pod.spec_hash != current_hash for pod in live):
        return EnginePhase.UPDATING
    if len(live) == expected and all(pod.ready for pod in live):
        return EnginePhase.READY
    return EnginePhase.PENDING


def _lost_a_rank(live: list[ObservedPod], expected: int) -> bool:
    """Some ranks are gone while others already run: the world cannot complete.

    A half-created engine (no rank started yet) is only Pending.
    """
    return len(live) < expected and any(pod.phase == "Running" for pod in live)


def reconcile(
    owner: Owner,
    spec: DiffusionDeploymentSpec,
    generation: int,
    pods: Iterable[ObservedPod],
    previous: DiffusionDeploymentStatus,
) -> Actions:
    """The actions that move the children towards ``spec``, and the status to report."""
    actions = Actions()
    prior_conditions = {c.type: c for c in previous.conditions}
    prior_restarts = {engine.index: engine.restarts for engine in previous.engines}
    pods = list(pods)
    base_status = {"selector": selector(owner), "observed_generation": generation}

    try:
        validate(spec)
    except InvalidSpecError as error:
        actions.events.append(Event("InvalidSpec", str(error), warning=True))
        actions.status = DiffusionDeploymentStatus(
            **base_status,
            conditions=[
                _condition(
                    prior_conditions,
                    "InvalidSpec",
                    true=True,
                    reason="WorkerConfigRejected",
                    message=str(error),
                    generation=generation,
                ),
                _condition(
                    prior_conditions,
                    "Available",
                    true=False,
                    reason="InvalidSpec",
                    message="the spec cannot run; see InvalidSpec",
                    generation=generation,
                ),
            ],
        )
        return actions

    expected = pods_per_engine(spec)
    current_hash = spec_hash(spec)
    by_engine: dict[int, list[ObservedPod]] = {}
    for pod in pods:
        by_engine.setdefault(pod.engine, []).append(pod)

    # Scale down: whole engines above the desired count, highest first.
    surplus = [pod for pod in pods if pod.engine >= spec.replicas]
    if surplus:
        actions.delete_pods += deletion_order(surplus)
        engines = sorted({pod.engine for pod in surplus}, reverse=True)
        actions.events.append(Event("ScaledDown", f"removing engines {engines}"))

    phases: dict[int, EnginePhase] = {}
    restarts: dict[int, int] = {}
    for engine in range(spec.replicas):
        engine_pods = by_engine.get(engine, [])
        phase = _engine_phase(engine_pods, expected, current_hash)
        phases[engine] = phase
        restarts[engine] = prior_restarts.get(engine, 0)
        live = [pod for pod in engine_pods if not pod.terminating]
        if phase == EnginePhase.FAILED:
            actions.delete_pods += deletion_order(live)
            restarts[engine] += 1
            actions.events.append(
                Event(
                    "EngineRestart",
                    f"engine {engine} lost a rank; restarting all "
                    f"{expected} Pods (restart {restarts[engine]})",
                    warning=True,
                )
            )
        elif not engine_pods:
            actions.create += render_engine(owner, spec, engine)
            actions.events.append(Event("EngineCreated", f"creating engine {engine}"))
        elif live and len(live) < expected and phase != EnginePhase.UPDATING:
            # Partially created (an earlier reconcile was interrupted): finish it.
            present = {pod.name for pod in engine_pods}
            actions.create += [
                item
                for item in render_engine(owner, spec, engine)
                if item["kind"] != "Pod" or item["metadata"]["name"] not in present
            ]

    # Rolling update: replace one outdated engine, and only while all others are Ready.
    outdated = [e for e, phase in phases.items() if phase == EnginePhase.UPDATING]
    others_ready = all(
        phase == EnginePhase.READY for e, phase in phases.items() if e not in outdated
    )
    if outdated and others_ready and not any(p.terminating for p in pods):
        engine = outdated[0]
        actions.delete_pods += deletion_order(by_engine[engine])
        actions.events.append(Event("EngineUpdate", f"replacing engine {engine} with the new spec"))
    actions.create.append(render_client_service(owner, spec))

    ready = sum(phase == EnginePhase.READY for phase in phases.values())
    progressing = ready < spec.replicas or bool(outdated) or bool(surplus)
    degraded = any(phase == EnginePhase.FAILED for phase in phases.values())
    actions.status = DiffusionDeploymentStatus(
        **base_status,
        replicas=spec.replicas,
        ready_replicas=ready,
        engines=[
            EngineStatus(
                index=engine,
                phase=phases[engine],
                pods=[pod_name(owner, engine, node) for node in range(expected)],
                restarts=restarts[engine],
            )
            for engine in range(spec.replicas)
        ],
        conditions=[
            _condition(
                prior_conditions,
                "Available",
                true=ready >= spec.replicas,
                reason="AllEnginesReady" if ready >= spec.replicas else "EnginesNotReady",
                message=f"{ready}/{spec.replicas} engines ready",
                generation=generation,
            ),
            _condition(
                prior_conditions,
                "Progressing",
                true=progressing,
                reason="Reconciling" if progressing else "Stable",
                message=f"{len(outdated)} engine(s) to update",
                generation=generation,
            ),
            _condition(
                prior_conditions,
                "Degraded",
                true=degraded,
                reason="EngineRestarting" if degraded else "Healthy",
                message="an engine lost a rank" if degraded else "",
                generation=generation,
            ),
            _condition(
                prior_conditions,
                "InvalidSpec",
                true=False,
                reason="Valid",
                message="",
                generation=generation,
            ),
        ],
    )
    return actions
