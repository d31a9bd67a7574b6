"""Runtime-cache warming on the real control plane: a warm Job per node, per-node status,
engines placed on warm nodes, warming again when the warm template changes.

kwok completes the warm Jobs' Pods on its fake nodes (its pod-complete stage); the Job
controller of the real kube-controller-manager marks the Jobs Complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from dlo_operator.api import GROUP, PLURAL, VERSION
from tests.cluster.helpers import create, eventually, manifest, running_operator

CACHE = {"useAllGather": False, "runtimeCache": {"enabled": True}}


@pytest.fixture
def operator(cluster, crd, namespace, tmp_path: Path) -> Iterator[Path]:
    log = tmp_path / "operator.log"
    with running_operator(cluster.kubeconfig, log):
        yield log


def _status(api_client, namespace: str) -> dict:
    body = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "flux"
    )
    return body.get("status") or {}


def _jobs(api_client, namespace: str) -> list:
    return [
        job
        for job in client.BatchV1Api(api_client).list_namespaced_job(namespace).items
        if not job.metadata.deletion_timestamp
    ]


def _gpu_nodes(api_client) -> list[str]:
    return sorted(
        node.metadata.name
        for node in client.CoreV1Api(api_client).list_node().items
        if int((node.status.allocatable or {}).get("nvidia.com/gpu", 0)) >= 2
    )


def test_every_node_warms_its_cache_and_engines_prefer_warm_nodes(
    api_client, operator, namespace
) -> None:
    nodes = _gpu_nodes(api_client)
    assert nodes
    create(api_client, namespace, manifest("flux", replicas=1, offload=CACHE))
    everyone = f"{len(nodes)}/{len(nodes)}"
    eventually(
        lambda: (_status(api_client, namespace).get("cache") or {}).get("warm") == everyone,
        180,
        f"cache warm on {everyone} nodes",
    )
    cache = _status(api_client, namespace)["cache"]
    assert [node["node"] for node in cache["nodes"]] == nodes
    assert {node["state"] for node in cache["nodes"]} == {"Warm"}
    jobs = _jobs(api_client, namespace)
    assert sorted(job.spec.template.spec.node_name for job in jobs) == nodes
    (command,) = {tuple(job.spec.template.spec.containers[0].command[:3]) for job in jobs}
    assert command == ("dlo-worker", "cache", "warm")

    # Engines created now prefer the warm nodes.
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "flux", {"spec": {"replicas": 2}}
    )
    eventually(
        lambda: any(
            pod.metadata.name == "flux-e1-n0"
            for pod in client.CoreV1Api(api_client).list_namespaced_pod(namespace).items
        ),
        60,
        "engine 1 created",
    )
    pod = client.CoreV1Api(api_client).read_namespaced_pod("flux-e1-n0", namespace)
    (preferred,) = (
        pod.spec.affinity.node_affinity.preferred_during_scheduling_ignored_during_execution
    )
    assert preferred.preference.match_expressions[0].values == nodes

    # A new warm template (another image) warms every node again; the old Jobs go.
    old_jobs = {job.metadata.name for job in jobs}
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "flux", {"spec": {"worker": {"image": "dlo-worker:0.2"}}}
    )

    def rewarmed() -> bool:
        current = {job.metadata.name for job in _jobs(api_client, namespace)}
        cache = _status(api_client, namespace).get("cache") or {}
        return bool(current) and current.isdisjoint(old_jobs) and cache.get("warm") == everyone

    eventually(rewarmed, 180, "every node warmed again for the new image")
