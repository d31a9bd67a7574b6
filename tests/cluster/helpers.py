"""Helpers shared by the cluster tests: waiting, and DiffusionDeployment objects."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client

from dlo_operator.api import GROUP, PLURAL, VERSION
from tests.support.ports import free_port


def eventually(check: Callable[[], bool], timeout_s: float = 60, what: str = "condition") -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} not met within {timeout_s} s")


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    base = {
        "model": {"hostPath": "/models/flux"},
        "worker": {"image": "dlo-worker:0.1"},
        "gpusPerNode": 2,
        "parallelism": {"data": 2},
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DiffusionDeployment",
        "metadata": {"name": name},
        "spec": {**base, **spec},
    }


def create(api_client, namespace: str, body: dict) -> dict:
    objects = client.CustomObjectsApi(api_client)
    created: dict = {}

    def attempt() -> bool:
        try:
            created.update(
                objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
            )
        except client.ApiException as error:
            if error.status == 404:  # discovery still catching up with a new CRD
                return False
            raise
        return True

    eventually(attempt, 30)
    return created


def _healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_operator(kubeconfig: str, namespace: str, log_path: Path) -> Iterator[str]:
    """``dlo-operator`` watching ``namespace`` as a process; yields its liveness URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/healthz"
    with log_path.open("a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "dlo_operator", "--namespace", namespace, "--liveness", url],
            env={**os.environ, "KUBECONFIG": kubeconfig},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            eventually(lambda: _healthy(url), 60, "operator liveness endpoint")
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
