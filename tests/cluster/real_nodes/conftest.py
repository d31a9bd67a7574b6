"""The real-node tier: a cluster whose two nodes run containers (containerd, runc, a CNI
bridge and a kubelet each), shared by this package's modules.

Its own package so that ``pytest -n`` gives it a worker of its own (see
``pytest_xdist_make_scheduler`` in ``tests/conftest.py``): it runs beside the
control-plane tests of :mod:`tests.cluster`, and never beside another real-node cluster.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import nodes
from tests.harness.control_plane import ClusterState, down, up
from tests.harness.diagnostics import cluster_report
from tests.harness.images import missing_host_tools
from tests.support.generate import HostReference

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
    state = up(directory, nodes=0, real_nodes=2, build=False, owned=True, progress=progress)
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


@pytest.fixture(scope="session")
def host(tmp_path_factory: pytest.TempPathFactory) -> HostReference:
    """One :class:`~tests.support.generate.HostReference` for the tier (its model is read
    only)."""
    return HostReference(tmp_path_factory.mktemp("host"))
