"""What a failed test of the real-node tier prints: the state of the cluster and of the host
network the real nodes share, so a failure on a machine nobody can log into (CI) still
says whether a Pod did not start, a component died or the host dropped the traffic."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import urllib3
from kubernetes import client, config

from tests.harness.control_plane import ClusterState

LOG_TAIL_LINES = 25
EVENTS = 40
NODE_COMPONENTS = ("kube-proxy", "kubelet", "containerd")
TABLE_LINES = 120
SYSCTLS = (
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/rp_filter",
    "net/bridge/bridge-nf-call-iptables",
)


def _run(command: Sequence[str], limit: int = TABLE_LINES) -> str:
    if not shutil.which(command[0]):
        return f"({command[0]} is not installed)"
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return f"(`{' '.join(command)}` did not answer within 30 s)"
    lines = (result.stdout + result.stderr).splitlines()
    shown = "\n".join(lines[:limit])
    return shown + (f"\n... {len(lines) - limit} more lines" if len(lines) > limit else "")


def _tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    file = Path(path)
    if not file.is_file():
        return "(no log)"
    return "\n".join(file.read_text(errors="replace").splitlines()[-lines:])


def host_network() -> str:
    """Forwarding, filtering and routes of the host the real nodes share."""
    sysctls = []
    for name in SYSCTLS:
        path = Path("/proc/sys") / name
        sysctls.append(f"{name}={path.read_text().strip() if path.exists() else 'absent'}")
    return "\n".join(
        [
            "sysctl: " + " ".join(sysctls),
            "-- ip -4 route",
            _run(["ip", "-4", "route"]),
            "-- iptables -S (filter)",
            _run(["iptables", "-S"]),
            "-- iptables -t nat -S KUBE-SERVICES",
            _run(["iptables", "-t", "nat", "-S", "KUBE-SERVICES"]),
            "-- nft list tables",
            _run(["nft", "list", "tables"]),
        ]
    )


def _pods_and_events(kubeconfig: str) -> list[str]:
    try:
        api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        pods = api.list_pod_for_all_namespaces(timeout_seconds=10).items
        events = api.list_event_for_all_namespaces(timeout_seconds=10).items
    except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as error:
        # The report belongs to a test that failed already: an API server that is down is
        # part of what it reports, not a second failure hiding the first.
        return [f"(the API server did not answer: {error})"]
    lines = ["-- pods"]
    for pod in pods:
        statuses = pod.status.container_statuses or []
        restarts = sum(status.restart_count for status in statuses)
        lines.append(
            f"{pod.metadata.namespace}/{pod.metadata.name} node={pod.spec.node_name} "
            f"phase={pod.status.phase} ip={pod.status.pod_ip} restarts={restarts}"
        )
    events.sort(key=lambda event: str(event.last_timestamp or event.event_time or ""))
    lines.append(f"-- events (last {EVENTS})")
    for event in events[-EVENTS:]:
        involved = event.involved_object
        lines.append(
            f"{event.type} {involved.kind}/{involved.namespace}/{involved.name} "
            f"{event.reason}: {(event.message or '').strip()[:300]}"
        )
    return lines


def cluster_report(state: ClusterState) -> str:
    """Every Pod with its node and phase, recent events, the tail of the logs of the node
    components (kube-proxy, kubelets, containerds) and the host network."""
    sections = _pods_and_events(state.kubeconfig)
    for component in state.components:
        if component.name.split("@")[0] in NODE_COMPONENTS:
            sections += [f"-- {component.name} (last {LOG_TAIL_LINES} lines)", _tail(component.log)]
    sections.append(host_network())
    return "\n".join(sections)
