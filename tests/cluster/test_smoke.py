"""The local control plane is real: schema validation with CEL, scheduling onto fake GPU nodes,
garbage collection, RBAC denial, and helm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from kubernetes import client

from tests.cluster.helpers import eventually

GROUP = "smoke.dlo.dev"


def test_apiserver_reports_its_real_version(api_client) -> None:
    version = client.VersionApi(api_client).get_code()
    assert version.git_version.startswith("v1.")
    assert int(version.minor) >= 34


def test_cel_rule_in_a_structural_schema_rejects_a_custom_resource(api_client, namespace) -> None:
    extensions = client.ApiextensionsV1Api(api_client)
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "min": {"type": "integer"},
                                        "max": {"type": "integer"},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.min <= self.max",
                                            "message": "min must not exceed max",
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    extensions.create_custom_resource_definition(crd)
    eventually(
        lambda: any(
            condition.type == "Established" and condition.status == "True"
            for condition in extensions.read_custom_resource_definition(
                f"widgets.{GROUP}"
            ).status.conditions
            or []
        )
    )
    objects = client.CustomObjectsApi(api_client)

    def widget(name: str, low: int, high: int) -> dict:
        return {
            "apiVersion": f"{GROUP}/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"min": low, "max": high},
        }

    eventually(lambda: _creates(objects, namespace, widget("good", 1, 2)), 30)
    with pytest.raises(client.ApiException) as rejected:
        objects.create_namespaced_custom_object(
            GROUP, "v1", namespace, "widgets", widget("bad", 3, 2)
        )
    assert rejected.value.status == 422
    assert "min must not exceed max" in rejected.value.body


def _creates(objects: client.CustomObjectsApi, namespace: str, body: dict) -> bool:
    try:
        objects.create_namespaced_custom_object(GROUP, "v1", namespace, "widgets", body)
    except client.ApiException as error:
        if error.status == 404:  # discovery not caught up yet
            return False
        raise
    return True


def test_gpu_pod_is_scheduled_onto_a_fake_node_and_becomes_ready(api_client, namespace) -> None:
    core = client.CoreV1Api(api_client)
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="gpu-worker"),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="worker",
                    image="registry.invalid/worker:1",
                    resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": "2"}),
                )
            ]
        ),
    )
    core.create_namespaced_pod(namespace, pod)

    def ready() -> bool:
        status = core.read_namespaced_pod("gpu-worker", namespace).status
        conditions = {c.type: c.status for c in status.conditions or []}
        return status.phase == "Running" and conditions.get("Ready") == "True"

    eventually(ready, 90)
    node_name = core.read_namespaced_pod("gpu-worker", namespace).spec.node_name
    node = core.read_node(node_name)
    assert node.metadata.labels["type"] == "kwok"
    assert node.status.allocatable["nvidia.com/gpu"] == "8"


def test_deleting_an_owner_garbage_collects_its_dependents(api_client, namespace) -> None:
    core = client.CoreV1Api(api_client)
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    reference = client.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    core.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="dependent", owner_references=[reference])
        ),
    )
    core.delete_namespaced_config_map("owner", namespace)

    def collected() -> bool:
        names = {cm.metadata.name for cm in core.list_namespaced_config_map(namespace).items}
        return "dependent" not in names

    eventually(collected, 90)


def test_service_account_without_permissions_is_denied(api_client, namespace) -> None:
    core = client.CoreV1Api(api_client)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="nobody"))
    )
    impersonating = client.ApiClient(api_client.configuration)
    impersonating.set_default_header(
        "Impersonate-User", f"system:serviceaccount:{namespace}:nobody"
    )
    with pytest.raises(client.ApiException) as denied:
        client.CoreV1Api(impersonating).list_namespaced_pod(namespace)
    assert denied.value.status == 403
    assert f"system:serviceaccount:{namespace}:nobody" in denied.value.body


def test_helm_installs_a_trivial_chart(
    cluster, cluster_bin: Path, namespace, tmp_path: Path
) -> None:
    chart = tmp_path / "hello"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: hello\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hi\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-hello\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    env = {
        **os.environ,
        "KUBECONFIG": cluster.kubeconfig,
        "HELM_CACHE_HOME": str(tmp_path / "c"),
        "HELM_CONFIG_HOME": str(tmp_path / "cfg"),
        "HELM_DATA_HOME": str(tmp_path / "d"),
    }
    result = subprocess.run(
        [
            str(cluster_bin / "helm"),
            "install",
            "smoke",
            str(chart),
            "--namespace",
            namespace,
            "--wait",
            "--timeout",
            "60s",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    kubectl = subprocess.run(
        [
            str(cluster_bin / "kubectl"),
            "get",
            "configmap",
            "smoke-hello",
            "-n",
            namespace,
            "-o",
            "jsonpath={.data.greeting}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert kubectl.stdout == "hi", kubectl.stderr
