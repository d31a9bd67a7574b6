"""Desired vs observed -> actions and status (pure; the kopf handlers only apply the result).

Engines are the unit of every action, as in LeaderWorkerSet: a collective cannot
survive a lost rank, so a failed, evicted or missing Pod restarts its whole engine,
a spec change replaces engines one at a time (only while every other engine is
ready), and scaling adds or removes whole engines, highest index first. An engine's
leader (rank 0) is deleted first: it drives the drain and stops the other ranks.

:func:`reconcile` is a chain of named steps over one :class:`_Pass`; each step adds
actions and the Events that report them. An Event that reports actions names them
(``subjects``) and is posted only if one of them took effect, so a retried or
concurrent pass never reports the same change twice; an Event that reports a
condition is emitted only when that condition changes.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dlo_operator.api import (
    CacheStatus,
    Condition,
    DiffusionDeploymentSpec,
    DiffusionDeploymentStatus,
    EngineStatus,
)
from dlo_operator.failures import (
    BACKOFF_RESET_S,
    PodProblem,
    creating_since,
    format_time,
    parse_time,
    pod_problem,
    restart_delay_s,
)
from dlo_operator.render import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_SPEC_HASH,
    CONTAINER,
    LABEL_ENGINE,
    LABEL_NODE_RANK,
    Owner,
    pod_name,
    pods_per_engine,
    render_children,
    render_engine_pods,
    selector,
    spec_hash,
    template_hash,
    warm_template,
)
from dlo_operator.warming import (
    ObservedJob,
    ObservedNode,
    cache_status,
    eligible_nodes,
    warm_nodes,
    warming_enabled,
)
from dlo_operator.workerconfig import InvalidSpecError, validate
from dlo_worker.config import WorkerConfig


class EnginePhase(StrEnum):
    PENDING = "Pending"
    """Some Pods are missing or not Ready yet."""
    READY = "Ready"
    FAILED = "Failed"
    """A Pod failed or vanished: the engine is being restarted."""
    BACKING_OFF = "BackingOff"
    """Failed again soon after a restart: it waits before the next one (CrashLoopBackOff)."""
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
    problem: PodProblem | None = None
    """Why it does not run, as its status says (:mod:`dlo_operator.failures`)."""
    creating_since: datetime.datetime | None = None
    """When it was scheduled, while its containers are still being created."""

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
            problem=pod_problem(status, _worker_requests(pod)),
            creating_since=creating_since(status),
        )


def _worker_requests(pod: Mapping[str, Any]) -> dict[str, str]:
    """The worker container's resource requests, as the Pod was created."""
    containers = (pod.get("spec") or {}).get("containers") or []
    worker: Mapping[str, Any] = next((c for c in containers if c.get("name") == CONTAINER), {})
    return dict((worker.get("resources") or {}).get("requests") or {})


@dataclass(frozen=True)
class ObservedChild:
    """A Service, PodDisruptionBudget or NetworkPolicy labelled with the deployment."""

    kind: str
    name: str
    config_hash: str

    @classmethod
    def from_manifest(cls, kind: str, item: Mapping[str, Any]) -> ObservedChild:
        metadata = item["metadata"]
        annotations = metadata.get("annotations") or {}
        return cls(kind, metadata["name"], annotations.get(ANNOTATION_CONFIG_HASH, ""))


@dataclass(frozen=True)
class Event:
    reason: str
    message: str
    warning: bool = False
    subjects: tuple[str, ...] = ()
    """Pods (by name) whose creation or deletion this Event reports; empty for an Event
    that reports a condition. Posted only if one of them actually changed."""


@dataclass
class Actions:
    """What to do now; the next reconcile (triggered by the changes) continues from there."""

    create_pods: list[dict[str, Any]] = field(default_factory=list)
    """Pods to create (one that exists already is left as it is)."""
    delete_pods: list[str] = field(default_factory=list)
    """Pod names in deletion order."""
    apply_children: list[dict[str, Any]] = field(default_factory=list)
    """Other children to create, or to patch to this rendering where they exist."""
    delete_children: list[tuple[str, str]] = field(default_factory=list)
    """(kind, name) of children no longer rendered (scaled-down engines, disabled policies)."""
    status: DiffusionDeploymentStatus = field(default_factory=DiffusionDeploymentStatus)
    events: list[Event] = field(default_factory=list)


@dataclass(frozen=True)
class ApplyFailure:
    """The API server refused one action (a quota, a full Service IP range, an admission
    policy, ...); ``message`` is its own message."""

    verb: str
    kind: str
    name: str
    message: str


REPLICA_FAILURE = "ReplicaFailure"
"""The condition that reports refused actions (the name Deployments use for the same)."""


def report_apply_failures(
    status: DiffusionDeploymentStatus,
    previous: DiffusionDeploymentStatus,
    failures: list[ApplyFailure],
    generation: int,
    *,
    pods_held_back: bool = False,
) -> tuple[DiffusionDeploymentStatus, list[Event]]:
    """``status`` with the :data:`REPLICA_FAILURE` condition for this pass, and the Warning
    Event to post when it became true or its message changed (one per transition)."""
    prior = {condition.type: condition for condition in previous.conditions}
    if failures:
        first = failures[0]
        message = f"cannot {first.verb} {first.kind} {first.name}: {first.message}"
        if len(failures) > 1:
            message += f" (and {len(failures) - 1} more refused)"
        if pods_held_back:
            message += "; Pods are not created until their Services exist"
        reason = "FailedCreate" if first.kind == "Pod" else "FailedApply"
    else:
        message, reason = "", "Applied"
    condition = _condition(
        prior,
        REPLICA_FAILURE,
        true=bool(failures),
        reason=reason,
        message=message,
        generation=generation,
    )
    others = [c for c in status.conditions if c.type != REPLICA_FAILURE]
    events = [Event(reason, message, warning=True)] if became(prior, condition) else []
    return status.model_copy(update={"conditions": [*others, condition]}), events


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
    if earlier is not None and earlier.status == status:
        since = earlier.last_transition_time
    else:
        since = _now()
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def became(previous: Mapping[str, Condition], current: Condition) -> bool:
    """``current`` is True and was not, or says something new: worth one Event."""
    earlier = previous.get(current.type)
    return current.status == "True" and (
        earlier is None or earlier.status != "True" or earlier.message != current.message
    )


def deletion_order(pods: Iterable[ObservedPod]) -> list[str]:
    """Each engine's leader (rank 0) first, then its other Pods; engines highest first.

    The leader drives the drain: on SIGTERM it closes intake, finishes the queued waves,
    then tells every rank to stop. The other ranks ignore their own SIGTERM and wait for
    that message, so an engine whose followers were stopped first would hang until its
    grace period ran out and then be killed mid-collective.
    """
    ordered = sorted(pods, key=lambda pod: (-pod.engine, pod.node_rank))
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


@dataclass
class _Pass:
    """One reconcile pass: the inputs, the engines' phases, and the actions so far."""

    owner: Owner
    spec: DiffusionDeploymentSpec
    config: WorkerConfig
    """The worker configuration the spec validated into, rendered into every command."""
    generation: int
    pods: list[ObservedPod]
    previous: DiffusionDeploymentStatus
    nodes: list[ObservedNode] = field(default_factory=list)
    jobs: list[ObservedJob] = field(default_factory=list)
    actions: Actions = field(default_factory=Actions)
    phases: dict[int, EnginePhase] = field(default_factory=dict)
    restarts: dict[int, int] = field(default_factory=dict)
    now: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))
    consecutive: dict[int, int] = field(default_factory=dict)
    last_restart: dict[int, datetime.datetime | None] = field(default_factory=dict)
    next_restart: dict[int, datetime.datetime] = field(default_factory=dict)
    problems: dict[int, PodProblem] = field(default_factory=dict)

    @functools.cached_property
    def warm_template(self) -> dict[str, Any]:
        """The warm Jobs' Pod template, rendered once per pass."""
        return warm_template(self.spec, self.config)

    @functools.cached_property
    def cache(self) -> CacheStatus | None:
        """Per-node warming of the current identity (None without the runtime cache)."""
        if not warming_enabled(self.spec):
            return None
        return cache_status(self.spec, self.nodes, self.jobs, template_hash(self.warm_template))

    @property
    def prior_conditions(self) -> dict[str, Condition]:
        return {c.type: c for c in self.previous.conditions}

    def engine_pods(self, engine: int) -> list[ObservedPod]:
        return [pod for pod in self.pods if pod.engine == engine]

    def condition(self, kind: str, *, true: bool, reason: str, message: str) -> Condition:
        return _condition(
            self.prior_conditions,
            kind,
            true=true,
            reason=reason,
            message=message,
            generation=self.generation,
        )

    def delete(self, pods: Iterable[ObservedPod], event: Event) -> None:
        names = deletion_order(pods)
        if names:
            self.actions.delete_pods += names
            self.actions.events.append(
                Event(event.reason, event.message, event.warning, tuple(names))
            )


def reconcile(
    owner: Owner,
    spec: DiffusionDeploymentSpec,
    generation: int,
    pods: Iterable[ObservedPod],
    previous: DiffusionDeploymentStatus,
    *,
    children: Iterable[ObservedChild] = (),
    nodes: Iterable[ObservedNode] = (),
    jobs: Iterable[ObservedJob] = (),
    now: datetime.datetime | None = None,
) -> Actions:
    """The actions that move the children towards ``spec``, and the status to report.

    ``nodes`` and ``jobs`` (the warm Jobs) matter only with the runtime cache enabled;
    ``now`` (UTC) times restart backoffs.
    """
    try:
        config = validate(spec)
    except InvalidSpecError as error:
        return _invalid_actions(owner, generation, previous, str(error))
    state = _Pass(
        owner,
        spec,
        config,
        generation,
        list(pods),
        previous,
        nodes=list(nodes),
        jobs=list(jobs),
    )
    if now is not None:
        state.now = now
    _judge_engines(state)
    _scale_down(state)
    _restart_failed_engines(state)
    _create_missing_pods(state)
    _roll_one_engine(state)
    _sync_children(state, list(children))
    _report_status(state)
    return state.actions


def invalid_spec_conditions(
    previous: DiffusionDeploymentStatus, generation: int, message: str
) -> tuple[list[Condition], list[Event]]:
    """InvalidSpec True (and Available False), with an Event only when that is news."""
    prior = {c.type: c for c in previous.conditions}
    invalid = _condition(
        prior,
        "InvalidSpec",
        true=True,
        reason="WorkerConfigRejected",
        message=message,
        generation=generation,
    )
    available = _condition(
        prior,
        "Available",
        true=False,
        reason="InvalidSpec",
        message="the spec cannot run; see InvalidSpec",
        generation=generation,
    )
    events = [Event("InvalidSpec", message, warning=True)] if became(prior, invalid) else []
    return [invalid, available], events


def _invalid_actions(
    owner: Owner, generation: int, previous: DiffusionDeploymentStatus, message: str
) -> Actions:
    """Nothing to create or delete: only the conditions and Events of an invalid spec."""
    conditions, events = invalid_spec_conditions(previous, generation, message)
    status = DiffusionDeploymentStatus(
        selector=selector(owner), observed_generation=generation, conditions=conditions
    )
    return Actions(events=events, status=status)


def _judge_engines(state: _Pass) -> None:
    expected, current_hash = pods_per_engine(state.spec), spec_hash(state.spec)
    prior = {engine.index: engine for engine in state.previous.engines}
    for engine in range(state.spec.replicas):
        pods = state.engine_pods(engine)
        phase = _engine_phase(pods, expected, current_hash)
        earlier = prior.get(engine)
        state.phases[engine] = phase
        state.restarts[engine] = earlier.restarts if earlier else 0
        state.consecutive[engine] = earlier.consecutive_restarts if earlier else 0
        state.last_restart[engine] = parse_time(earlier.last_restart_time) if earlier else None
        last = state.last_restart[engine]
        if phase == EnginePhase.READY and (
            last is None or (state.now - last).total_seconds() >= BACKOFF_RESET_S
        ):
            state.consecutive[engine] = 0  # it served long enough: the next failure is new
        problem = next(
            (
                p.problem
                for p in sorted(pods, key=lambda p: p.node_rank)
                if p.problem and not p.terminating
            ),
            None,
        )
        if problem is not None:
            if problem.reason == "Exited":
                served = earlier is not None and earlier.phase == EnginePhase.READY
                problem = PodProblem("EngineFailed" if served else "StartupFailed", problem.message)
            state.problems[engine] = problem
        elif (
            phase != EnginePhase.READY and state.consecutive[engine] and earlier and earlier.reason
        ):
            # Restarting after a failure: the cause stays reported until the engine serves.
            state.problems[engine] = PodProblem(earlier.reason, earlier.message or "")


def _scale_down(state: _Pass) -> None:
    """Whole engines above the desired count, highest first."""
    surplus = [pod for pod in state.pods if pod.engine >= state.spec.replicas]
    engines = sorted({pod.engine for pod in surplus if not pod.terminating}, reverse=True)
    state.delete(surplus, Event("ScaledDown", f"removing engines {engines}"))


def _restart_failed_engines(state: _Pass) -> None:
    """A failed, evicted or lost rank takes its whole engine down; it is then recreated,
    at once the first time and after a growing delay when it keeps failing (the failed
    Pods stay meanwhile, with their logs). An engine whose Pods run an older spec restarts
    at once: the new spec may be the fix."""
    expected, current_hash = pods_per_engine(state.spec), spec_hash(state.spec)
    for engine, phase in state.phases.items():
        if phase != EnginePhase.FAILED:
            continue
        pods = state.engine_pods(engine)
        if any(pod.spec_hash != current_hash for pod in pods if not pod.terminating):
            state.consecutive[engine] = 0
        last = state.last_restart[engine]
        delay = restart_delay_s(state.consecutive[engine])
        if last is not None and (state.now - last).total_seconds() < delay:
            state.phases[engine] = EnginePhase.BACKING_OFF
            state.next_restart[engine] = last + datetime.timedelta(seconds=delay)
            continue
        restart = state.restarts[engine] + 1
        problem = state.problems.get(engine)
        cause = f"failed ({problem.reason}: {problem.message})" if problem else "lost a rank"
        before = len(state.actions.delete_pods)
        state.delete(
            pods,
            Event(
                "EngineRestart",
                f"engine {engine} {cause}; restarting all {expected} Pods (restart {restart})",
                warning=True,
            ),
        )
        if len(state.actions.delete_pods) > before:
            state.restarts[engine] = restart
            state.consecutive[engine] += 1
            state.last_restart[engine] = state.now


def _create_missing_pods(state: _Pass) -> None:
    """New engines, and engines whose creation was interrupted, get their missing Pods."""
    for engine, phase in state.phases.items():
        if phase in (EnginePhase.FAILED, EnginePhase.BACKING_OFF, EnginePhase.UPDATING):
            continue
        present = {pod.name for pod in state.engine_pods(engine)}
        live = [pod for pod in state.engine_pods(engine) if not pod.terminating]
        if present and not live:
            continue  # the old Pods are still terminating; create once they are gone
        warm = warm_nodes(state.cache)
        missing = [
            pod
            for pod in render_engine_pods(
                state.owner, state.spec, engine, warm, config=state.config
            )
            if pod["metadata"]["name"] not in present
        ]
        if not missing:
            continue
        names = tuple(pod["metadata"]["name"] for pod in missing)
        state.actions.create_pods += missing
        verb = "creating" if not present else "completing"
        state.actions.events.append(Event("EngineCreated", f"{verb} engine {engine}", False, names))


def _roll_one_engine(state: _Pass) -> None:
    """Replace one outdated engine, and only while all others are Ready."""
    outdated = [e for e, phase in state.phases.items() if phase == EnginePhase.UPDATING]
    others_ready = all(
        phase == EnginePhase.READY for e, phase in state.phases.items() if e not in outdated
    )
    if outdated and others_ready and not any(p.terminating for p in state.pods):
        engine = outdated[0]
        state.delete(
            state.engine_pods(engine),
            Event("EngineUpdate", f"replacing engine {engine} with the new spec"),
        )


def _sync_children(state: _Pass, observed: list[ObservedChild]) -> None:
    """Create or patch every rendered child whose hash differs; delete the unrendered."""
    eligible = [node.name for node in eligible_nodes(state.spec, state.nodes)]
    warming = warming_enabled(state.spec)
    desired = render_children(
        state.owner,
        state.spec,
        eligible if warming else (),
        warm_job_template=state.warm_template if warming else None,
    )
    current = {(child.kind, child.name): child.config_hash for child in observed}
    wanted = set()
    for item in desired:
        key = (item["kind"], item["metadata"]["name"])
        wanted.add(key)
        if current.get(key) != item["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]:
            state.actions.apply_children.append(item)
    state.actions.delete_children += sorted(key for key in current if key not in wanted)


def _engine_status(state: _Pass, engine: int, expected: int) -> EngineStatus:
    problem = state.problems.get(engine)
    last, upcoming = state.last_restart[engine], state.next_restart.get(engine)
    return EngineStatus(
        index=engine,
        phase=state.phases[engine],
        pods=[pod_name(state.owner, engine, node) for node in range(expected)],
        restarts=state.restarts[engine],
        consecutive_restarts=state.consecutive[engine],
        last_restart_time=format_time(last) if last else None,
        next_restart_time=format_time(upcoming) if upcoming else None,
        reason=problem.reason if problem else None,
        message=problem.message if problem else None,
    )


def _degradation(state: _Pass) -> tuple[str | None, str]:
    """The Degraded condition's reason and message: the first engine that does not run,
    with what its Pods report, and when a backing-off engine restarts; Events for engines
    whose failure is news (``EngineFailed``, once per reason and message)."""
    prior = {engine.index: engine for engine in state.previous.engines}
    found: tuple[str | None, str] = (None, "")
    for engine, phase in sorted(state.phases.items()):
        problem = state.problems.get(engine)
        failed = phase in (EnginePhase.FAILED, EnginePhase.BACKING_OFF)
        if problem is None and not failed:
            continue
        reason = problem.reason if problem else "EngineRestarting"
        message = f"engine {engine}: {problem.message if problem else 'lost a rank'}"
        if engine in state.next_restart:
            wait = (state.next_restart[engine] - state.now).total_seconds()
            message += f"; restarting in {wait:.0f} s (restart {state.restarts[engine] + 1})"
        earlier = prior.get(engine)
        if problem and (
            earlier is None
            or (earlier.reason, earlier.message) != (problem.reason, problem.message)
        ):
            state.actions.events.append(Event("EngineFailed", message, warning=True))
        if found[0] is None:
            found = (reason, message)
    return found


def _serving(pods: list[ObservedPod], expected: int) -> bool:
    """Every rank of the engine runs and is Ready, on whichever spec: it serves."""
    live = [pod for pod in pods if not pod.terminating]
    return len(live) == expected and all(pod.ready and pod.phase == "Running" for pod in live)


def _report_status(state: _Pass) -> None:
    spec, phases = state.spec, state.phases
    expected = pods_per_engine(spec)
    current_hash = spec_hash(spec)
    # Ready counts the engines that serve, the old spec included (as a Deployment counts
    # ready Pods of every revision); updated counts those on the current spec.
    failed = (EnginePhase.FAILED, EnginePhase.BACKING_OFF)
    ready = sum(
        phase not in failed and _serving(state.engine_pods(engine), expected)
        for engine, phase in phases.items()
    )
    # A roll replaces one engine at a time and drains evict up to the disruption budget's
    # engines: a deployment stays Available while that many are down (one at least).
    down_allowed = max(1, spec.disruption_budget.max_unavailable_engines)
    minimum = max(1, spec.replicas - down_allowed)
    updated = sum(
        1
        for engine in range(spec.replicas)
        if (live := [p for p in state.engine_pods(engine) if not p.terminating])
        and all(pod.spec_hash == current_hash for pod in live)
    )
    outdated = sum(phase == EnginePhase.UPDATING for phase in phases.values())
    surplus = any(pod.engine >= spec.replicas for pod in state.pods)
    on_spec = sum(phase == EnginePhase.READY for phase in phases.values())
    progressing = on_spec < spec.replicas or bool(outdated) or surplus
    degraded_reason, degraded_message = _degradation(state)
    degraded = degraded_reason is not None
    prior = state.prior_conditions
    was_rolling = "UpdateInProgress" in prior and prior["UpdateInProgress"].status == "True"
    # A roll lasts until every engine runs the current spec and is Ready again.
    stale = any(p.spec_hash != current_hash for p in state.pods if p.engine < spec.replicas)
    rolling = stale or (was_rolling and on_spec < spec.replicas)
    if ready >= spec.replicas:
        available_reason, note = "AllEnginesReady", ""
    elif ready >= minimum:
        down = spec.replicas - ready
        available_reason, note = (
            "MinimumEnginesReady",
            f" ({down} may be down for an update or a restart)",
        )
    else:
        available_reason, note = "EnginesNotReady", ""
    conditions = [
        state.condition(
            "Available",
            true=ready >= minimum,
            reason=available_reason,
            message=f"{ready}/{spec.replicas} engines ready{note}",
        ),
        state.condition(
            "Progressing",
            true=progressing,
            reason="Reconciling" if progressing else "Stable",
            message=f"{outdated} engine(s) to update",
        ),
        state.condition(
            "Degraded",
            true=degraded,
            reason=degraded_reason or "Healthy",
            message=degraded_message,
        ),
        state.condition(
            "UpdateInProgress",
            true=rolling,
            reason="RollingUpdate" if rolling else "UpToDate",
            message=f"{updated}/{spec.replicas} engines run the current spec",
        ),
        state.condition("InvalidSpec", true=False, reason="Valid", message=""),
    ]
    if rolling and not was_rolling:
        state.actions.events.append(Event("RollingUpdate", "replacing engines one at a time"))
    elif was_rolling and not rolling:
        state.actions.events.append(
            Event("RollingUpdateComplete", f"all {spec.replicas} engines run the current spec")
        )
    state.actions.status = DiffusionDeploymentStatus(
        selector=selector(state.owner),
        observed_generation=state.generation,
        replicas=spec.replicas,
        ready_replicas=ready,
        updated_replicas=updated,
        engines=[_engine_status(state, engine, expected) for engine in range(spec.replicas)],
        conditions=conditions,
        cache=state.cache,
    )
