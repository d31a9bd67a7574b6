"""The API server refuses what the operator applies, and the user can read why: a
ResourceQuota with room for only part of the GPUs, a ValidatingAdmissionPolicy that
refuses worker Pods, and a Service ClusterIP range that is full. Each shows as the
``ReplicaFailure`` condition with the API server's own message and one Warning Event,
and the deployment recovers by itself once the cause is gone."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kubernetes import client, config

from dlo_operator.api import GROUP, PLURAL, VERSION
from tests.cluster.helpers import create, events, eventually, manifest, running_operator
from tests.harness.control_plane import ClusterState, down, restart, up


def _status(api_client, namespace: str, name: str) -> dict:
    body = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )
    return body.get("status") or {}


def replica_failure(api_client, namespace: str, name: str) -> dict | None:
    conditions = _status(api_client, namespace, name).get("conditions", [])
    return next((c for c in conditions if c["type"] == "ReplicaFailure"), None)


def refused(api_client, namespace: str, name: str, fragment: str) -> dict | None:
    condition = replica_failure(api_client, namespace, name)
    if condition and condition["status"] == "True" and fragment in condition["message"]:
        return condition
    return None


def cleared(api_client, namespace: str, name: str) -> bool:
    condition = replica_failure(api_client, namespace, name)
    return bool(condition) and condition["status"] == "False"


def worker_pods(api_client, namespace: str) -> list[str]:
    return sorted(
        pod.metadata.name
        for pod in client.CoreV1Api(api_client).list_namespaced_pod(namespace).items
        if not pod.metadata.deletion_timestamp
    )


@pytest.fixture
def operator(cluster, crd, namespace, tmp_path: Path) -> Iterator[Path]:
    log = tmp_path / "operator.log"
    with running_operator(cluster.kubeconfig, log):
        yield log


def assert_one_line_per_refusal(log: Path, fragment: str) -> None:
    """Every log line that carries the refusal is one structured record (``ts=...``), never
    a line of a traceback (the operator's log is shared with other tests' leftovers, so
    tracebacks about those are not this test's business)."""
    lines = [line for line in log.read_text().splitlines() if fragment in line]
    assert any("the API server refused to" in line for line in lines), lines
    assert all(line.startswith("ts=") for line in lines), lines


def test_a_gpu_quota_with_room_for_one_engine_is_reported_and_recovers(
    api_client, operator: Path, namespace: str
) -> None:
    core = client.CoreV1Api(api_client)
    quota = client.V1ResourceQuota(
        metadata=client.V1ObjectMeta(name="gpus"),
        spec=client.V1ResourceQuotaSpec(hard={"requests.nvidia.com/gpu": "2"}),
    )
    core.create_namespaced_resource_quota(namespace, quota)
    eventually(
        lambda: core.read_namespaced_resource_quota("gpus", namespace).status.hard,
        60,
        "the quota's status",
    )
    # Two engines of one Pod with two GPUs each: the quota admits one of them.
    create(api_client, namespace, manifest("flux", replicas=2))
    condition = eventually(
        lambda: refused(api_client, namespace, "flux", "exceeded quota"), 60, "ReplicaFailure"
    )
    assert condition["reason"] == "FailedCreate"
    assert condition["message"].startswith("cannot create Pod flux-e")
    assert len(worker_pods(api_client, namespace)) == 1
    time.sleep(25)  # two timer periods of refusals: still one Event for this transition
    assert events(api_client, namespace, "flux").count("FailedCreate") == 1
    assert_one_line_per_refusal(operator, "exceeded quota")

    core.patch_namespaced_resource_quota(
        "gpus", namespace, {"spec": {"hard": {"requests.nvidia.com/gpu": "4"}}}
    )
    eventually(lambda: len(worker_pods(api_client, namespace)) == 2, 90, "the second engine")
    eventually(lambda: cleared(api_client, namespace, "flux"), 60, "ReplicaFailure False")


@contextmanager
def admission_policy(
    api_client, namespace: str, rule: dict, expression: str, message: str
) -> Iterator[None]:
    """A ValidatingAdmissionPolicy that denies what ``rule`` matches in ``namespace`` unless
    ``expression`` holds, in force for the ``with`` block."""
    admission = client.AdmissionregistrationV1Api(api_client)
    name = f"policy-{uuid.uuid4().hex[:6]}"
    admission.create_validating_admission_policy(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [rule]},
                "validations": [{"expression": expression, "message": message}],
            },
        }
    )
    admission.create_validating_admission_policy_binding(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        }
    )
    try:
        time.sleep(2)  # the API server loads new policies within a second
        yield
    finally:
        admission.delete_validating_admission_policy_binding(name)
        admission.delete_validating_admission_policy(name)


def test_worker_pods_refused_by_an_admission_policy_are_reported_and_recover(
    api_client, operator: Path, namespace: str
) -> None:
    pods = {
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "operations": ["CREATE"],
        "resources": ["pods"],
    }
    with admission_policy(
        api_client,
        namespace,
        pods,
        "!has(object.metadata.labels) || !('dlo.dev/deployment' in object.metadata.labels)",
        "worker Pods need an approved node pool here",
    ):
        create(api_client, namespace, manifest("flux"))
        condition = eventually(
            lambda: refused(api_client, namespace, "flux", "need an approved node pool"),
            60,
            "ReplicaFailure from the policy",
        )
        assert "ValidatingAdmissionPolicy" in condition["message"]
        assert worker_pods(api_client, namespace) == []
        assert events(api_client, namespace, "flux").count("FailedCreate") == 1
        assert_one_line_per_refusal(operator, "need an approved node pool")
    eventually(lambda: worker_pods(api_client, namespace) == ["flux-e0-n0"], 90, "the Pod")
    eventually(lambda: cleared(api_client, namespace, "flux"), 60, "ReplicaFailure False")


def test_a_deployment_whose_create_handler_never_runs_is_reconciled_by_the_timer(
    api_client, operator: Path, namespace: str
) -> None:
    """kopf runs the create handler only after its own patch of the new resource (its
    finalizer) went through; when that patch fails for good (here a policy refuses it,
    as an API server that restarts under it did in CI) and no later event of the
    resource comes, the handler never runs. The timer then runs the first pass itself.
    The status subresource, which a pass writes, is not refused."""
    resource = {
        "apiGroups": [GROUP],
        "apiVersions": ["*"],
        "operations": ["UPDATE"],
        "resources": [PLURAL],
    }
    with admission_policy(
        api_client, namespace, resource, "false", "changes to deployments are frozen here"
    ):
        create(api_client, namespace, manifest("flux"))
        eventually(lambda: worker_pods(api_client, namespace) == ["flux-e0-n0"], 60, "the Pod")
        status = eventually(lambda: _status(api_client, namespace, "flux") or None, 30, "a status")
        assert status["observedGeneration"] == 1
        body = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "flux"
        )
        assert not body["metadata"].get("finalizers")  # kopf's own patch never went through


def _private_control_plane(directory: Path, **options: str) -> Iterator[ClusterState]:
    """A control plane of one fake node for one module, stopped after it."""
    state = up(directory, nodes=1, build=False, owned=True, progress=lambda _line: None, **options)
    try:
        yield state
    finally:
        down(directory, progress=lambda _line: None)


def _with_crd_and_namespace(state: ClusterState, namespace: str) -> client.ApiClient:
    """A client of ``state`` whose cluster has the CRD and ``namespace``."""
    from dlo_operator.crd import custom_resource_definition

    api_client = config.new_client_from_config(config_file=state.kubeconfig)
    client.ApiextensionsV1Api(api_client).create_custom_resource_definition(
        custom_resource_definition()
    )
    client.CoreV1Api(api_client).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
    )
    return api_client


@pytest.fixture(scope="module")
def small_service_range(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    """A control plane whose Service range holds 14 ClusterIPs (the kubernetes Service
    takes one)."""
    yield from _private_control_plane(
        tmp_path_factory.mktemp("small-service-range"), service_cidr="10.0.0.0/28"
    )


def test_a_full_service_range_holds_the_pods_back_and_says_so(
    small_service_range: ClusterState, tmp_path: Path
) -> None:
    namespace = "full"
    api_client = _with_crd_and_namespace(small_service_range, namespace)
    core = client.CoreV1Api(api_client)

    def filler(index: int) -> client.V1Service:
        return client.V1Service(
            metadata=client.V1ObjectMeta(name=f"filler-{index}"),
            spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)]),
        )

    for index in range(13):  # 14 addresses, the kubernetes Service holds one
        core.create_namespaced_service(namespace, filler(index))
    with pytest.raises(client.ApiException, match="range is full"):
        core.create_namespaced_service(namespace, filler(13))
    log = tmp_path / "operator.log"
    with running_operator(small_service_range.kubeconfig, log):
        create(api_client, namespace, manifest("flux", gpusPerNode=1, parallelism={"data": 1}))
        condition = eventually(
            lambda: refused(api_client, namespace, "flux", "range is full"), 90, "ReplicaFailure"
        )
        assert condition["reason"] == "FailedApply"
        assert condition["message"].startswith("cannot apply Service flux:")
        assert condition["message"].endswith("Pods are not created until their Services exist")
        assert worker_pods(api_client, namespace) == []
        assert_one_line_per_refusal(log, "range is full")

        core.delete_namespaced_service("filler-0", namespace)
        eventually(lambda: worker_pods(api_client, namespace) == ["flux-e0-n0"], 90, "the Pod")
        eventually(lambda: cleared(api_client, namespace, "flux"), 60, "ReplicaFailure False")


@pytest.fixture(scope="module")
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    """A control plane of its own: its API server is restarted."""
    yield from _private_control_plane(tmp_path_factory.mktemp("restartable"))


def test_an_api_server_restart_while_reconciling_duplicates_nothing(
    restartable: ClusterState, tmp_path: Path
) -> None:
    namespace = "restart"
    api_client = _with_crd_and_namespace(restartable, namespace)
    engines = 4  # one Pod of two GPUs each: the node's 8 GPUs
    with running_operator(restartable.kubeconfig, tmp_path / "operator.log"):
        create(api_client, namespace, manifest("flux", replicas=engines))
        # At once: the operator's first passes are creating the engines meanwhile.
        restart(restartable, "kube-apiserver", down_s=3)

        def settled() -> dict | None:
            status = _status(api_client, namespace, "flux")
            return status if status.get("readyReplicas") == engines else None

        status = eventually(settled, 120, "every engine Ready after the restart")
    assert worker_pods(api_client, namespace) == [f"flux-e{e}-n0" for e in range(engines)]
    assert [engine["restarts"] for engine in status["engines"]] == [0] * engines
    body = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "flux"
    )
    assert status["observedGeneration"] == body["metadata"]["generation"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Available"] == "True"
    assert events(api_client, namespace, "flux").count("EngineCreated") <= engines
