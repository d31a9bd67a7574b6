"""Helpers shared by the cluster tests: waiting, and DiffusionDeployment objects."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client

from dlo_operator.api import GROUP, PLURAL, VERSION
from tests.harness.control_plane import ClusterState, admin_context
from tests.harness.pki import Pki
from tests.support.ports import free_port

CHART = Path(__file__).parents[2] / "charts" / "dlo-operator"
T = TypeVar("T")


def eventually(check: Callable[[], T], timeout_s: float = 60, what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy, and return that; fail naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.5)
    raise AssertionError(f"{what} not met within {timeout_s} s")


def cluster_tool(
    kubeconfig: str, name: str, *args: str, home: Path, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run a built tool (``kubectl``, ``helm``) against the cluster, as a user would; Helm's
    directories go under ``home`` so tests never share or touch the user's."""
    from tests.harness.build import Builder

    env = {
        **os.environ,
        "KUBECONFIG": kubeconfig,
        "HELM_CACHE_HOME": str(home / "c"),
        "HELM_CONFIG_HOME": str(home / "cfg"),
        "HELM_DATA_HOME": str(home / "d"),
    }
    return subprocess.run(
        [str(Builder().bin / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


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


def helm_template(*set_values: str, release: str = "dlo") -> list[dict[str, Any]]:
    """The chart's objects as ``helm template`` renders them (default values + ``--set``)."""
    from tests.harness.build import Builder

    arguments = [str(Builder().bin / "helm"), "template", release, str(CHART)]
    for value in set_values:
        arguments += ["--set", value]
    rendered = subprocess.run(arguments, capture_output=True, text=True, timeout=60, check=True)
    return [item for item in yaml.safe_load_all(rendered.stdout) if item]


def chart_operator_arguments(*set_values: str) -> list[str]:
    """The operator container's arguments from the chart's Deployment."""
    (deployment,) = [item for item in helm_template(*set_values) if item["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


@contextlib.contextmanager
def running_operator(kubeconfig: str, log_path: Path, *set_values: str) -> Iterator[list[str]]:
    """``dlo-operator`` as a process with exactly the arguments the chart renders.

    ``set_values`` are chart values (``helm --set``); none means the default install
    (every namespace). The liveness and metrics ports are the values always set, to free
    ports. Yields the arguments.
    """
    port = free_port()
    arguments = chart_operator_arguments(
        f"livenessPort={port}", f"metrics.port={free_port()}", *set_values
    )
    url = f"http://127.0.0.1:{port}/healthz"
    with log_path.open("a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "dlo_operator", *arguments],
            env={**os.environ, "KUBECONFIG": kubeconfig},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def started() -> bool:
            if process.poll() is not None:
                tail = log_path.read_text()[-3000:]
                raise AssertionError(f"dlo-operator {arguments} exited: {tail}")
            return _healthy(url)

        try:
            eventually(started, 60, "operator liveness endpoint")
            yield arguments
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def operator_metrics(arguments: list[str]) -> str:
    """The text of the running operator's ``/metrics`` (its port from ``arguments``)."""
    (port,) = [a.split("=", 1)[1] for a in arguments if a.startswith("--metrics-port=")]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def events(api_client, namespace: str, name: str, kind: str = "DiffusionDeployment") -> list[str]:
    """Reasons of the Events about one object (children may share its name), one per post."""
    found = client.CoreV1Api(api_client).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind={kind}"
    )
    return [event.reason for event in found.items for _ in range(event.count or 1)]


_REQUEST_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$")


def request_totals(state: ClusterState) -> dict[tuple[str, str], float]:
    """The API server's ``apiserver_request_total`` summed by (verb, resource), read with
    the admin certificate of the local control plane ``state``."""
    context = admin_context(Pki(Path(state.directory) / "pki"))
    text = urllib.request.urlopen(f"{state.server}/metrics", context=context).read().decode()
    totals: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if match := _REQUEST_SAMPLE.match(line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
            key = (labels.get("verb", ""), labels.get("resource", ""))
            totals[key] = totals.get(key, 0.0) + float(match["value"])
    return totals
