"""Fixtures: one control plane per test session, one namespace per test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from dlo_operator.crd import custom_resource_definition
from tests.cluster.helpers import eventually
from tests.harness import nodes
from tests.harness.control_plane import ClusterState, down, up
from tests.harness.diagnostics import cluster_report
from tests.harness.images import missing_host_tools


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    directory = tmp_path_factory.mktemp("cluster")
    state = up(directory, nodes=4, progress=lambda line: print(line, flush=True))
    try:
        yield state
    finally:
        down(directory, progress=lambda line: print(line, flush=True))


@pytest.fixture(scope="session")
def api_client(cluster: ClusterState):
    from kubernetes import config

    return config.new_client_from_config(config_file=cluster.kubeconfig)


@pytest.fixture
def namespace(api_client) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name)


@pytest.fixture(scope="session")
def cluster_bin(cluster: ClusterState) -> Path:
    from tests.harness.build import Builder

    return Builder().bin


@pytest.fixture(scope="session")
def crd(api_client) -> None:
    extensions = client.ApiextensionsV1Api(api_client)
    body = custom_resource_definition()
    name = body["metadata"]["name"]
    try:
        extensions.create_custom_resource_definition(body)
    except client.ApiException as error:
        if error.status != 409:
            raise
        current = extensions.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        extensions.replace_custom_resource_definition(name, body)
    eventually(
        lambda: any(
            c.type == "Established" and c.status == "True"
            for c in extensions.read_custom_resource_definition(name).status.conditions or []
        )
    )


REQUIRE_REAL_NODES = "DLO_REQUIRE_REAL_NODES"
"""Set to 1 (``.ci/run`` does) and a machine that cannot host real nodes fails the tier
instead of skipping it."""


def _cannot_run_real_nodes(reason: str) -> None:
    if os.environ.get(REQUIRE_REAL_NODES) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_REAL_NODES}=1 requires them", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use the real-node cluster carry the ``real_nodes`` marker: their reports
    carry it too, also from a worker process (``pytest -n``), for the summary line."""
    for item in items:
        if "real_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_nodes)


_reported: list[str] = []
"""The real-node tests whose failure carries the full cluster report (the first one)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test of the real-node tier carries a report of the cluster and the host
    network (:mod:`tests.harness.diagnostics`): CI keeps no machine to look at. The first
    failure's report is full; later ones show the Pods and events, and name the first."""
    report = yield
    state = getattr(item, "funcargs", {}).get("real_cluster")
    if report.failed and report.when in ("setup", "call") and isinstance(state, ClusterState):
        first = not _reported
        title = "real-node tier: cluster and host network"
        if first:
            _reported.append(item.nodeid)
        else:
            title += f" (host network and logs: see {_reported[0]})"
        report.sections.append((title, cluster_report(state, full=first)))
    return report


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    """Two real nodes (:mod:`tests.harness.nodes`) and no fake ones, shared by the modules
    that need containers to run; skipped where the machine cannot host them."""
    if os.geteuid() != 0:
        _cannot_run_real_nodes("real nodes need root (containerd, cgroups, bridges)")
    if missing_host_tools() and not Path("/usr/bin/apt-get").exists():
        _cannot_run_real_nodes(f"real nodes need {missing_host_tools()}")
    directory = tmp_path_factory.mktemp("real-cluster")
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    state = up(directory, nodes=0, real_nodes=2, progress=progress)
    try:
        yield state
    finally:
        down(directory, progress=progress)
        plans = state.node_plans()
        assert len(plans) == 2
        assert not any(nodes._shims(plan) or nodes._cgroup_processes(plan) for plan in plans)
        assert not any(
            line.split()[1].startswith(str(directory / "nodes"))
            for line in Path("/proc/mounts").read_text().splitlines()
        )
