"""The operator as a process against the real control plane: engines, status, restarts, rolls,
scaling, invalid specs, deletion, evictions and Events.

The operator runs with the arguments the chart's default values render: it watches every
namespace, as installed.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from dlo_operator.api import GROUP, PLURAL, VERSION
from dlo_operator.render import ANNOTATION_CONFIG_HASH, ANNOTATION_SPEC_HASH
from tests.cluster.helpers import (
    create,
    events,
    eventually,
    manifest,
    operator_metrics,
    request_totals,
    running_operator,
)


@pytest.fixture
def operator(cluster, crd, namespace, tmp_path: Path) -> Iterator[list[str]]:
    with running_operator(cluster.kubeconfig, tmp_path / "operator.log") as arguments:
        yield arguments


def _status(api_client, namespace: str, name: str) -> dict:
    body = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )
    return body.get("status") or {}


def _condition(status: dict, kind: str) -> str | None:
    return next((c["status"] for c in status.get("conditions", []) if c["type"] == kind), None)


def _pods(api_client, namespace: str) -> list:
    return [
        p
        for p in client.CoreV1Api(api_client).list_namespaced_pod(namespace).items
        if not p.metadata.deletion_timestamp
    ]


def test_operator_runs_engines_end_to_end(api_client, operator, namespace) -> None:
    create(api_client, namespace, manifest("flux", replicas=2, parallelism={"data": 4}))

    def available(ready: int) -> bool:
        status = _status(api_client, namespace, "flux")
        return _condition(status, "Available") == "True" and status["readyReplicas"] == ready

    eventually(lambda: available(2), 120, "two engines Available")
    pods = sorted(p.metadata.name for p in _pods(api_client, namespace))
    assert pods == ["flux-e0-n0", "flux-e0-n1", "flux-e1-n0", "flux-e1-n1"]
    services = {
        s.metadata.name
        for s in client.CoreV1Api(api_client).list_namespaced_service(namespace).items
    }
    assert services == {"flux", "flux-e0", "flux-e1"}
    budgets = client.PolicyV1Api(api_client).list_namespaced_pod_disruption_budget(namespace)
    assert [b.metadata.name for b in budgets.items] == ["flux"]
    policies = client.NetworkingV1Api(api_client).list_namespaced_network_policy(namespace)
    assert sorted(p.metadata.name for p in policies.items) == ["flux-e0", "flux-e1"]

    # A lost rank restarts its whole engine.
    client.CoreV1Api(api_client).delete_namespaced_pod("flux-e1-n1", namespace)
    eventually(
        lambda: _status(api_client, namespace, "flux")["engines"][1]["restarts"] >= 1,
        120,
        "engine 1 restart counted",
    )
    eventually(lambda: available(2), 120, "Available again after the restart")

    # kubectl scale (the scale subresource) removes a whole engine.
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, "flux", {"spec": {"replicas": 1}}
    )
    eventually(
        lambda: (
            sorted(p.metadata.name for p in _pods(api_client, namespace))
            == ["flux-e0-n0", "flux-e0-n1"]
        ),
        120,
        "engine 1 removed",
    )

    # A spec change replaces the engine's Pods.
    old_hash = _pods(api_client, namespace)[0].metadata.annotations[ANNOTATION_SPEC_HASH]
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "flux", {"spec": {"shmSize": "8Gi"}}
    )

    def rolled() -> bool:
        pods = _pods(api_client, namespace)
        return len(pods) == 2 and all(
            p.metadata.annotations[ANNOTATION_SPEC_HASH] != old_hash for p in pods
        )

    eventually(rolled, 120, "engine rolled to the new spec")
    eventually(lambda: available(1), 120, "Available after the roll")


def test_platform_fields_reach_the_pods_and_the_api_server_honours_them(
    api_client, operator, namespace
) -> None:
    """Priority is resolved from the PriorityClass and the ServiceAccount must exist (the API
    server's admission); its token is still not mounted unless asked for."""
    suffix = namespace[-12:]
    client.SchedulingV1Api(api_client).create_priority_class(
        client.V1PriorityClass(metadata=client.V1ObjectMeta(name=f"dlo-{suffix}"), value=4242)
    )
    core = client.CoreV1Api(api_client)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="inference"))
    )
    try:
        create(
            api_client,
            namespace,
            manifest(
                "platform",
                worker={
                    "image": "dlo-worker:0.1",
                    "imagePullSecrets": [{"name": "registry"}],
                    "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                    "serviceAccountName": "inference",
                },
                scheduling={"priorityClassName": f"dlo-{suffix}"},
                podMetadata={"labels": {"team": "vision"}, "annotations": {"owner": "vision"}},
                serve={"maxQueuedRequests": 8},
            ),
        )
        eventually(lambda: len(_pods(api_client, namespace)) == 1, 120, "the engine's Pod")
        (pod,) = _pods(api_client, namespace)
        assert pod.spec.priority == 4242
        assert pod.spec.service_account_name == "inference"
        assert pod.spec.image_pull_secrets[0].name == "registry"
        assert not any(v.name.startswith("kube-api-access") for v in pod.spec.volumes)
        assert pod.metadata.labels["team"] == "vision"
        assert pod.metadata.annotations["owner"] == "vision"
        assert pod.metadata.annotations["prometheus.io/scrape"] == "true"
        (worker,) = pod.spec.containers
        assert any(e.name == "NCCL_DEBUG" and e.value == "WARN" for e in worker.env)
        assert worker.command[worker.command.index("--max-queued-requests") + 1] == "8"
    finally:
        client.SchedulingV1Api(api_client).delete_priority_class(f"dlo-{suffix}")


def test_invalid_spec_creates_nothing_and_reports_why(api_client, operator, namespace) -> None:
    create(
        api_client,
        namespace,
        manifest(
            "bad", parallelism={"data": 2, "sequence": 2, "hsdp": {"enabled": True}}, gpusPerNode=2
        ),
    )

    def reported() -> bool:
        return _condition(_status(api_client, namespace, "bad"), "InvalidSpec") == "True"

    eventually(reported, 60, "InvalidSpec condition")
    message = next(
        c["message"]
        for c in _status(api_client, namespace, "bad")["conditions"]
        if c["type"] == "InvalidSpec"
    )
    assert "parallelism.hsdp.enabled: true cannot be combined with DLO AllGather" in message
    assert _pods(api_client, namespace) == []


def test_a_cpu_request_no_node_has_room_for_names_the_fields_that_set_it(
    api_client, operator, namespace
) -> None:
    """The real scheduler says only "Insufficient cpu"; the request was derived from the
    pack threads (40 + 2 per rank, 2 ranks), more than the 64 CPUs of the nodes."""
    offload = {"useAllGather": False, "staging": {"packThreads": 40}}
    create(api_client, namespace, manifest("packing", offload=offload))

    def degraded() -> str | None:
        status = _status(api_client, namespace, "packing")
        condition = next((c for c in status.get("conditions", []) if c["type"] == "Degraded"), None)
        if condition is None or condition["reason"] != "Unschedulable":
            return None
        return condition["message"]

    message = eventually(degraded, 120, "Degraded Unschedulable")
    assert "Insufficient cpu" in message
    assert "the Pod requests cpu 84: set resources.cpuPerRank or resources.cpu" in message
    assert "offload.staging.packThreads" in message


def test_a_restarted_operator_adopts_its_pods_and_deletion_removes_every_child(
    api_client, cluster, crd, namespace, tmp_path: Path
) -> None:
    log = tmp_path / "operator.log"
    with running_operator(cluster.kubeconfig, log):
        create(api_client, namespace, manifest("flux", parallelism={"data": 4}))
        eventually(lambda: len(_pods(api_client, namespace)) == 2, 60, "engine created")
        before = {p.metadata.name: p.metadata.uid for p in _pods(api_client, namespace)}
    with running_operator(cluster.kubeconfig, log):
        time.sleep(12)  # longer than the reconcile timer: at least one full sync ran
        after = {p.metadata.name: p.metadata.uid for p in _pods(api_client, namespace)}
        assert after == before
        client.CustomObjectsApi(api_client).delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "flux"
        )
        core = client.CoreV1Api(api_client)

        def all_gone() -> bool:
            pods = core.list_namespaced_pod(namespace).items
            services = core.list_namespaced_service(namespace).items
            budgets = (
                client.PolicyV1Api(api_client)
                .list_namespaced_pod_disruption_budget(namespace)
                .items
            )
            return not pods and not services and not budgets

        eventually(all_gone, 180, "every child removed")
    # Every normal delete logged an ERROR line (and posted it) while its engines drained.
    lines = log.read_text().splitlines()
    assert [line for line in lines if "level=ERROR" in line and "drain" in line] == []


EXAMPLE = Path(__file__).parents[2] / "examples" / "diffusiondeployment.yaml"


def _kubectl(cluster, *args: str) -> str:
    from tests.harness.build import Builder

    result = subprocess.run(
        [str(Builder().bin / "kubectl"), *args],
        env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


def test_the_example_becomes_exactly_the_rendered_objects(
    api_client, cluster, operator, namespace
) -> None:
    from dlo_operator.api import DiffusionDeploymentSpec
    from dlo_operator.render import Owner, render_engine_pods

    _kubectl(cluster, "apply", "-n", namespace, "-f", str(EXAMPLE))
    eventually(
        lambda: _condition(_status(api_client, namespace, "flux"), "Available") == "True",
        120,
        "example Available",
    )
    body = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "flux"
    )
    owner = Owner("flux", namespace, body["metadata"]["uid"])
    spec = DiffusionDeploymentSpec.model_validate(body["spec"])
    expected = {
        item["metadata"]["name"]: item
        for engine in range(spec.replicas)
        for item in render_engine_pods(owner, spec, engine)
    }
    pods = {
        p.metadata.name: api_client.sanitize_for_serialization(p)
        for p in _pods(api_client, namespace)
    }
    assert sorted(pods) == sorted(expected) == ["flux-e0-n0", "flux-e1-n0"]
    for name, pod in pods.items():
        want, got = expected[name]["spec"], pod["spec"]
        (want_container,), got_container = want["containers"], got["containers"][0]
        for field in (
            "command",
            "env",
            "resources",
            "startupProbe",
            "readinessProbe",
            "livenessProbe",
            "image",
            "securityContext",
        ):
            assert _subset(want_container[field], got_container[field]), (name, field)
        assert _subset(
            want["volumes"],
            [v for v in got["volumes"] if not v["name"].startswith("kube-api-access")],
        )
        assert got["terminationGracePeriodSeconds"] == 120
        assert _subset(want["securityContext"], got["securityContext"])
        assert got["automountServiceAccountToken"] is False
        assert not any(v["name"].startswith("kube-api-access") for v in got["volumes"])
        assert pod["metadata"]["ownerReferences"][0]["uid"] == owner.uid
        assert pod["metadata"]["labels"] == expected[name]["metadata"]["labels"]
    table = _kubectl(cluster, "get", "diffusiondeployments", "-n", namespace)
    header, row = table.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "REPLICAS",
        "READY",
        "UP-TO-DATE",
        "AVAILABLE",
        "DEGRADED",
        "CACHE",  # empty: the example does not enable the runtime cache
        "AGE",
    ]
    assert row.split()[:6] == ["flux", "2", "2", "2", "True", "Healthy"]


def _subset(want: object, got: object) -> bool:
    """Everything we rendered is in the live object (the API server only adds defaults)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(
            key in got and _subset(value, got[key]) for key, value in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(want) == len(got)
            and all(_subset(w, g) for w, g in zip(want, got, strict=True))
        )
    return want == got or str(want) == str(got)


def test_a_spec_change_replaces_engines_one_at_a_time(api_client, operator, namespace) -> None:
    create(api_client, namespace, manifest("roll", replicas=3))
    eventually(
        lambda: _status(api_client, namespace, "roll").get("readyReplicas") == 3,
        120,
        "three engines ready",
    )
    old_hashes = {
        p.metadata.annotations[ANNOTATION_SPEC_HASH] for p in _pods(api_client, namespace)
    }
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "roll", {"spec": {"shmSize": "4Gi"}}
    )
    most_engines_down = 0
    statuses = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        statuses.append(_status(api_client, namespace, "roll"))
        pods = _pods(api_client, namespace)
        ready_engines = {
            p.metadata.labels["dlo.dev/engine"]
            for p in pods
            if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        }
        most_engines_down = max(most_engines_down, 3 - len(ready_engines))
        if (
            len(pods) == 3
            and all(p.metadata.annotations[ANNOTATION_SPEC_HASH] not in old_hashes for p in pods)
            and len(ready_engines) == 3
        ):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the roll did not finish")
    assert most_engines_down <= 1
    # Engines serving the old spec count: READY fell to 0 and Available to False for the
    # whole roll while every request succeeded.
    assert min(status.get("readyReplicas", 0) for status in statuses) >= 2
    assert {_condition(status, "Available") for status in statuses} == {"True"}
    # The status follows the Pods by one reconcile: it reports all three updated once the
    # operator has seen the last Pod ready, and keeps Available throughout.
    eventually(
        lambda: _status(api_client, namespace, "roll").get("updatedReplicas") == 3,
        30,
        "the status reports three updated engines",
    )
    assert _condition(_status(api_client, namespace, "roll"), "Available") == "True"


def _evict(api_client, namespace: str, name: str) -> int:
    """The eviction API's answer for one Pod: 201 evicted, 429 refused by the budget."""
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=namespace))
    try:
        client.CoreV1Api(api_client).create_namespaced_pod_eviction(name, namespace, eviction)
    except client.ApiException as error:
        return error.status
    return 201


def test_a_drain_evicts_one_engine_at_a_time_and_never_wedges(
    api_client, operator, namespace
) -> None:
    create(api_client, namespace, manifest("drain", replicas=2, parallelism={"data": 4}))
    policy = client.PolicyV1Api(api_client)

    def budget_allows_one() -> bool:
        try:
            budget = policy.read_namespaced_pod_disruption_budget("drain", namespace)
        except client.ApiException as error:
            if error.status == 404:  # not created yet
                return False
            raise
        return (
            _status(api_client, namespace, "drain").get("readyReplicas") == 2
            and budget.status.observed_generation == budget.metadata.generation
            and budget.status.disruptions_allowed == 1
        )

    eventually(budget_allows_one, 120, "both engines Ready and one disruption allowed")
    before = {p.metadata.name: p.metadata.uid for p in _pods(api_client, namespace)}
    assert _evict(api_client, namespace, "drain-e0-n1") == 201
    # Engine 0 is down (its other rank is stopped by the operator): engine 1 must stay.
    assert _evict(api_client, namespace, "drain-e1-n0") == 429
    assert _evict(api_client, namespace, "drain-e1-n1") == 429

    def engine_zero_restarted_whole() -> bool:
        pods = {p.metadata.name: p.metadata.uid for p in _pods(api_client, namespace)}
        status = _status(api_client, namespace, "drain")
        return (
            all(pods.get(n) not in (None, before[n]) for n in ("drain-e0-n0", "drain-e0-n1"))
            and status.get("readyReplicas") == 2
        )

    eventually(engine_zero_restarted_whole, 120, "engine 0 recreated whole and Ready")
    assert {n: u for n, u in before.items() if n.startswith("drain-e1")} == {
        p.metadata.name: p.metadata.uid
        for p in _pods(api_client, namespace)
        if p.metadata.name.startswith("drain-e1")
    }
    # Not wedged: once engine 0 is back, the next engine may go.
    eventually(budget_allows_one, 120, "one disruption allowed again")
    assert _evict(api_client, namespace, "drain-e1-n0") == 201


def test_events_are_posted_once_per_transition(api_client, operator, namespace) -> None:
    """Over 60 s (six reconcile timer ticks): one InvalidSpec for a steady invalid spec,
    one EngineCreated per engine for a create, nothing repeated."""
    create(
        api_client,
        namespace,
        manifest("bad", parallelism={"data": 2, "sequence": 2, "hsdp": {"enabled": True}}),
    )
    create(api_client, namespace, manifest("good", replicas=2))
    time.sleep(60)
    assert _condition(_status(api_client, namespace, "good"), "Available") == "True"
    assert events(api_client, namespace, "bad") == ["InvalidSpec"]
    assert sorted(events(api_client, namespace, "good")) == ["EngineCreated", "EngineCreated"]


OUR_EVENTS = {
    "EngineCreated",
    "EngineRestart",
    "EngineUpdate",
    "RollingUpdate",
    "RollingUpdateComplete",
    "ScaledDown",
    "InvalidSpec",
}


def test_restarts_and_rolls_post_their_events_once_also_from_queued_passes(
    api_client, operator, namespace
) -> None:
    """A Pod event queues a pass that runs on the operator's own threads, outside kopf's
    handler context: kopf.event() raised LookupError there and the Event was lost (no
    EngineRestart, no RollingUpdateComplete, one EngineUpdate of two)."""
    create(api_client, namespace, manifest("ev", replicas=2, parallelism={"data": 4}))

    def available() -> bool:
        status = _status(api_client, namespace, "ev")
        rolled = status.get("updatedReplicas") == 2
        return _condition(status, "Available") == "True" and status["readyReplicas"] == 2 and rolled

    eventually(available, 120, "two engines Available")
    client.CoreV1Api(api_client).delete_namespaced_pod("ev-e1-n1", namespace)
    eventually(
        lambda: _status(api_client, namespace, "ev")["engines"][1]["restarts"] == 1,
        120,
        "engine 1 restarted",
    )
    eventually(available, 120, "Available after the restart")
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "ev", {"spec": {"shmSize": "8Gi"}}
    )
    eventually(
        lambda: (
            _condition(_status(api_client, namespace, "ev"), "UpdateInProgress") == "False"
            and available()
        ),
        180,
        "the roll finished",
    )
    expected = {
        "EngineCreated": 5,  # two engines, engine 1 after its restart, both after the roll
        "EngineRestart": 1,
        "RollingUpdate": 1,
        "EngineUpdate": 2,
        "RollingUpdateComplete": 1,
    }

    def posted() -> dict[str, int]:
        reasons = [r for r in events(api_client, namespace, "ev") if r in OUR_EVENTS]
        return {reason: reasons.count(reason) for reason in sorted(set(reasons))}

    eventually(lambda: posted() == expected, 30, f"the Events {expected}")

    # The operator's own metrics saw the same work.
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in operator_metrics(operator).splitlines()
        if line.startswith("dlo_operator_")
    }
    assert samples['dlo_operator_events_total{reason="RollingUpdateComplete"}'] >= 1
    assert samples['dlo_operator_reconcile_passes_total{outcome="ok"}'] >= 1
    assert (
        samples["dlo_operator_reconcile_pass_duration_seconds_count"]
        >= samples['dlo_operator_reconcile_passes_total{outcome="ok"}']
    )
    assert "dlo_operator_work_queue_depth" in samples
    time.sleep(15)  # a timer tick or more: nothing is posted twice
    assert posted() == expected


def test_children_no_longer_rendered_are_removed(api_client, operator, namespace) -> None:
    """An older release's per-engine budget is deleted on upgrade, and disabling the
    NetworkPolicy deletes the policies."""
    created = create(api_client, namespace, manifest("prune", parallelism={"data": 4}))
    eventually(
        lambda: _status(api_client, namespace, "prune").get("readyReplicas") == 1,
        120,
        "engine ready",
    )
    policy = client.PolicyV1Api(api_client)
    legacy = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": "prune-e0",
            "labels": {"dlo.dev/deployment": "prune", "dlo.dev/engine": "0"},
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "DiffusionDeployment",
                    "name": "prune",
                    "uid": created["metadata"]["uid"],
                }
            ],
        },
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"dlo.dev/engine": "0"}}},
    }
    policy.create_namespaced_pod_disruption_budget(namespace, legacy)

    def budgets() -> list[str]:
        items = policy.list_namespaced_pod_disruption_budget(namespace).items
        return sorted(b.metadata.name for b in items)

    eventually(lambda: budgets() == ["prune"], 60, "the legacy per-engine budget deleted")
    networking = client.NetworkingV1Api(api_client)
    assert [p.metadata.name for p in networking.list_namespaced_network_policy(namespace).items]
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "prune", {"spec": {"networkPolicy": {"enabled": False}}}
    )
    eventually(
        lambda: not networking.list_namespaced_network_policy(namespace).items,
        60,
        "NetworkPolicies deleted",
    )


def test_a_child_deleted_by_someone_else_is_restored_at_once(
    api_client, operator, namespace
) -> None:
    """The operator watches its Services, budgets and policies: a deleted one comes back
    on its event, long before the resync."""
    create(api_client, namespace, manifest("flux"))
    core = client.CoreV1Api(api_client)
    first = eventually(
        lambda: next(
            (s for s in core.list_namespaced_service(namespace).items if s.metadata.name == "flux"),
            None,
        ),
        60,
        "the client Service",
    )
    time.sleep(2)  # the creation's own passes are over
    core.delete_namespaced_service("flux", namespace)
    started = time.monotonic()

    def restored() -> bool:
        services = {s.metadata.name: s for s in core.list_namespaced_service(namespace).items}
        return "flux" in services and services["flux"].metadata.uid != first.metadata.uid

    eventually(restored, 30, "the client Service restored")
    assert time.monotonic() - started < 8  # a watch event, not the 10 s timer or the resync


def _quiet_control_plane(api_client) -> None:
    """Wait until no namespace of an earlier test is terminating: the namespace controller
    lists every kind in one, and the garbage collector reads owners, which would count as
    the operator's requests in ``apiserver_request_total``."""
    core = client.CoreV1Api(api_client)
    eventually(
        lambda: all(ns.status.phase != "Terminating" for ns in core.list_namespace().items),
        120,
        "earlier tests' namespaces gone",
    )
    time.sleep(2)  # the creation's own passes are over


LISTED_CHILDREN = ("pods", "services", "poddisruptionbudgets", "networkpolicies", "jobs")


def test_passes_read_pods_and_children_from_the_watches_not_from_lists(
    api_client, operator, cluster, namespace
) -> None:
    """Each pass takes a deployment, its Pods and children from the operator's watches:
    three passes (each restoring a deleted Service) list and get nothing, where each used
    to list Pods, Services, budgets, policies and Jobs and get the deployment; and nothing
    a pass just did is mistaken for a lost rank."""
    create(api_client, namespace, manifest("flux"))
    eventually(
        lambda: _condition(_status(api_client, namespace, "flux"), "Available") == "True",
        90,
        "Available",
    )
    core = client.CoreV1Api(api_client)
    _quiet_control_plane(api_client)

    def lists() -> dict[str, float]:
        totals = request_totals(cluster)
        counted = {resource: totals.get(("LIST", resource), 0.0) for resource in LISTED_CHILDREN}
        # A pass used to GET its deployment too; it reads it from the watch now.
        counted["GET diffusiondeployments"] = totals.get(("GET", "diffusiondeployments"), 0.0)
        return counted

    before = lists()
    for _ in range(3):
        uid = core.read_namespaced_service("flux", namespace).metadata.uid
        core.delete_namespaced_service("flux", namespace)

        def restored(uid: str = uid) -> bool:
            try:
                return core.read_namespaced_service("flux", namespace).metadata.uid != uid
            except client.ApiException as error:
                if error.status == 404:
                    return False
                raise

        eventually(restored, 30, "the client Service restored")
    after = lists()
    listed = {resource: after[resource] - before[resource] for resource in before}
    # Each pass used to list all five kinds (15 LISTs here); the control plane's own
    # controllers may list now and then, never once per pass.
    assert sum(listed.values()) < 3, listed
    assert listed["GET diffusiondeployments"] == 0, listed
    status = _status(api_client, namespace, "flux")
    assert _condition(status, "Available") == "True"
    assert status["engines"]
    assert all(engine["restarts"] == 0 for engine in status["engines"])


def test_status_written_to_a_child_by_its_controller_queues_no_pass(
    api_client, operator, namespace
) -> None:
    """A budget's status (the disruption controller writes it as Pods come and go) and a
    label someone adds to a Service change nothing a pass reads: no pass runs. A changed
    configuration hash does, and the pass restores the child."""
    create(api_client, namespace, manifest("flux"))
    eventually(
        lambda: _condition(_status(api_client, namespace, "flux"), "Available") == "True",
        90,
        "Available",
    )
    core, policy = client.CoreV1Api(api_client), client.PolicyV1Api(api_client)
    _quiet_control_plane(api_client)

    def passes() -> float:  # the operator's own count, whatever their outcome
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in operator_metrics(operator).splitlines()
            if line.startswith("dlo_operator_reconcile_passes_total{")
        )

    before = passes()
    policy.patch_namespaced_pod_disruption_budget_status(
        "flux",
        namespace,
        {
            "status": {
                "disruptionsAllowed": 0,
                "currentHealthy": 0,
                "desiredHealthy": 1,
                "expectedPods": 1,
            }
        },
    )
    core.patch_namespaced_service("flux", namespace, {"metadata": {"labels": {"team": "a"}}})
    time.sleep(3)
    assert passes() == before

    rendered = core.read_namespaced_service("flux", namespace).metadata.annotations
    core.patch_namespaced_service(
        "flux", namespace, {"metadata": {"annotations": {ANNOTATION_CONFIG_HASH: "edited"}}}
    )
    eventually(
        lambda: (
            core.read_namespaced_service("flux", namespace).metadata.annotations[
                ANNOTATION_CONFIG_HASH
            ]
            == rendered[ANNOTATION_CONFIG_HASH]
        ),
        8,
        "the edited client Service restored by a pass",
    )
    assert passes() > before
