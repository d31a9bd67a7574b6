"""``up`` is idempotent and ``down`` leaves no component running."""

from __future__ import annotations

from pathlib import Path

from tests.harness.control_plane import ClusterState, down, is_running, up


def test_up_twice_reuses_the_cluster_and_down_stops_every_component(tmp_path: Path) -> None:
    first = up(tmp_path, nodes=1, build=False, owned=True, progress=lambda _line: None)
    try:
        again = up(tmp_path, nodes=1, build=False, owned=True, progress=lambda _line: None)
        assert [c.pid for c in again.components] == [c.pid for c in first.components]
        assert {c.name for c in first.components} == {
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
        }
        assert all(is_running(component) for component in first.components)
    finally:
        down(tmp_path, progress=lambda _line: None)
    assert not any(is_running(component) for component in first.components)
    assert ClusterState.load(tmp_path) is None
    down(tmp_path, progress=lambda _line: None)  # idempotent
