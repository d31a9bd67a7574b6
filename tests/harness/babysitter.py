"""Keep one node agent running, as systemd (``Restart=always``) does on a stock node.

The kubelet exits on purpose when cAdvisor or its container manager fails to start
("rely on the babysitter to retry starting kubelet", kubelet.go), e.g. when a cgroup it
is about to watch disappears while another node's kubelet starts. A real node restarts
it; so does this: ``python babysitter.py -- COMMAND...`` runs COMMAND in the babysitter's
own process group, restarts it whenever it exits, with a backoff from 1 s to 10 s (the
kubeadm unit's ``RestartSec``), and writes one line per restart into the same log. SIGTERM
stops the command and then the babysitter; :func:`tests.harness.control_plane._stop`
signals the whole group anyway.

Run as a script (no imports from the project), so it starts from any directory.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

MAX_BACKOFF_S = 10.0
RESTART_MARK = "babysitter: "
"""Every line this writes starts with it, so a report can count the restarts."""


def main(command: list[str]) -> int:
    stopping = False
    child: subprocess.Popen | None = None

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    restarts = 0
    quick_failures = 0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(command)
        code = child.wait()
        if stopping:
            return 0
        if time.monotonic() - started > 60:
            quick_failures = 0  # it ran for a while: start again soon
        backoff = min(MAX_BACKOFF_S, 2.0**quick_failures)
        quick_failures += 1
        restarts += 1
        print(
            f"{RESTART_MARK}{command[0]} exited with code {code}; restart {restarts} in "
            f"{backoff:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.monotonic() + backoff
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.1)
        if stopping:
            return 0


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["--"]:
        arguments = arguments[1:]
    if not arguments:
        sys.exit("usage: babysitter.py -- COMMAND [ARGUMENT...]")
    sys.exit(main(arguments))
