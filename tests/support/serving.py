"""Running ``dlo-worker serve`` as a user does: a subprocess, real HTTP, PNG digests."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
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
