"""The Helm chart: lints strictly, installs with default values (CRD included), and the
operator run with the chart's default arguments and only its RBAC reconciles the example in
a namespace created after it started.

Runs in a control plane of its own, because the chart installs the CRD itself and Helm will
not adopt one created by the other tests.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from dlo_operator.api import GROUP, PLURAL, VERSION
from tests.cluster.helpers import (
    CHART,
    cluster_tool,
    create,
    eventually,
    manifest,
    running_operator,
)
from tests.harness.control_plane import ClusterState, down, up

EXAMPLE = Path(__file__).parents[2] / "examples" / "diffusiondeployment.yaml"
RELEASE, OPERATOR_NAMESPACE = "dlo", "dlo-system"


@pytest.fixture(scope="module")
def chart_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    directory = tmp_path_factory.mktemp("chart-cluster")
    state = up(directory, nodes=2, build=False, owned=True, progress=lambda _line: None)
    try:
        yield state
    finally:
        down(directory, progress=lambda _line: None)


def tool(
    state: ClusterState, name: str, *args: str, home: Path
) -> subprocess.CompletedProcess[str]:
    return cluster_tool(state.kubeconfig, name, *args, home=home)


@pytest.fixture(scope="module")
def installed(chart_cluster: ClusterState, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("helm")
    result = tool(
        chart_cluster,
        "helm",
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--wait",
        "--timeout",
        "120s",
        home=home,
    )
    assert result.returncode == 0, result.stderr
    return config.new_client_from_config(config_file=chart_cluster.kubeconfig)


def test_chart_lints_strictly(chart_cluster: ClusterState, tmp_path: Path) -> None:
    result = tool(chart_cluster, "helm", "lint", "--strict", str(CHART), home=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_installs_the_crd_and_a_ready_operator_deployment(installed) -> None:
    crd = client.ApiextensionsV1Api(installed).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    assert crd.metadata.annotations["helm.sh/resource-policy"] == "keep"
    deployment = client.AppsV1Api(installed).read_namespaced_deployment(RELEASE, OPERATOR_NAMESPACE)
    assert deployment.spec.strategy.type == "Recreate"
    assert deployment.status.ready_replicas == 1


def _service_account_kubeconfig(api_client, state: ClusterState, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a bound token)."""
    token = (
        client.CoreV1Api(api_client)
        .create_namespaced_service_account_token(
            RELEASE,
            OPERATOR_NAMESPACE,
            client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
            ),
        )
        .status.token
    )
    document = json.loads(Path(state.kubeconfig).read_text())
    document["users"] = [{"name": "dlo-admin", "user": {"token": token}}]
    path.write_text(json.dumps(document))
    return path


def test_default_install_reconciles_the_example_in_a_namespace_created_later(
    chart_cluster, installed, tmp_path: Path
) -> None:
    """The chart's default arguments (every namespace) and only the chart's RBAC."""
    kubeconfig = _service_account_kubeconfig(installed, chart_cluster, tmp_path / "sa.json")
    restricted = config.new_client_from_config(config_file=str(kubeconfig))
    with pytest.raises(client.ApiException) as denied:
        client.CoreV1Api(restricted).list_namespaced_secret(OPERATOR_NAMESPACE)
    assert denied.value.status == 403

    log = tmp_path / "operator.log"
    with running_operator(str(kubeconfig), log) as arguments:
        assert not any(argument.startswith("--namespace") for argument in arguments)
        namespace = "tenant"
        client.CoreV1Api(installed).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
        )
        applied = tool(
            chart_cluster, "kubectl", "apply", "-n", namespace, "-f", str(EXAMPLE), home=tmp_path
        )
        assert applied.returncode == 0, applied.stderr

        def available() -> bool:
            status = (
                client.CustomObjectsApi(installed)
                .get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "flux")
                .get("status")
                or {}
            )
            return status.get("readyReplicas") == 2

        eventually(available, 120, "the example Available under the chart's defaults")
    # A word-bounded status code: a bare substring test also matched port numbers
    # such as 127.0.0.1:54037 in kopf's retry messages.
    forbidden = [
        line for line in log.read_text().splitlines() if re.search(r"\b403\b|Forbidden", line)
    ]
    assert forbidden == []
    tracebacks = [line for line in log.read_text().splitlines() if "Traceback" in line]
    assert tracebacks == []


def install_second_operator(
    chart_cluster: ClusterState, watched: str, home: Path
) -> subprocess.CompletedProcess[str]:
    """``helm install second`` of the chart in its own namespace, sharing the installed CRD
    and watching ``watched`` only."""
    return tool(
        chart_cluster,
        "helm",
        "install",
        "second",
        str(CHART),
        "--namespace",
        "second-system",
        "--create-namespace",
        "--set",
        "crd.install=false",
        "--set",
        f"watchNamespaces={{{watched}}}",
        home=home,
    )


def test_a_second_operator_over_the_same_namespaces_is_refused(
    chart_cluster, installed, tmp_path: Path
) -> None:
    """A second release with crd.install=false started a second cluster-wide operator,
    and two operators reconciled the same deployments."""
    result = install_second_operator(chart_cluster, "tenant", tmp_path)
    assert result.returncode != 0
    assert (
        f"watchNamespaces: release {RELEASE} in namespace {OPERATOR_NAMESPACE} already runs a "
        "dlo-operator watching every namespace"
    ) in result.stderr
    deployments = client.AppsV1Api(installed).list_namespaced_deployment("second-system")
    assert deployments.items == []


def test_watched_namespaces_get_a_role_each_and_nothing_beyond_them(
    chart_cluster, installed, tmp_path: Path
) -> None:
    """With watchNamespaces the operator's namespaced permissions are Roles in those
    namespaces: it reconciles there, cannot read Pods elsewhere, and logs no refusal."""
    core = client.CoreV1Api(installed)
    for name in ("watched", "unwatched", "elsewhere"):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    upgraded = tool(
        chart_cluster,
        "helm",
        "upgrade",
        RELEASE,
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--set",
        "watchNamespaces={watched}",
        home=tmp_path,
    )
    assert upgraded.returncode == 0, upgraded.stderr
    try:
        kubeconfig = _service_account_kubeconfig(installed, chart_cluster, tmp_path / "sa.json")
        restricted = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        restricted.list_namespaced_pod("watched")
        for forbidden in (
            lambda: restricted.list_namespaced_pod("unwatched"),
            restricted.list_pod_for_all_namespaces,
        ):
            with pytest.raises(client.ApiException) as denied:
                forbidden()
            assert denied.value.status == 403

        log = tmp_path / "operator.log"
        with running_operator(str(kubeconfig), log, "watchNamespaces={watched}") as arguments:
            assert "--namespace=watched" in arguments
            # Small CPU engines: the example of the test above still holds the nodes' GPUs.
            small = manifest(
                "small",
                accelerator="none",
                gpusPerNode=1,
                parallelism={"data": 1},
                resources={"cpu": "100m", "memory": "1Gi"},
                shmSize="256Mi",
            )
            for namespace in ("watched", "unwatched"):
                create(installed, namespace, small)

            def ready(namespace: str) -> int:
                body = client.CustomObjectsApi(installed).get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, "small"
                )
                return (body.get("status") or {}).get("readyReplicas", 0)

            eventually(lambda: ready("watched") == 1, 120, "the engine Available in watched")
            assert ready("unwatched") == 0
            assert core.list_namespaced_pod("unwatched").items == []
        lines = log.read_text().splitlines()
        assert [line for line in lines if re.search(r"\b403\b|Forbidden", line)] == []

        # Disjoint namespaces: a second operator is allowed.
        second = install_second_operator(chart_cluster, "elsewhere", tmp_path)
        assert second.returncode == 0, second.stderr
        tool(chart_cluster, "helm", "uninstall", "second", "-n", "second-system", home=tmp_path)
    finally:
        for namespace in ("watched", "unwatched"):
            client.CustomObjectsApi(installed).delete_collection_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL
            )
