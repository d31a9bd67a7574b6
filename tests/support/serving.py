"""Running ``dlo-worker serve`` as a user does: a subprocess, real HTTP, PNG digests."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def serve_command(model: Path, port: int, *flags: str) -> list[str]:
    return [
        "serve",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--port",
        str(port),
        "--log-level",
        "info",
        *flags,
    ]


class Server:
    """A running ``dlo-worker serve`` process tree and its base URL."""

    def __init__(self, command: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            command,
            env={**ENV, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.communicate()[0]
            try:
                if requests.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):
                # Not listening yet, or too busy loading the model to answer in time: a
                # probe that times out is retried, as the kubelet's is.
                pass
            time.sleep(0.5)
        pytest.fail("the server never became ready")

    def generate(self, body: dict) -> requests.Response:
        return requests.post(f"{self.url}/v1/generate", json=body, timeout=600)

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.communicate(timeout=120)[0]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def lockstep_engine_serves(
    model: Path,
    log_dir: Path,
    slow: dict,
    names: list[str],
    send: Callable[[Server, str], list[bytes]],
    *flags: str,
) -> tuple[dict[str, list[bytes]], dict[int, str]]:
    """A DP=2 DLO AllGather engine (lockstep waves) serving ``names`` queued behind
    ``slow``, in that order: their images, and each rank's log."""
    from tests.support.launch import rank_logs, torchrun_command
    from tests.support.ports import free_port

    port = free_port()
    dlo = ("--enable-distributed-layerwise-offload", "--data-parallel-size", "2")
    server = Server(torchrun_command(serve_command(model, port, *dlo, *flags), log_dir), port)
    served: dict[str, list[bytes]] = {}
    try:
        server.wait_ready()
        served = _queued_behind_a_slow_request(server, slow, names, send)
    finally:
        output = server.stop()
    assert served.keys() == set(names), output
    logs = rank_logs(log_dir)
    assert sorted(logs) == [0, 1], output
    return served, logs


def _queued_behind_a_slow_request(
    server: Server, slow: dict, names: list[str], send: Callable[[Server, str], list[bytes]]
) -> dict[str, list[bytes]]:
    """Send ``slow`` (it holds the engine), then each of ``names`` 0.3 s apart, so they
    queue and the engine forms its next waves from them; their images."""
    served: dict[str, list[bytes]] = {}
    holder = threading.Thread(target=server.generate, args=(slow,))
    holder.start()
    time.sleep(1)
    senders = []
    for name in names:
        sender = threading.Thread(
            target=lambda name=name: served.setdefault(name, send(server, name))
        )
        sender.start()
        senders.append(sender)
        time.sleep(0.3)
    assert holder.is_alive(), "the slow request ended before the others queued"
    for sender in [*senders, holder]:
        sender.join(timeout=300)
    return served
