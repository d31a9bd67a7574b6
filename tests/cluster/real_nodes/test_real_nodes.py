"""Real nodes: the kubelets of ``up --real-nodes`` run Pods of the images built from
docker/*.Dockerfile in containerd. A worker Pod, in the container the operator renders,
generates the same PNG bytes as ``dlo-worker`` on the host, eager and compiled; Pods on
two nodes reach each other by Pod IP; a kubelet that exits is started again; ``down``
leaves no process, mount, cgroup or bridge behind."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from dlo_operator.render.pod_spec import (
    WORKER_HOME,
    WORKER_USER,
    security_contexts,
    volumes_and_mounts,
)
from dlo_operator.workerconfig import compile_cache_dir
from tests.cluster.helpers import eventually
from tests.harness import babysitter
from tests.harness.control_plane import ClusterState
from tests.harness.images import ImageBuilder
from tests.support.deployments import deployment_spec
from tests.support.generate import HostReference, demo_flags, digest
from tests.support.serving import digest as digest_bytes


@pytest.fixture(scope="module")
def core(real_cluster: ClusterState) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=real_cluster.kubeconfig))


@pytest.fixture
def namespace(core: client.CoreV1Api) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


def pod(name: str, node: str, image: str, command: list[str], **spec) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            node_name=node,
            restart_policy="Never",
            automount_service_account_token=False,
            containers=[
                client.V1Container(
                    name=name,
                    image=image,
                    image_pull_policy="Never",
                    command=command,
                    volume_mounts=spec.pop("volume_mounts", None),
                )
            ],
            **spec,
        ),
    )


def finished(core: client.CoreV1Api, namespace: str, name: str, timeout_s: float) -> str:
    def phase() -> str | None:
        current = core.read_namespaced_pod(name, namespace).status.phase
        return current if current in ("Succeeded", "Failed") else None

    return eventually(phase, timeout_s, f"pod {name} finished")


def probe_script(url: str) -> str:
    """Python that prints the HTTP status of ``url``, retrying for up to 90 s."""
    return (
        "import time, urllib.request\n"
        "for _ in range(90):\n"
        "    try:\n"
        f"        print(urllib.request.urlopen({url!r}).status); break\n"
        "    except OSError: time.sleep(1)\n"
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_worker_pod_on_a_real_node_generates_the_hosts_bytes(
    core,
    namespace: str,
    tmp_path: Path,
    compiled: bool,
    host: HostReference,
) -> None:
    """In the container the operator renders (its user, a read-only root filesystem, /tmp
    and $HOME on emptyDirs, the model mounted read-only), eager and with ``--compile``,
    whose kernels are built in the container (the compile cache where the operator puts
    it)."""
    spec = deployment_spec(model={"hostPath": str(host.model)}, compile={"enabled": compiled})
    (tmp_path / "out").mkdir(mode=0o777)
    (tmp_path / "out").chmod(0o777)
    pod_context, container_context = security_contexts(spec)
    volumes, mounts = volumes_and_mounts(spec)
    compile_flags = ["--compile", "--compile-cache-dir", str(compile_cache_dir(spec))]
    command = [
        "dlo-worker",
        "generate",
        "--model",
        spec.model.mount_path,
        *demo_flags(),
        *(compile_flags if compiled else []),
        "--out",
        "/out/image.png",
    ]
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "generate"},
        "spec": {
            "nodeName": "dlo-real-0",
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": pod_context,
            "volumes": [*volumes, {"name": "out", "hostPath": {"path": str(tmp_path / "out")}}],
            "containers": [
                {
                    "name": "generate",
                    "image": ImageBuilder().reference("worker"),
                    "imagePullPolicy": "Never",
                    "command": command,
                    "env": [
                        {"name": "HOME", "value": WORKER_HOME},
                        {"name": "USER", "value": WORKER_USER},
                    ],
                    "securityContext": container_context,
                    "volumeMounts": [*mounts, {"name": "out", "mountPath": "/out"}],
                }
            ],
        },
    }
    core.create_namespaced_pod(namespace, body)
    phase = finished(core, namespace, "generate", 300)
    assert phase == "Succeeded", core.read_namespaced_pod_log("generate", namespace)
    expected = host.png(*(["--compile"] if compiled else []))
    assert digest(tmp_path / "out" / "image.png") == digest_bytes(expected)


def routed_device(address: str) -> str:
    """The interface this host sends packets for ``address`` through."""
    route = subprocess.run(
        ["ip", "-json", "route", "get", address], capture_output=True, text=True, check=True
    )
    return json.loads(route.stdout)[0]["dev"]


def test_pods_on_two_real_nodes_reach_each_other_by_pod_ip(
    real_cluster: ClusterState, core, namespace: str
) -> None:
    """A Pod's address is in its node's pod CIDR and the host routes it to that node's
    bridge (a pod CIDR the host already routes elsewhere makes its Pods unreachable)."""
    plans = {plan.name: plan for plan in real_cluster.node_plans()}
    base = ImageBuilder().pause.reference  # the base image with Python
    core.create_namespaced_pod(
        namespace, pod("server", "dlo-real-0", base, ["python3", "-m", "http.server", "8000"])
    )
    address = eventually(
        lambda: core.read_namespaced_pod("server", namespace).status.pod_ip, 120, "server IP"
    )
    probe = probe_script(f"http://{address}:8000/")
    core.create_namespaced_pod(
        namespace, pod("client", "dlo-real-1", base, ["python3", "-c", probe])
    )
    client_address = eventually(
        lambda: core.read_namespaced_pod("client", namespace).status.pod_ip, 120, "client IP"
    )
    for node, pod_address in (("dlo-real-0", address), ("dlo-real-1", client_address)):
        assert ipaddress.ip_address(pod_address) in ipaddress.ip_network(plans[node].pod_cidr)
        assert routed_device(pod_address) == plans[node].bridge
    assert finished(core, namespace, "client", 180) == "Succeeded"
    assert core.read_namespaced_pod_log("client", namespace).strip() == "200"


def test_a_service_reaches_its_pod_on_another_real_node(core, namespace: str) -> None:
    """kube-proxy's rules: a ClusterIP Service in front of a Pod on the other node."""
    base = ImageBuilder().pause.reference
    server = pod("web", "dlo-real-0", base, ["python3", "-m", "http.server", "8000"])
    server.metadata.labels = {"app": "web"}
    core.create_namespaced_pod(namespace, server)
    service = core.create_namespaced_service(
        namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name="web"),
            spec=client.V1ServiceSpec(
                selector={"app": "web"}, ports=[client.V1ServicePort(port=80, target_port=8000)]
            ),
        ),
    )
    probe = probe_script(f"http://{service.spec.cluster_ip}/")
    core.create_namespaced_pod(
        namespace, pod("probe", "dlo-real-1", base, ["python3", "-c", probe])
    )
    assert finished(core, namespace, "probe", 180) == "Succeeded"
    assert core.read_namespaced_pod_log("probe", namespace).strip() == "200"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def test_a_kubelet_that_exits_is_started_again_and_its_node_runs_pods(
    real_cluster: ClusterState, core, namespace: str
) -> None:
    """The kubelet exits by design when cAdvisor or its container manager cannot start and
    relies on a babysitter; the local nodes have one, as a stock node has systemd."""
    component = next(c for c in real_cluster.components if c.name == "kubelet@dlo-real-1")
    (first,) = _children(component.pid)
    os.kill(first, signal.SIGKILL)
    restarted = eventually(
        lambda: [pid for pid in _children(component.pid) if pid != first], 30, "a new kubelet"
    )
    assert len(restarted) == 1
    restarts = Path(component.log).read_text().split(babysitter.RESTART_MARK)[1:]
    assert restarts
    assert "exited with code -9" in restarts[-1]
    base = ImageBuilder().pause.reference
    core.create_namespaced_pod(namespace, pod("after", "dlo-real-1", base, ["true"]))
    assert finished(core, namespace, "after", 120) == "Succeeded"
    conditions = core.read_node("dlo-real-1").status.conditions
    assert any(c.type == "Ready" and c.status == "True" for c in conditions)
