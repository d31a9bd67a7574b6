"""Reconcile as a pure function: engines are created, restarted, rolled and scaled as units."""

from __future__ import annotations

import dataclasses
from typing import Any

from dlo_operator.api import DiffusionDeploymentSpec, DiffusionDeploymentStatus
from dlo_operator.reconcile import (
    ApplyFailure,
    EnginePhase,
    ObservedChild,
    ObservedPod,
    reconcile,
    report_apply_failures,
)
from dlo_operator.render import Owner, render_children, render_engine_pods, spec_hash
from tests.support.deployments import deployment_spec

OWNER = Owner(name="flux", namespace="serving", uid="1234")


def spec(**overrides: Any) -> DiffusionDeploymentSpec:
    """Two engines of two Pods each."""
    return deployment_spec(**{"parallelism": {"data": 4}, "replicas": 2, **overrides})


def running(
    desired: DiffusionDeploymentSpec,
    engines: range | list[int],
    *,
    ready: bool = True,
    phase: str = "Running",
    hash_of: DiffusionDeploymentSpec | None = None,
    terminating: bool = False,
) -> list[ObservedPod]:
    """Observed Pods as the API server would report them for the rendered engines."""
    pods = []
    for engine in engines:
        for item in render_engine_pods(OWNER, hash_of or desired, engine):
            item["status"] = {
                "phase": phase,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            }
            if terminating:
                item["metadata"]["deletionTimestamp"] = "2026-11-29T00:00:00Z"
            pods.append(ObservedPod.from_manifest(item))
    return pods


def conditions(status: DiffusionDeploymentStatus) -> dict[str, str]:
    return {c.type: c.status for c in status.conditions}


def pod_names(objects: list[dict]) -> list[str]:
    return [o["metadata"]["name"] for o in objects if o["kind"] == "Pod"]


def test_a_new_deployment_creates_every_engine() -> None:
    actions = reconcile(OWNER, spec(), 1, [], DiffusionDeploymentStatus())
    created = pod_names(actions.create_pods)
    assert created == ["flux-e0-n0", "flux-e0-n1", "flux-e1-n0", "flux-e1-n1"]
    children = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in actions.apply_children)
    assert children == [
        "NetworkPolicy/flux-e0",
        "NetworkPolicy/flux-e1",
        "PodDisruptionBudget/flux",
        "Service/flux",
        "Service/flux-e0",
        "Service/flux-e1",
    ]
    assert actions.delete_pods == []
    assert actions.status.replicas == 2
    assert actions.status.ready_replicas == 0
    assert conditions(actions.status)["Available"] == "False"
    assert conditions(actions.status)["Progressing"] == "True"
    assert actions.status.selector == "dlo.dev/deployment=flux"


def test_a_ready_deployment_is_available_and_left_alone() -> None:
    desired = spec()
    actions = reconcile(OWNER, desired, 3, running(desired, range(2)), DiffusionDeploymentStatus())
    assert pod_names(actions.create_pods) == []
    assert actions.delete_pods == []
    assert actions.status.ready_replicas == 2
    assert conditions(actions.status) == {
        "Available": "True",
        "Progressing": "False",
        "Degraded": "False",
        "UpdateInProgress": "False",
        "InvalidSpec": "False",
    }
    assert actions.events == []
    assert [e.phase for e in actions.status.engines] == [EnginePhase.READY, EnginePhase.READY]
    assert actions.status.observed_generation == 3


def test_a_failed_pod_restarts_its_whole_engine_leader_first() -> None:
    desired = spec()
    pods = running(desired, [0])
    failed = running(desired, [1])
    failed[1] = dataclasses.replace(failed[1], phase="Failed", ready=False)
    actions = reconcile(OWNER, desired, 1, pods + failed, DiffusionDeploymentStatus())
    # The leader first: it drives the drain and stops the other ranks.
    assert actions.delete_pods == ["flux-e1-n0", "flux-e1-n1"]
    assert actions.status.engines[1].restarts == 1
    assert actions.status.engines[0].restarts == 0
    assert conditions(actions.status)["Degraded"] == "True"
    assert any(event.reason == "EngineRestart" and event.warning for event in actions.events)


def test_a_deleted_pod_restarts_its_engine() -> None:
    desired = spec()
    pods = running(desired, range(2))
    survivors = [pod for pod in pods if pod.name != "flux-e0-n1"]
    actions = reconcile(OWNER, desired, 1, survivors, DiffusionDeploymentStatus())
    assert actions.delete_pods == ["flux-e0-n0"]
    assert actions.status.engines[0].restarts == 1


def test_a_restarting_engine_is_counted_once_and_recreated_when_gone() -> None:
    desired = spec(replicas=1)
    created = reconcile(OWNER, desired, 1, [], DiffusionDeploymentStatus()).status
    previous = created.model_copy(
        update={"engines": [created.engines[0].model_copy(update={"restarts": 1})]}
    )
    terminating = running(desired, [0], terminating=True, phase="Failed")
    waiting = reconcile(OWNER, desired, 1, terminating, previous)
    assert waiting.delete_pods == []
    assert pod_names(waiting.create_pods) == []
    assert waiting.status.engines[0].restarts == 1
    recreated = reconcile(OWNER, desired, 1, [], waiting.status)
    assert pod_names(recreated.create_pods) == ["flux-e0-n0", "flux-e0-n1"]
    assert recreated.status.engines[0].restarts == 1


def test_a_spec_change_rolls_one_engine_at_a_time() -> None:
    old, new = spec(), spec(shmSize="8Gi")
    assert spec_hash(old) != spec_hash(new)
    first = reconcile(
        OWNER, new, 2, running(new, range(2), hash_of=old), DiffusionDeploymentStatus()
    )
    assert first.delete_pods == ["flux-e0-n0", "flux-e0-n1"]
    # Engine 0 is being replaced: engine 1 waits even though it is outdated too.
    replacing = running(new, [0], terminating=True, hash_of=old) + running(new, [1], hash_of=old)
    second = reconcile(OWNER, new, 2, replacing, first.status)
    assert second.delete_pods == []
    # Engine 0 is back on the new spec and ready: now engine 1.
    third = reconcile(
        OWNER, new, 2, running(new, [0]) + running(new, [1], hash_of=old), second.status
    )
    assert third.delete_pods == ["flux-e1-n0", "flux-e1-n1"]


def test_scaling_down_removes_the_highest_engines_leaders_first() -> None:
    desired = spec(replicas=1)
    actions = reconcile(OWNER, desired, 1, running(desired, range(3)), DiffusionDeploymentStatus())
    assert actions.delete_pods == ["flux-e2-n0", "flux-e2-n1", "flux-e1-n0", "flux-e1-n1"]
    assert actions.status.replicas == 1


def test_scaling_up_creates_only_the_new_engines() -> None:
    desired = spec(replicas=3)
    actions = reconcile(OWNER, desired, 1, running(desired, range(2)), DiffusionDeploymentStatus())
    assert pod_names(actions.create_pods) == ["flux-e2-n0", "flux-e2-n1"]


def test_an_interrupted_creation_is_completed() -> None:
    desired = spec(replicas=1)
    partial = running(desired, [0], phase="Pending", ready=False)[:1]
    actions = reconcile(OWNER, desired, 1, partial, DiffusionDeploymentStatus())
    assert pod_names(actions.create_pods) == ["flux-e0-n1"]
    assert actions.delete_pods == []


def test_an_invalid_spec_creates_nothing_and_says_why() -> None:
    invalid = spec(parallelism={"data": 2, "sequence": 2, "hsdp": {"enabled": True}})
    actions = reconcile(OWNER, invalid, 4, [], DiffusionDeploymentStatus())
    assert actions.create_pods == []
    assert actions.delete_pods == []
    by_type = {c.type: c for c in actions.status.conditions}
    assert by_type["InvalidSpec"].status == "True"
    assert "parallelism.hsdp.enabled" in by_type["InvalidSpec"].message
    assert "--" not in by_type["InvalidSpec"].message
    assert by_type["InvalidSpec"].observed_generation == 4
    assert actions.events[0].warning


def test_transition_time_moves_only_when_a_condition_changes() -> None:
    desired = spec()
    first = reconcile(OWNER, desired, 1, running(desired, range(2)), DiffusionDeploymentStatus())
    stamped = first.status.model_copy(
        update={
            "conditions": [
                c.model_copy(update={"last_transition_time": "2000-01-01T00:00:00Z"})
                for c in first.status.conditions
            ]
        }
    )
    again = reconcile(OWNER, desired, 1, running(desired, range(2)), stamped)
    assert {c.last_transition_time for c in again.status.conditions} == {"2000-01-01T00:00:00Z"}
    broken = reconcile(OWNER, desired, 1, running(desired, [0]), stamped)
    times = {c.type: c.last_transition_time for c in broken.status.conditions}
    assert times["Progressing"] != "2000-01-01T00:00:00Z"
    # Available holds (one of two engines may be down) though its message changed.
    assert times["Available"] == "2000-01-01T00:00:00Z"


def observed_children(desired: DiffusionDeploymentSpec) -> list[ObservedChild]:
    return [
        ObservedChild.from_manifest(item["kind"], item) for item in render_children(OWNER, desired)
    ]


def test_children_in_place_are_left_alone_and_changed_ones_patched() -> None:
    desired = spec()
    pods = running(desired, range(2))
    steady = reconcile(
        OWNER, desired, 1, pods, DiffusionDeploymentStatus(), children=observed_children(desired)
    )
    assert steady.apply_children == []
    assert steady.delete_children == []
    stricter = spec(disruptionBudget={"maxUnavailableEngines": 0})
    patched = reconcile(
        OWNER, stricter, 2, pods, steady.status, children=observed_children(desired)
    )
    assert [(o["kind"], o["spec"]["minAvailable"]) for o in patched.apply_children] == [
        ("PodDisruptionBudget", 4)
    ]


def test_children_no_longer_rendered_are_deleted() -> None:
    """Scaled-down engines, a disabled NetworkPolicy, and an older release's per-engine
    budgets (which blocked every drain)."""
    before = spec(replicas=3)
    legacy = [ObservedChild("PodDisruptionBudget", f"flux-e{e}", "") for e in range(3)]
    after = spec(replicas=2, networkPolicy={"enabled": False})
    actions = reconcile(
        OWNER,
        after,
        2,
        running(after, range(2)),
        DiffusionDeploymentStatus(),
        children=observed_children(before) + legacy,
    )
    assert actions.delete_children == [
        ("NetworkPolicy", "flux-e0"),
        ("NetworkPolicy", "flux-e1"),
        ("NetworkPolicy", "flux-e2"),
        ("PodDisruptionBudget", "flux-e0"),
        ("PodDisruptionBudget", "flux-e1"),
        ("PodDisruptionBudget", "flux-e2"),
        ("Service", "flux-e2"),
    ]


def test_an_evicted_pod_restarts_its_engine_whole() -> None:
    desired = spec()
    survivors = [p for p in running(desired, range(2)) if p.name != "flux-e1-n0"]
    actions = reconcile(OWNER, desired, 1, survivors, DiffusionDeploymentStatus())
    assert actions.delete_pods == ["flux-e1-n1"]
    gone = [p for p in survivors if p.engine == 0]
    recreated = reconcile(OWNER, desired, 1, gone, actions.status)
    assert pod_names(recreated.create_pods) == ["flux-e1-n0", "flux-e1-n1"]


def test_a_steady_invalid_spec_reports_one_event() -> None:
    invalid = spec(parallelism={"data": 2, "sequence": 2, "hsdp": {"enabled": True}})
    first = reconcile(OWNER, invalid, 4, [], DiffusionDeploymentStatus())
    assert [e.reason for e in first.events] == ["InvalidSpec"]
    again = reconcile(OWNER, invalid, 4, [], first.status)
    assert again.events == []
    other = spec(quantization="int8")
    changed = reconcile(OWNER, other, 5, [], again.status)
    assert [e.reason for e in changed.events] == ["InvalidSpec"]


def test_events_name_the_pods_they_report() -> None:
    """The handlers post an Event only if one of its subjects was actually changed."""
    desired = spec()
    created = reconcile(OWNER, desired, 1, [], DiffusionDeploymentStatus())
    assert [(e.reason, e.subjects) for e in created.events] == [
        ("EngineCreated", ("flux-e0-n0", "flux-e0-n1")),
        ("EngineCreated", ("flux-e1-n0", "flux-e1-n1")),
    ]
    shrunk = spec(replicas=1)
    leaving = running(shrunk, [0]) + running(shrunk, [1], terminating=True)
    assert reconcile(OWNER, shrunk, 2, leaving, created.status).events == []


def test_a_roll_reports_update_in_progress_until_every_engine_is_ready_again() -> None:
    old, new = spec(), spec(shmSize="8Gi")
    stable = reconcile(OWNER, old, 1, running(old, range(2)), DiffusionDeploymentStatus())
    started = reconcile(OWNER, new, 2, running(new, range(2), hash_of=old), stable.status)
    assert conditions(started.status)["UpdateInProgress"] == "True"
    assert started.status.updated_replicas == 0
    assert [e.reason for e in started.events] == ["EngineUpdate", "RollingUpdate"]
    # The last outdated engine is gone but not back yet: still rolling, no new Event.
    last = running(new, [0]) + running(new, [1], ready=False, phase="Pending")
    waiting = reconcile(OWNER, new, 2, last, started.status)
    assert conditions(waiting.status)["UpdateInProgress"] == "True"
    assert waiting.status.updated_replicas == 2
    assert waiting.events == []
    done = reconcile(OWNER, new, 2, running(new, range(2)), waiting.status)
    assert conditions(done.status)["UpdateInProgress"] == "False"
    assert [e.reason for e in done.events] == ["RollingUpdateComplete"]
    assert reconcile(OWNER, new, 2, running(new, range(2)), done.status).events == []


def test_a_refused_action_is_a_condition_with_the_api_servers_message_and_one_event() -> None:
    desired = spec()
    actions = reconcile(OWNER, desired, 1, [], DiffusionDeploymentStatus())
    quota = ApplyFailure(
        "create", "Pod", "flux-e1-n0", 'pods "flux-e1-n0" is forbidden: exceeded quota: gpus'
    )
    status, events = report_apply_failures(actions.status, DiffusionDeploymentStatus(), [quota], 1)
    (failure,) = [c for c in status.conditions if c.type == "ReplicaFailure"]
    assert (failure.status, failure.reason) == ("True", "FailedCreate")
    assert failure.message == f"cannot create Pod flux-e1-n0: {quota.message}"
    assert [(e.reason, e.warning) for e in events] == [("FailedCreate", True)]
    # The same refusal on the next pass: same condition, no second Event.
    again, events = report_apply_failures(actions.status, status, [quota], 1)
    assert events == []
    assert [c for c in again.conditions if c.type == "ReplicaFailure"] == [failure]
    # Everything applied: the condition turns False, still without an Event.
    cleared, events = report_apply_failures(actions.status, again, [], 1)
    (failure,) = [c for c in cleared.conditions if c.type == "ReplicaFailure"]
    assert (failure.status, failure.reason, events) == ("False", "Applied", [])


def test_pods_held_back_for_a_refused_service_are_named_in_the_message() -> None:
    full = ApplyFailure("apply", "Service", "flux", "failed to allocate a serviceIP: range is full")
    status, _ = report_apply_failures(
        DiffusionDeploymentStatus(),
        DiffusionDeploymentStatus(),
        [full, full],
        1,
        pods_held_back=True,
    )
    (failure,) = status.conditions
    assert failure.reason == "FailedApply"
    assert failure.message == (
        "cannot apply Service flux: failed to allocate a serviceIP: range is full "
        "(and 1 more refused); Pods are not created until their Services exist"
    )


def test_the_timer_runs_a_pass_only_when_one_is_due() -> None:
    from dlo_operator.controller import RESYNC_S, TIMER_INTERVAL_S, LastPass, pass_due

    recent = LastPass(at=100.0, refused=False)
    steady = {"first_tick": 90.0, "running": False, "warming": False, "lapsed": False}
    # The create or resume handler runs the first pass; the timer's first tick adds none.
    first = {**steady, "first_tick": 100.0}
    assert not pass_due(None, 100.0, **{**first, "warming": True, "lapsed": True})
    # A whole interval without a pass: that handler never ran, the timer runs it.
    assert pass_due(None, 100.0 + TIMER_INTERVAL_S, **first)
    assert not pass_due(None, 100.0 + TIMER_INTERVAL_S, **{**first, "running": True})
    assert not pass_due(recent, 110.0, **steady)  # events keep it current
    assert pass_due(recent, 100.0 + RESYNC_S, **steady)  # the resync
    assert pass_due(LastPass(at=100.0, refused=True), 110.0, **steady)  # the retry
    assert pass_due(recent, 110.0, **{**steady, "warming": True})  # warm Jobs follow the nodes
    assert pass_due(recent, 110.0, **{**steady, "lapsed": True})  # an event never came
    # Never while a pass runs: its end is recorded and the next tick decides.
    assert not pass_due(LastPass(at=100.0, refused=True), 110.0, **{**steady, "running": True})


def test_engines_serving_the_old_spec_count_as_ready_and_keep_the_deployment_available() -> None:
    """An outdated engine counted as not ready although it served: READY fell to 0 and
    Available to False for every roll, while every request succeeded."""
    old, new = spec(), spec(shmSize="8Gi")
    stable = reconcile(OWNER, old, 1, running(old, range(2)), DiffusionDeploymentStatus())
    started = reconcile(OWNER, new, 2, running(new, range(2), hash_of=old), stable.status)
    assert (started.status.ready_replicas, started.status.updated_replicas) == (2, 0)
    assert conditions(started.status)["Available"] == "True"
    # Engine 0 is replaced; engine 1 still serves the old spec.
    replacing = running(new, [0], terminating=True, hash_of=old) + running(new, [1], hash_of=old)
    during = reconcile(OWNER, new, 2, replacing, started.status)
    assert (during.status.ready_replicas, during.status.updated_replicas) == (1, 0)
    available = next(c for c in during.status.conditions if c.type == "Available")
    assert (available.status, available.reason) == ("True", "MinimumEnginesReady")
    assert available.message == "1/2 engines ready (1 may be down for an update or a restart)"
    # A single engine has nothing to serve while it is replaced: that is the truth.
    one_old, one_new = spec(replicas=1), spec(replicas=1, shmSize="8Gi")
    alone = running(one_new, [0], terminating=True, hash_of=one_old)
    single = reconcile(OWNER, one_new, 2, alone, DiffusionDeploymentStatus())
    assert conditions(single.status)["Available"] == "False"
    # Two of three engines down is not available.
    three = spec(replicas=3)
    down = running(three, [0]) + running(three, [1, 2], ready=False, phase="Pending")
    assert conditions(reconcile(OWNER, three, 1, down, stable.status).status)["Available"] == (
        "False"
    )
