"""The node agents' babysitter (tests/harness/babysitter.py) and the report a real-node
timeout carries: a real process tree, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import babysitter
from tests.harness.control_plane import ClusterError, _wait, log_excerpt


def _wait_for(condition, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_a_command_that_exits_is_started_again_and_sigterm_stops_both(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    script = f"echo run >> {runs}; if [ $(wc -l < {runs}) -ge 3 ]; then exec sleep 600; fi; exit 7"
    log = tmp_path / "log"
    with log.open("wb") as stream:
        sitter = subprocess.Popen(
            [sys.executable, babysitter.__file__, "--", "sh", "-c", script],
            stdout=stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for(lambda: runs.exists() and runs.read_text().count("run") == 3)
        restarts = [
            line
            for line in log.read_text().splitlines()
            if line.startswith(babysitter.RESTART_MARK)
        ]
        assert len(restarts) == 2
        assert all("exited with code 7" in line for line in restarts)
        assert "restart 2 in 2 s" in restarts[1]  # the backoff doubles
        (sleeper,) = Path(f"/proc/{sitter.pid}/task/{sitter.pid}/children").read_text().split()
        os.killpg(sitter.pid, signal.SIGTERM)  # what control_plane._stop sends
        assert sitter.wait(timeout=10) == 0
        assert not Path(f"/proc/{sleeper}").exists()  # stopped and reaped
        assert runs.read_text().count("run") == 3  # nothing restarted after the stop
    finally:
        if sitter.poll() is None:
            os.killpg(sitter.pid, signal.SIGKILL)


def test_the_report_keeps_the_last_errors_and_restarts_of_a_klog_log() -> None:
    lines = [f"I1130 20:41:3{i}.0 1 a.go:1] info {i}" for i in range(5)]
    lines += [
        'E1130 20:41:40.0 1 kubelet.go:1] "Failed to start cAdvisor" err="inotify"',
        "babysitter: /bin/kubelet exited with code 1; restart 1 in 1 s",
        "I1130 20:41:42.0 1 a.go:1] info again",
        "Everything fine",  # not klog's error prefix (no digits after the letter)
    ]
    excerpt = log_excerpt("\n".join(lines))
    assert excerpt.splitlines() == [
        '    E1130 20:41:40.0 1 kubelet.go:1] "Failed to start cAdvisor" err="inotify"',
        "    babysitter: /bin/kubelet exited with code 1; restart 1 in 1 s",
    ]
    quiet = log_excerpt("\n".join(f"line {i}" for i in range(30)), lines=3)
    assert quiet.splitlines() == ["    line 27", "    line 28", "    line 29"]


def test_a_timeout_carries_the_last_errors_of_the_components_log(tmp_path: Path) -> None:
    log = tmp_path / "kube-apiserver.log"
    log.write_text('I1130 1 a.go:1] fine\nE1130 20:00:00.0 1 b.go:2] "bind" err="in use"\n')
    with pytest.raises(ClusterError) as raised:
        _wait(lambda: False, 0.1, "kube-apiserver", log, lambda: "  and one more thing")
    message = str(raised.value)
    assert message.startswith(f"kube-apiserver not ready after 0 s; see {log}")
    assert 'E1130 20:00:00.0 1 b.go:2] "bind" err="in use"' in message
    assert "fine" not in message
    assert message.endswith("and one more thing")
