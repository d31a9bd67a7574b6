"""Failures in status: what the Pods report reaches the deployment's status, and failing
engines restart with a growing delay (pure: reconcile over observed Pod statuses)."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
from typing import Any

from dlo_operator.api import DiffusionDeploymentStatus
from dlo_operator.failures import (
    creating_since,
    format_time,
    mount_problem,
    pod_problem,
    restart_delay_s,
)
from dlo_operator.reconcile import EnginePhase, ObservedPod, reconcile
from dlo_operator.render import Owner, render_engine_pods
from tests.support.deployments import deployment_spec

OWNER = Owner(name="flux", namespace="serving", uid="1234")
T0 = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC)
NOT_A_PIPELINE = (
    "dlo-worker serve: error: --model /models/flux: not a diffusers pipeline directory "
    "(no model_index.json)\n"
)


def pods(status: dict[str, Any], engines=(0,), **overrides: Any) -> list[ObservedPod]:
    desired = deployment_spec(**{"parallelism": {"data": 2}, "replicas": 1, **overrides})
    observed = []
    for engine in engines:
        for item in render_engine_pods(OWNER, desired, engine):
            item["status"] = status
            observed.append(ObservedPod.from_manifest(item))
    return observed


def exited(message: str = NOT_A_PIPELINE, code: int = 2) -> dict[str, Any]:
    return {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "worker",
                "state": {"terminated": {"exitCode": code, "reason": "Error", "message": message}},
            }
        ],
    }


def waiting(reason: str, message: str) -> dict[str, Any]:
    return {
        "phase": "Pending",
        "containerStatuses": [
            {"name": "worker", "state": {"waiting": {"reason": reason, "message": message}}}
        ],
    }


SPEC = deployment_spec(parallelism={"data": 2}, replicas=1)


def degraded(status: DiffusionDeploymentStatus) -> tuple[str, str, str]:
    condition = next(c for c in status.conditions if c.type == "Degraded")
    return condition.status, condition.reason, condition.message


def test_the_workers_own_message_reaches_the_status_and_one_event() -> None:
    """The cause was only in the logs of Pods deleted seconds later, Degraded stayed False."""
    first = reconcile(OWNER, SPEC, 1, pods(exited()), DiffusionDeploymentStatus(), now=T0)
    message = (
        "engine 0: container worker exited 2: dlo-worker serve: error: --model /models/flux: "
        "not a diffusers pipeline directory (no model_index.json)"
    )
    assert degraded(first.status) == ("True", "StartupFailed", message)
    (engine,) = first.status.engines
    assert (engine.reason, engine.restarts, engine.consecutive_restarts) == ("StartupFailed", 1, 1)
    assert first.delete_pods  # the first failure restarts at once
    assert [e.reason for e in first.events] == ["EngineRestart", "EngineFailed"]
    assert "not a diffusers pipeline directory" in first.events[0].message


def test_an_engine_that_keeps_failing_backs_off_and_says_when_it_restarts() -> None:
    """0 -> 13 restarts in 90 s before: every 3-7 s, with no backoff."""
    status = reconcile(OWNER, SPEC, 1, pods(exited()), DiffusionDeploymentStatus(), now=T0).status
    restarts_at = [T0]
    now = T0
    for _ in range(40):  # a pass every 5 s for 200 s, the engine failing at once each time
        now += datetime.timedelta(seconds=5)
        actions = reconcile(OWNER, SPEC, 1, pods(exited()), status, now=now)
        if actions.delete_pods:
            restarts_at.append(now)
        else:
            (engine,) = actions.status.engines
            assert engine.phase == EnginePhase.BACKING_OFF
            assert engine.next_restart_time is not None
            assert "restarting in" in degraded(actions.status)[2]
            assert not any(e.reason == "EngineFailed" for e in actions.events)  # not news
        status = actions.status
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(restarts_at)]
    assert gaps == [10, 20, 40, 80]
    assert status.engines[0].restarts == 5


def test_the_backoff_resets_once_the_engine_served_for_ten_minutes() -> None:
    first = reconcile(OWNER, SPEC, 1, pods(exited()), DiffusionDeploymentStatus(), now=T0)
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    later = T0 + datetime.timedelta(minutes=11)
    served = reconcile(OWNER, SPEC, 1, pods(ready), first.status, now=later)
    assert served.status.engines[0].consecutive_restarts == 0
    assert degraded(served.status)[0] == "False"
    again = reconcile(OWNER, SPEC, 1, pods(exited()), served.status, now=later)
    assert again.delete_pods  # a fresh failure restarts at once
    assert again.status.engines[0].reason == "EngineFailed"  # it had served


def test_a_new_spec_restarts_a_backing_off_engine_at_once() -> None:
    first = reconcile(OWNER, SPEC, 1, pods(exited()), DiffusionDeploymentStatus(), now=T0)
    soon = T0 + datetime.timedelta(seconds=2)
    waits = reconcile(OWNER, SPEC, 1, pods(exited()), first.status, now=soon)
    assert waits.delete_pods == []
    fixed = deployment_spec(parallelism={"data": 2}, replicas=1, shmSize="8Gi")
    assert reconcile(OWNER, fixed, 2, pods(exited()), waits.status, now=soon).delete_pods


def test_pods_that_cannot_start_are_reported_and_left_to_the_kubelet() -> None:
    cases = {
        "ImagePullFailed": waiting("ErrImageNeverPull", 'image "localhost/dlo:x" is not present'),
        "ConfigError": waiting("CreateContainerConfigError", 'secret "api-key" not found'),
        "Unschedulable": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient memory.",
                }
            ],
        },
    }
    for reason, status in cases.items():
        actions = reconcile(OWNER, SPEC, 1, pods(status), DiffusionDeploymentStatus(), now=T0)
        state, found, message = degraded(actions.status)
        assert (state, found) == ("True", reason), message
        assert message.startswith("engine 0: ")
        assert actions.delete_pods == []  # nothing to restart: the kubelet keeps trying
        assert [e.reason for e in actions.events if e.reason == "EngineFailed"] == ["EngineFailed"]
    assert 'secret "api-key" not found' in pod_problem(cases["ConfigError"]).message


def unschedulable(message: str) -> dict[str, Any]:
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    return {"phase": "Pending", "conditions": [{**condition, "message": message}]}


PREEMPTION = " preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod."


def test_a_request_no_node_has_room_for_is_named_with_the_fields_that_set_it() -> None:
    """A rank that packs its blocks requests its pack threads + 2 CPUs (10 by default), more
    than a small GPU node has; the scheduler says only "Insufficient cpu"."""
    said = "0/3 nodes are available: 3 Insufficient cpu." + PREEMPTION
    packing = pods(unschedulable(said), offload={"useAllGather": False})
    actions = reconcile(OWNER, SPEC, 1, packing, DiffusionDeploymentStatus(), now=T0)
    state, reason, message = degraded(actions.status)
    assert (state, reason) == ("True", "Unschedulable")
    assert message.startswith("engine 0: 0/3 nodes are available: 3 Insufficient cpu.")
    assert message.endswith(
        "; the Pod requests cpu 20: set resources.cpuPerRank or resources.cpu (by default 4 "
        "per rank, or where ranks pack their blocks offload.staging.packThreads, else 8, + 2)"
    )


def test_each_insufficient_request_is_named_and_survives_a_long_scheduler_message() -> None:
    said = (
        "0/40 nodes are available: 12 Insufficient memory, 3 Insufficient nvidia.com/gpu, "
        "2 Insufficient example.com/fpga, 25 node(s) had untolerated taint {gpu: true}."
        + PREEMPTION
        * 6
    )
    requests = {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": "2"}
    problem = pod_problem(unschedulable(said), requests)
    assert problem is not None
    assert problem.reason == "Unschedulable"
    assert problem.message.startswith("0/40 nodes are available: 12 Insufficient memory")
    assert "..." in problem.message  # the scheduler's text is cut, the hints are not
    assert problem.message.endswith(
        "; the Pod requests memory 48Gi: set resources.memoryPerRank or resources.memory (the "
        "default adds the pinned budget and shmSize); the Pod requests nvidia.com/gpu 2: set "
        "gpusPerNode"
    )
    assert "example.com/fpga 2:" not in problem.message  # not a request the spec sets


def test_an_unschedulable_pod_without_a_named_request_keeps_the_schedulers_words() -> None:
    said = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
    problem = pod_problem(unschedulable(said), {"cpu": "4"})
    assert problem is not None
    assert problem.message == said


def test_a_long_log_tail_is_cut_to_its_last_line() -> None:
    tail = "".join(f"line {n}\n" for n in range(80)) + "RuntimeError: boom\n"
    problem = pod_problem(exited(tail, code=1))
    assert problem.message == "container worker exited 1: RuntimeError: boom"


def test_the_delay_doubles_from_ten_seconds_to_five_minutes() -> None:
    assert [restart_delay_s(n) for n in range(8)] == [0, 10, 20, 40, 80, 160, 300, 300]


def creating(scheduled_at: datetime.datetime, init: bool = False) -> dict[str, Any]:
    statuses = [{"name": "worker", "state": {"waiting": {"reason": "ContainerCreating"}}}]
    return {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "True",
                "lastTransitionTime": format_time(scheduled_at),
            }
        ],
        "initContainerStatuses" if init else "containerStatuses": statuses,
    }


def test_a_pod_still_creating_after_it_was_scheduled_is_a_mount_suspect() -> None:
    assert creating_since(creating(T0)) == T0
    assert creating_since(creating(T0, init=True)) == T0
    assert creating_since(waiting("ErrImageNeverPull", "absent")) is None  # not scheduled
    running = {**creating(T0), "containerStatuses": [{"name": "worker", "state": {"running": {}}}]}
    assert creating_since(running) is None


def test_the_latest_volume_failure_among_a_pods_events_is_its_problem() -> None:
    events = [
        {"reason": "Scheduled", "message": "assigned", "lastTimestamp": "2026-12-01T12:00:00Z"},
        {"reason": "FailedMount", "message": "old", "lastTimestamp": "2026-12-01T12:00:05Z"},
        {
            "reason": "FailedMount",
            "message": 'MountVolume.SetUp failed for volume "model": hostPath type check '
            "failed: /models/flux is not a directory",
            "lastTimestamp": "2026-12-01T12:00:40Z",
        },
    ]
    problem = mount_problem(events)
    assert problem is not None
    assert problem.reason == "VolumeMountFailed"
    assert problem.message.startswith("FailedMount: MountVolume.SetUp failed for volume")
    assert mount_problem(events[:1]) is None
    observed = pods(waiting("ContainerCreating", ""))
    stuck = [dataclasses.replace(pod, problem=problem) for pod in observed]
    actions = reconcile(OWNER, SPEC, 1, stuck, DiffusionDeploymentStatus(), now=T0)
    state, reason, message = degraded(actions.status)
    assert (state, reason) == ("True", "VolumeMountFailed")
    assert "/models/flux is not a directory" in message
    assert actions.delete_pods == []  # the kubelet retries the mount
