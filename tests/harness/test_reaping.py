"""Clusters left by a killed test run (tests/harness/control_plane.py): the next ``up``
stops them, with real processes standing in for their components."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.control_plane import (
    ClusterState,
    Component,
    _start_time,
    reap_abandoned,
    registry,
)


def test_a_cluster_whose_owner_was_killed_is_stopped_by_the_next_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test session killed mid-run leaves its components running (each in a session of
    its own); the next ``up`` finds them through the registry and stops them, also after
    the cluster's own directory was deleted."""
    monkeypatch.setenv("DLO_CLUSTER_CACHE", str(tmp_path / "cache"))
    owner = subprocess.Popen([sys.executable, "-c", "pass"])
    owner_started = _start_time(owner.pid)
    owner.wait()
    leftover = subprocess.Popen(["sleep", "600"], start_new_session=True)
    time.sleep(0.05)
    started = _start_time(leftover.pid)
    assert owner_started
    assert started
    directory = tmp_path / "killed-run"
    directory.mkdir()
    state = ClusterState(
        str(directory),
        "",
        "",
        [Component("etcd", leftover.pid, started, str(tmp_path / "etcd.log"))],
        owner=[str(owner.pid), owner_started],
    )
    state.save()
    (directory / "cluster.json").unlink()  # pytest removed the old run's directory
    assert state.registration.parent == registry()
    lines: list[str] = []
    reap_abandoned(lines.append)
    assert leftover.wait(timeout=20) is not None
    assert not state.registration.exists()
    assert lines[0] == f"stopping the cluster a killed run left in {directory}"


def test_a_cluster_whose_owner_runs_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLO_CLUSTER_CACHE", str(tmp_path / "cache"))
    me = [str(os.getpid()), _start_time(os.getpid()) or ""]
    state = ClusterState(str(tmp_path), "", "", [], owner=me)
    state.save()
    reap_abandoned(lambda _line: None)
    assert state.registration.exists()
