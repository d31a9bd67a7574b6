"""Rendered engine objects (hardened Pods, budget, NetworkPolicy, Services) pass the real
API server's validation and run on kwok nodes."""

from __future__ import annotations

from kubernetes import client, utils

from dlo_operator.api import GROUP, PLURAL, VERSION, DiffusionDeploymentSpec
from dlo_operator.render import Owner, render_children, render_engine_pods
from tests.cluster.helpers import create, eventually, manifest


def test_an_engine_is_accepted_scheduled_and_becomes_ready(api_client, crd, namespace) -> None:
    body = manifest(
        "flux",
        parallelism={"data": 4},
        lockedMemory="IpcLock",
        offload={"useAllGather": False, "runtimeCache": {"enabled": True}},
    )
    created = create(api_client, namespace, body)
    spec = DiffusionDeploymentSpec.model_validate(created["spec"])
    owner = Owner(created["metadata"]["name"], namespace, created["metadata"]["uid"])
    for item in [*render_children(owner, spec), *render_engine_pods(owner, spec, 0)]:
        utils.create_from_dict(api_client, item, namespace=namespace)

    core = client.CoreV1Api(api_client)

    def engine_ready() -> bool:
        pods = core.list_namespaced_pod(namespace, label_selector="dlo.dev/engine=0").items
        return len(pods) == 2 and all(
            any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            for p in pods
        )

    eventually(engine_ready, 90, "both Pods of engine 0 Ready")
    nodes = {p.spec.node_name for p in core.list_namespaced_pod(namespace).items}
    assert len(nodes) == 2  # one Pod per node
    budget = client.PolicyV1Api(api_client).read_namespaced_pod_disruption_budget("flux", namespace)
    assert budget.spec.min_available == 1
    assert budget.spec.unhealthy_pod_eviction_policy == "AlwaysAllow"
    (init,) = core.read_namespaced_pod("flux-e0-n0", namespace).spec.init_containers
    assert init.security_context.capabilities.add == ["CHOWN"]

    client.CustomObjectsApi(api_client).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "flux"
    )
    # The garbage collector notices a new CRD's kind on its periodic resync (~30 s).
    eventually(lambda: not core.list_namespaced_pod(namespace).items, 180, "Pods collected")
