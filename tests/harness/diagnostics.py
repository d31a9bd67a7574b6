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
EVENTS = 25
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
    """Forwarding, addresses, routes and filtering of the host the real nodes share."""
    sysctls = []
    for name in SYSCTLS:
        path = Path("/proc/sys") / name
        sysctls.append(f"{name}={path.read_text().strip() if path.exists() else 'absent'}")
    return "\n".join(
        [
            "sysctl: " + " ".join(sysctls),
            "-- ip -4 -brief address",
            _run(["ip", "-4", "-brief", "address"]),
            "-- ip -4 route show table all (broadcast aside)",
            _run(["sh", "-c", "ip -4 route show table all | grep -v '^broadcast'"]),
            "-- iptables -S (filter)",
            _run(["iptables", "-S"]),
            "-- iptables -t nat -S KUBE-SERVICES",
            _run(["iptables", "-t", "nat", "-S", "KUBE-SERVICES"]),
            "-- nft list tables",
            _run(["nft", "list", "tables"]),
        ]
    )


def pod_network(state: ClusterState) -> str:
    """The pod network, and each node's pod CIDR and bridge."""
    lines = [f"pod network {state.pod_network or '(none recorded)'}"]
    lines += [f"{plan.name}: {plan.pod_cidr} on {plan.bridge}" for plan in state.node_plans()]
    return "\n".join(lines)


def _route(address: str) -> str:
    """Where this host sends packets for ``address`` (``ip route get``'s first line)."""
    return _run(["ip", "-4", "route", "get", address], limit=1)


def _pods_and_events(kubeconfig: str) -> list[str]:
    try:
        api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        pods = api.list_pod_for_all_namespaces(timeout_seconds=10).items
        events = api.list_event_for_all_namespaces(timeout_seconds=10).items
    except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as error:
        # The report belongs to a test that failed already: an API server that is down is
        # part of what it reports, not a second failure hiding the first.
        return [f"(the API server did not answer: {error})"]
    lines = ["-- pods (and where the host routes their address)"]
    for pod in pods:
        statuses = pod.status.container_statuses or []
        restarts = sum(status.restart_count for status in statuses)
        route = f" route: {_route(pod.status.pod_ip)}" if pod.status.pod_ip else ""
        lines.append(
            f"{pod.metadata.namespace}/{pod.metadata.name} node={pod.spec.node_name} "
            f"phase={pod.status.phase} ip={pod.status.pod_ip} restarts={restarts}{route}"
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


def cluster_report(state: ClusterState, *, full: bool = True) -> str:
    """The pod network, every Pod with its node, phase and route, recent events, then (when
    ``full``) the host network and the tail of the node components' logs (kube-proxy,
    kubelets, containerds). What most often explains a failure comes first: a CI record
    keeps only part of a long output."""
    sections = [pod_network(state), *_pods_and_events(state.kubeconfig)]
    if full:
        sections.append(host_network())
        for component in state.components:
            if component.name.split("@")[0] in NODE_COMPONENTS:
                sections += [
                    f"-- {component.name} (last {LOG_TAIL_LINES} lines)",
                    _tail(component.log),
                ]
    return "\n".join(sections)
