"""End to end on real nodes: the chart installs the operator image as a Pod, a user
``kubectl apply``s a CPU DiffusionDeployment of the demo model, and requests go through
its client Service while the operator restarts, rolls and deletes engines.

The deployment has two engines of two Pods each (DP=2 with AllGather over gloo, one rank
per Pod, the Pods of an engine on different nodes). The tests run in file order on one
deployment, as a user's day would: it becomes Available, serves, loses a Pod, rolls to a
new spec and is deleted.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO

import pytest
import requests
import yaml
from kubernetes import client, config, watch
from urllib3.exceptions import ProtocolError

from dlo_operator.api import GROUP, PLURAL, VERSION
from dlo_operator.render import LABEL_DEPLOYMENT, LABEL_ROLE
from tests.cluster.helpers import CHART, cluster_tool, eventually
from tests.harness.control_plane import ClusterState
from tests.harness.images import ImageBuilder
from tests.support.generate import DEMO_REQUEST, HostReference
from tests.support.serving import digest as digest_bytes

NAMESPACE, NAME, RELEASE = "e2e", "demo", "dlo"
ENGINES, PODS_PER_ENGINE = 2, 2
GRACE_S = 60
WORKER_SELECTOR = f"{LABEL_DEPLOYMENT}={NAME},{LABEL_ROLE}"


@dataclass
class Deployment:
    """The applied DiffusionDeployment and what the tests need to reach it."""

    kubeconfig: str
    api: client.ApiClient
    manifest: Path
    home: Path
    expected_png: bytes
    events: list[str] = field(default_factory=list)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return cluster_tool(self.kubeconfig, "kubectl", *args, home=self.home)

    def resource(self) -> dict:
        return client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, NAME
        )

    def condition(self, kind: str) -> dict | None:
        conditions = (self.resource().get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == kind), None)

    def pods(self) -> list[client.V1Pod]:
        return self.core.list_namespaced_pod(NAMESPACE, label_selector=WORKER_SELECTOR).items

    def service_url(self) -> str:
        service = self.core.read_namespaced_service(NAME, NAMESPACE)
        return f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"

    def generate(self) -> requests.Response:
        return requests.post(f"{self.service_url()}/v1/generate", json=DEMO_REQUEST, timeout=120)


def ready(pod: client.V1Pod) -> bool:
    return pod.metadata.deletion_timestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []
    )


def uids(pods: dict[str, client.V1Pod]) -> dict[str, str]:
    return {name: pod.metadata.uid for name, pod in pods.items()}


def engine_of(pod: client.V1Pod) -> str:
    return pod.metadata.name.rsplit("-", 1)[0]


def serving(deployment: Deployment) -> dict[str, client.V1Pod] | None:
    """Every Pod of every engine, by name, once all are Ready and the resource is Available."""
    pods = {pod.metadata.name: pod for pod in deployment.pods()}
    available = deployment.condition("Available")
    if len(pods) != ENGINES * PODS_PER_ENGINE or not all(map(ready, pods.values())):
        return None
    return pods if available and available["status"] == "True" else None


@pytest.fixture(scope="module")
def operator_release(real_cluster: ClusterState, tmp_path_factory) -> Path:
    """``helm install`` of the chart with the operator image built from its Dockerfile."""
    home = tmp_path_factory.mktemp("helm")
    repository, tag = ImageBuilder().reference("operator").rsplit(":", 1)
    installed = cluster_tool(
        real_cluster.kubeconfig,
        "helm",
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        "dlo-system",
        "--create-namespace",
        "--set",
        f"image.repository={repository}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.pullPolicy=Never",
        "--wait",
        "--timeout",
        "180s",
        home=home,
    )
    assert installed.returncode == 0, installed.stderr
    return home


@pytest.fixture(scope="module")
def deployment(
    real_cluster: ClusterState,
    operator_release: Path,
    tmp_path_factory,
    host: HostReference,
) -> Iterator[Deployment]:
    models = tmp_path_factory.mktemp("models")
    created = subprocess.run(
        ["dlo-worker", "demo-model", str(models / "demo")], capture_output=True, check=False
    )
    assert created.returncode == 0, created.stderr
    manifest = models / "demo.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "DiffusionDeployment",
                "metadata": {"name": NAME, "namespace": NAMESPACE},
                "spec": {
                    "replicas": ENGINES,
                    "accelerator": "none",
                    "model": {"hostPath": str(models / "demo")},
                    "worker": {
                        "image": ImageBuilder().reference("worker"),
                        "imagePullPolicy": "Never",
                    },
                    "gpusPerNode": 1,
                    "parallelism": {"data": PODS_PER_ENGINE},
                    "offload": {"enabled": True, "useAllGather": True},
                    "resources": {
                        "cpuPerRank": "100m",
                        "memoryPerRank": "2Gi",
                        "ephemeralStorage": "1Gi",
                    },
                    "shmSize": "256Mi",
                    "logLevel": "info",
                    "terminationGracePeriodSeconds": GRACE_S,
                },
            }
        )
    )
    api = config.new_client_from_config(config_file=real_cluster.kubeconfig)
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
    )
    result = Deployment(
        real_cluster.kubeconfig,
        api,
        manifest,
        operator_release,
        host.png(),
    )
    applied = result.kubectl("apply", "-f", str(manifest))
    assert applied.returncode == 0, applied.stderr
    yield result
    result.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def test_the_operator_runs_as_a_pod_of_its_image(deployment: Deployment) -> None:
    (operator,) = deployment.core.list_namespaced_pod(
        "dlo-system", label_selector="app.kubernetes.io/name=dlo-operator"
    ).items
    assert operator.spec.containers[0].image == ImageBuilder().reference("operator")
    assert operator.spec.node_name.startswith("dlo-real-")
    assert ready(operator)


def test_available_only_once_every_worker_of_an_engine_is_ready(deployment: Deployment) -> None:
    """Available counts whole engines (docs/operator.md): with two engines and the default
    disruption budget one engine whose every worker is Ready makes it True
    (MinimumEnginesReady), AllEnginesReady needs every worker, and a partly ready engine
    never counts."""
    premature: list[str] = []

    def observe() -> dict[str, client.V1Pod] | None:
        available = deployment.condition("Available")
        pods = deployment.pods()
        engines: dict[str, list[bool]] = {}
        for pod in pods:
            engines.setdefault(engine_of(pod), []).append(ready(pod))
        whole = [
            e for e, states in engines.items() if len(states) == PODS_PER_ENGINE and all(states)
        ]
        if available and available["status"] == "True":
            if not whole:
                premature.append(f"Available with no whole engine ready: {engines}")
            if available["reason"] == "AllEnginesReady" and len(whole) < ENGINES:
                premature.append(f"AllEnginesReady with {engines}")
        return serving(deployment)

    pods = eventually(observe, 420, "the DiffusionDeployment Available")
    assert premature == []
    # Every worker is Ready now: the next pass reports all engines (the reason may lag).
    available = eventually(
        lambda: (c := deployment.condition("Available")) and c["reason"] == "AllEnginesReady" and c,
        60,
        "Available for all engines",
    )
    assert available["status"] == "True", available
    available_since = datetime.fromisoformat(available["lastTransitionTime"])
    became_ready: dict[str, list[datetime]] = {}
    for pod in pods.values():
        (condition,) = [c for c in pod.status.conditions if c.type == "Ready"]
        became_ready.setdefault(engine_of(pod), []).append(condition.last_transition_time)
        health = requests.get(f"http://{pod.status.pod_ip}:8000/health/ready", timeout=5)
        assert health.status_code == 200, (pod.metadata.name, health.text)
    # It turned True only after the first engine had every worker Ready.
    assert min(max(times) for times in became_ready.values()) <= available_since, became_ready
    by_engine: dict[str, set[str]] = {}
    for pod in pods.values():
        by_engine.setdefault(engine_of(pod), set()).add(pod.spec.node_name)
    assert by_engine == {f"{NAME}-e{e}": {"dlo-real-0", "dlo-real-1"} for e in range(ENGINES)}


def test_a_request_through_the_service_matches_dlo_worker_generate(
    deployment: Deployment,
) -> None:
    response = deployment.generate()
    assert response.status_code == 200, response.text
    assert digest_bytes(response.content) == digest_bytes(deployment.expected_png)
    for rank in range(PODS_PER_ENGINE):  # each rank holds half of every block (AllGather)
        log = deployment.kubectl("logs", "-n", NAMESPACE, f"{NAME}-e0-n{rank}").stdout
        enabled = next(line for line in log.splitlines() if 'msg="dlo enabled"' in line)
        assert f"shards={PODS_PER_ENGINE}" in enabled.split(), enabled


def test_deleting_one_pod_restarts_its_whole_engine(deployment: Deployment) -> None:
    before = uids(eventually(lambda: serving(deployment), 300, "serving"))
    deployment.core.delete_namespaced_pod(f"{NAME}-e0-n1", NAMESPACE)

    def restarted() -> dict[str, client.V1Pod] | None:
        pods = serving(deployment)
        engine = [f"{NAME}-e0-n{n}" for n in range(PODS_PER_ENGINE)]
        if pods and all(pods[name].metadata.uid != before[name] for name in engine):
            return pods
        return None

    after = eventually(restarted, 420, "engine 0 replaced and serving")
    assert {name: after[name].metadata.uid for name in after if name.startswith(f"{NAME}-e1")} == {
        name: uid for name, uid in before.items() if name.startswith(f"{NAME}-e1")
    }
    response = deployment.generate()
    assert response.status_code == 200, response.text
    assert digest_bytes(response.content) == digest_bytes(deployment.expected_png)


class RequestLoop:
    """Requests through the client Service, one after another, until stopped."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                response = self.deployment.generate()
            except requests.RequestException as error:
                self.outcomes.append(f"error: {error}")
                continue
            if response.status_code != 200:
                self.outcomes.append(f"{response.status_code}: {response.text[:200]}")
            elif response.content != self.deployment.expected_png:
                self.outcomes.append("different bytes")
            else:
                self.outcomes.append("ok")

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


def test_a_spec_change_rolls_one_engine_at_a_time_and_no_request_fails(
    deployment: Deployment,
) -> None:
    before = uids(eventually(lambda: serving(deployment), 300, "serving"))
    engines_down_together: list[float] = []
    availability: list[str] = []
    with RequestLoop(deployment) as loop:
        time.sleep(3)
        patched = deployment.kubectl(
            "patch",
            "-n",
            NAMESPACE,
            "diffusiondeployment",
            NAME,
            "--type",
            "merge",
            "-p",
            json.dumps({"spec": {"resources": {"cpuPerRank": "150m"}}}),
        )
        assert patched.returncode == 0, patched.stderr

        def rolled() -> bool:
            available = deployment.condition("Available")
            availability.append(available["status"] if available else "missing")
            pods = deployment.pods()
            serving_engines = {
                engine_of(p)
                for p in pods
                if all(ready(q) for q in pods if engine_of(q) == engine_of(p))
            }
            if not serving_engines:
                engines_down_together.append(time.monotonic())
            current = serving(deployment)
            return bool(current) and not set(uids(current).values()) & set(before.values())

        roll_started = time.monotonic()
        eventually(rolled, 600, "both engines rolled to the new spec")
        roll_s = time.monotonic() - roll_started
        time.sleep(3)
    failed = [outcome for outcome in loop.outcomes if outcome != "ok"]
    print(f"roll: {roll_s:.0f} s, {len(loop.outcomes)} requests, {len(failed)} failed")
    assert len(loop.outcomes) >= 5, loop.outcomes
    assert failed == [], f"{len(failed)} of {len(loop.outcomes)} requests failed: {failed[:5]}"
    assert engines_down_together == []
    # The engine that still serves the old spec counts: Available stayed True.
    assert set(availability) == {"True"}, availability
    pods = deployment.pods()
    assert {p.spec.containers[0].resources.requests["cpu"] for p in pods} == {"150m"}


def container_log(state: ClusterState, pod: client.V1Pod) -> IO[str]:
    """The worker container's log file on its node, opened while the Pod runs.

    ``kubectl logs -f`` loses the last lines now and then when a deleted Pod's container
    is removed right after it exits (the stream ends with ``NotFound``); an open file keeps
    every line, even once the kubelet has unlinked it."""
    plan = next(p for p in state.node_plans() if p.name == pod.spec.node_name)
    directory = f"{NAMESPACE}_{pod.metadata.name}_{pod.metadata.uid}"
    return (plan.pod_logs / directory / "worker" / "0.log").open()


class ExitWatch:
    """The worker container's exit code of every Pod of the namespace, from a watch (the
    kubelet reports it before the deleted Pod's object goes away)."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.codes: dict[str, int] = {}
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stream = self._watch.stream(
            self.deployment.core.list_namespaced_pod,
            NAMESPACE,
            label_selector=WORKER_SELECTOR,
            timeout_seconds=GRACE_S * 2,
        )
        try:
            for event in stream:
                pod = event["object"]
                for status in pod.status.container_statuses or []:
                    if status.name == "worker" and status.state and status.state.terminated:
                        self.codes[pod.metadata.name] = status.state.terminated.exit_code
        except ProtocolError:
            pass  # the stream closed under stop(); a Pod not seen by then fails the check

    def __enter__(self) -> ExitWatch:
        self._thread.start()
        time.sleep(1)  # the watch is open before anything is deleted
        return self

    def __exit__(self, *_exc) -> None:
        deadline = time.monotonic() + 10
        while self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        self._watch.stop()


def test_kubectl_delete_drains_each_engine_in_order_within_the_grace_period(
    deployment: Deployment, real_cluster: ClusterState
) -> None:
    """Intake closes on the leader, then every rank disables DLO, then destroys its
    process groups; ``kubectl delete`` returns once that is done, within the grace period
    (no rank killed)."""
    pods = eventually(lambda: serving(deployment), 300, "serving")
    logs = {name: container_log(real_cluster, pod) for name, pod in pods.items()}
    with ExitWatch(deployment) as exits:
        started = time.monotonic()
        deleted = deployment.kubectl("delete", "-n", NAMESPACE, "diffusiondeployment", NAME)
        took = time.monotonic() - started
    # A clean drain is a clean exit: each Pod ended Error, exit 1, before `dlo-worker launch`.
    assert exits.codes == dict.fromkeys(pods, 0), exits.codes
    print(f"kubectl delete returned after {took:.1f} s (grace period {GRACE_S} s)")
    assert deleted.returncode == 0, deleted.stderr
    assert deployment.pods() == []
    assert took < GRACE_S, took
    for name, log in logs.items():
        text = log.read()
        log.close()
        expected = ["dlo disabled", "process groups destroyed"]
        if name.endswith("-n0"):
            expected.insert(0, "intake closed")
        positions = [text.find(f'msg="{line}') for line in expected]
        assert -1 not in positions, (name, expected, text[-3000:])
        assert positions == sorted(positions), (name, text[-3000:])


def test_a_broken_model_directory_is_reported_and_its_restarts_back_off(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A model directory that is not a pipeline restarted its engine every 3-7 s (0 -> 13
    restarts in 90 s) while Degraded stayed False and the cause was only in the logs of
    Pods deleted seconds later."""
    empty = tmp_path / "not-a-pipeline"  # mounted as the model directory, mode 0755
    empty.mkdir()
    manifest = yaml.safe_load(deployment.manifest.read_text())
    manifest["metadata"]["name"] = "broken"
    manifest["spec"].update(
        {
            "replicas": 1,
            "parallelism": {"data": 1},
            "model": {"hostPath": str(empty)},
            "terminationGracePeriodSeconds": 10,
        }
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(manifest))
    applied = deployment.kubectl("apply", "-f", str(broken))
    assert applied.returncode == 0, applied.stderr
    objects = client.CustomObjectsApi(deployment.api)

    def status() -> dict:
        body = objects.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "broken")
        return body.get("status") or {}

    def reported() -> dict | None:
        conditions = {c["type"]: c for c in status().get("conditions") or []}
        degraded = conditions.get("Degraded")
        if degraded and degraded["status"] == "True" and degraded["reason"] == "StartupFailed":
            return degraded
        return None

    degraded = eventually(reported, 60, "Degraded with the worker's message")
    assert "not a diffusers pipeline directory" in degraded["message"], degraded
    first = status()["engines"][0]["restarts"]
    time.sleep(60)
    engine = status()["engines"][0]
    # Immediately, then after 10, 20 and 40 s: at most four restarts in a minute.
    assert engine["restarts"] - first <= 4, engine
    assert engine["consecutiveRestarts"] >= 2, engine
    assert engine["reason"] == "StartupFailed"
    reasons = [
        event.reason
        for event in deployment.core.list_namespaced_event(
            NAMESPACE, field_selector="involvedObject.name=broken"
        ).items
    ]
    assert reasons.count("EngineFailed") == 1, reasons
    deployment.kubectl("delete", "-n", NAMESPACE, "diffusiondeployment", "broken", "--wait=false")


def test_a_missing_model_directory_is_reported_as_a_volume_mount_failure(
    deployment: Deployment, tmp_path: Path
) -> None:
    """The kubelet reports a hostPath that does not exist only in the Pod's FailedMount
    Events; the Pod stayed ContainerCreating and the deployment's status said nothing."""
    manifest = yaml.safe_load(deployment.manifest.read_text())
    manifest["metadata"]["name"] = "unmounted"
    manifest["spec"].update(
        {
            "replicas": 1,
            "parallelism": {"data": 1},
            "model": {"hostPath": str(tmp_path / "no-such-model")},
        }
    )
    path = tmp_path / "unmounted.yaml"
    path.write_text(yaml.safe_dump(manifest))
    applied = deployment.kubectl("apply", "-f", str(path))
    assert applied.returncode == 0, applied.stderr
    objects = client.CustomObjectsApi(deployment.api)

    def reported() -> dict | None:
        body = objects.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "unmounted")
        conditions = {c["type"]: c for c in (body.get("status") or {}).get("conditions") or []}
        degraded = conditions.get("Degraded")
        if degraded and degraded["status"] == "True":
            return {"degraded": degraded, "engine": body["status"]["engines"][0]}
        return None

    found = eventually(reported, 90, "Degraded naming the volume")
    assert found["degraded"]["reason"] == "VolumeMountFailed", found
    assert "no-such-model" in found["degraded"]["message"], found
    assert found["engine"]["reason"] == "VolumeMountFailed"
    deployment.kubectl(
        "delete", "-n", NAMESPACE, "diffusiondeployment", "unmounted", "--wait=false"
    )
