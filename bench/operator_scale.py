"""The operator under N DiffusionDeployments on the local control plane (kwok GPU nodes).

Creates N deployments of one 1-GPU engine each, with the operator run as a process with
the arguments the chart renders (cluster-wide), and prints:

- the time from the first create until every deployment is Available (followed with one
  watch, as ``kubectl wait`` does);
- the operator's CPU seconds and RSS by then, and each control-plane process's CPU
  seconds (on 2 cores they compete with the operator);
- at steady state (``--settle-s`` after everything is Available, over ``--steady-s``):
  the operator's share of a core, and API requests per second from the API server's
  ``apiserver_request_total``: all of them, and those of the verbs and resources the
  operator uses (kwok's node and Pod status traffic is in the first figure only);
- the API requests from the first create until all are Available, by verb and resource
  (those made at least N/2 times).

    python bench/operator_scale.py --deployments 100 500 1000

Goal (issue 17): 1000 deployments Available in under 60 s on a 2-core machine, and at
steady state API calls per timer period independent of N and under 10% of a core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client, config, watch

from dlo_operator.api import GROUP, PLURAL, VERSION
from dlo_operator.crd import custom_resource_definition
from tests.cluster.helpers import (
    chart_operator_arguments,
    eventually,
    manifest,
    request_totals,
)
from tests.harness.control_plane import ClusterState, down, up
from tests.support.ports import free_port

GPUS_PER_NODE = 8
OPERATOR_RESOURCES = (
    ("GET", "diffusiondeployments"),
    ("PATCH", "diffusiondeployments"),
    ("LIST", "pods"),
    ("POST", "pods"),
    ("LIST", "services"),
    ("POST", "services"),
    ("LIST", "poddisruptionbudgets"),
    ("POST", "poddisruptionbudgets"),
    ("LIST", "networkpolicies"),
    ("POST", "networkpolicies"),
    ("LIST", "jobs"),
    ("POST", "events"),
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def component_cpu_seconds(state: ClusterState) -> dict[str, float]:
    """CPU seconds of each control-plane process (the API server, etcd, kwok, ...): on a
    2-core machine they share the cores with the operator, so this says what bounds the
    time to Available."""
    return {
        component.name: cpu_seconds(component.pid)
        for component in state.components
        if Path(f"/proc/{component.pid}").exists()
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _available(item: dict) -> bool:
    return any(
        c["type"] == "Available" and c["status"] == "True"
        for c in (item.get("status") or {}).get("conditions", [])
    )


def wait_all_available(
    objects: client.CustomObjectsApi, count: int, resource_version: str, timeout_s: float
) -> None:
    """Return once ``count`` deployments are Available, following one watch from
    ``resource_version`` (as ``kubectl wait`` does): polling a LIST of every deployment
    would cost the API server more than some of what is measured."""
    available: set[tuple[str, str]] = set()
    deadline = time.monotonic() + timeout_s
    while len(available) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(available)}/{count} Available after {timeout_s:.0f} s")
        stream = watch.Watch().stream(
            objects.list_cluster_custom_object,
            GROUP,
            VERSION,
            PLURAL,
            resource_version=resource_version,
            timeout_seconds=60,
        )
        for event in stream:
            item = event["object"]
            metadata = item["metadata"]
            resource_version = metadata["resourceVersion"]
            key = (metadata["namespace"], metadata["name"])
            if event["type"] != "DELETED" and _available(item):
                available.add(key)
            else:
                available.discard(key)
            if len(available) == count:
                return


def run_once(count: int, steady_s: float, settle_s: float, work: Path) -> dict:
    nodes = -(-count // GPUS_PER_NODE) + 1
    directory = work / f"cluster-{count}"
    state = up(directory, nodes=nodes, gpus_per_node=GPUS_PER_NODE, progress=lambda _l: None)
    try:
        api = config.new_client_from_config(config_file=state.kubeconfig)
        client.ApiextensionsV1Api(api).create_custom_resource_definition(
            custom_resource_definition()
        )
        time.sleep(3)  # the CRD established and discovered
        port = free_port()
        arguments = chart_operator_arguments(f"livenessPort={port}", f"metrics.port={free_port()}")
        log = (directory / "operator.log").open("w")
        operator = subprocess.Popen(
            [sys.executable, "-m", "dlo_operator", *arguments],
            env={**os.environ, "KUBECONFIG": state.kubeconfig},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            eventually(
                lambda: _healthy(f"http://127.0.0.1:{port}/healthz"), 60, "operator liveness"
            )
            core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
            namespaces = [f"scale-{i}" for i in range(-(-count // 100))]
            for namespace in namespaces:
                core.create_namespace(
                    client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
                )
            listed = objects.list_cluster_custom_object(GROUP, VERSION, PLURAL)
            cpu_before, totals_at_start = cpu_seconds(operator.pid), request_totals(state)
            components_before = component_cpu_seconds(state)
            started = time.monotonic()

            def create(index: int) -> None:
                body = manifest(f"d{index}", gpusPerNode=1, parallelism={"data": 1})
                objects.create_namespaced_custom_object(
                    GROUP, VERSION, namespaces[index // 100], PLURAL, body
                )

            with ThreadPoolExecutor(1) as watcher, ThreadPoolExecutor(8) as creators:
                all_available = watcher.submit(
                    wait_all_available,
                    objects,
                    count,
                    listed["metadata"]["resourceVersion"],
                    1800,
                )
                list(creators.map(create, range(count)))
                created_s = time.monotonic() - started
                all_available.result()
            available_s = time.monotonic() - started
            cpu_to_available = cpu_seconds(operator.pid) - cpu_before
            components_to_available = {
                name: round(seconds - components_before.get(name, 0.0), 1)
                for name, seconds in component_cpu_seconds(state).items()
            }
            rss_at_available = rss_mib(operator.pid)
            to_available = request_totals(state)
            creation = {
                f"{verb} {resource}": round(value - totals_at_start.get((verb, resource), 0.0))
                for (verb, resource), value in sorted(to_available.items())
                if value - totals_at_start.get((verb, resource), 0.0) >= count / 2
            }

            time.sleep(settle_s)  # the passes the creation's own events trigger run out
            totals_before, cpu_steady = request_totals(state), cpu_seconds(operator.pid)
            time.sleep(steady_s)
            totals_after = request_totals(state)
            cpu_share = (cpu_seconds(operator.pid) - cpu_steady) / steady_s
            delta = {k: totals_after[k] - totals_before.get(k, 0.0) for k in totals_after}
            operator_calls = sum(delta.get(key, 0.0) for key in OPERATOR_RESOURCES)
            return {
                "deployments": count,
                "kwok_nodes": nodes,
                "created_s": created_s,
                "available_s": available_s,
                "operator_cpu_s_to_available": cpu_to_available,
                "operator_rss_mib": rss_at_available,
                "control_plane_cpu_s_to_available": components_to_available,
                "requests_to_available": creation,
                "settle_s": settle_s,
                "steady_s": steady_s,
                "steady_operator_core_share": cpu_share,
                "steady_api_requests_per_s": sum(delta.values()) / steady_s,
                "steady_operator_api_requests_per_s": operator_calls / steady_s,
                "steady_operator_requests": {
                    f"{verb} {resource}": delta.get((verb, resource), 0.0) / steady_s
                    for verb, resource in OPERATOR_RESOURCES
                    if delta.get((verb, resource))
                },
            }
        finally:
            operator.terminate()
            operator.wait(timeout=60)
            log.close()
    finally:
        down(directory, progress=lambda _l: None)


def _healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--steady-s", type=float, default=60.0)
    parser.add_argument(
        "--settle-s",
        type=float,
        default=30.0,
        help="Wait this long after all are Available before measuring the steady state.",
    )
    parser.add_argument("--json", type=Path, help="Also write the results as JSON here.")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="dlo-scale-") as work:
        for count in args.deployments:
            row = run_once(count, args.steady_s, args.settle_s, Path(work))
            results.append(row)
            print(
                f"{count} deployments ({row['kwok_nodes']} kwok nodes): created in "
                f"{row['created_s']:.1f} s, all Available after {row['available_s']:.1f} s "
                f"(goal < 60 s for 1000); operator {row['operator_cpu_s_to_available']:.1f} "
                f"CPU s to get there, RSS {row['operator_rss_mib']:.0f} MiB | steady state: "
                f"operator {row['steady_operator_core_share'] * 100:.1f}% of a core "
                f"(goal < 10%), API {row['steady_api_requests_per_s']:.1f} req/s in all, "
                f"{row['steady_operator_api_requests_per_s']:.1f} req/s of the operator's kinds",
                flush=True,
            )
            print(f"  requests until all Available: {row['requests_to_available']}", flush=True)
            print(
                f"  control plane CPU s until all Available: "
                f"{row['control_plane_cpu_s_to_available']}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
