"""A real control plane on loopback: etcd, kube-apiserver, controller-manager, scheduler, kwok.

``up`` starts every component in the background (own process sessions, logs in
the cluster directory), waits until the apiserver is ready and the fake GPU nodes
report Ready, and records the processes in ``cluster.json``; ``down`` stops them
in reverse order and leaves nothing running. Both are idempotent. The pytest
fixtures call the same functions.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.harness import babysitter, nodes
from tests.harness import pki as pki_module
from tests.harness.build import NODE_BINARIES, Builder, cache_root
from tests.harness.nodes import choose_pod_network, host_address, host_networks
from tests.support.ports import free_port

STATE_FILE = "cluster.json"
LOOPBACK = "127.0.0.1"
SERVICE_CIDR = "10.0.0.0/16"
"""ClusterIPs: room for thousands of Services (the ``kubernetes`` Service takes 10.0.0.1,
``kube-dns`` 10.0.0.10); tests that exhaust the range pass a small one."""
GPU_RESOURCE = "nvidia.com/gpu"
FAKE_NODE_LABEL = ("type", "kwok")

Progress = Callable[[str], None]


class ClusterError(RuntimeError):
    """A component did not start or become ready; the message names its log."""


@dataclass
class Component:
    name: str
    pid: int
    started: str
    """The process start time from /proc, so a recycled pid is never signalled."""
    log: str
    command: list[str] = field(default_factory=list)
    """What started it, so :func:`restart` can start it again."""


@dataclass
class ClusterState:
    directory: str
    kubeconfig: str
    server: str
    components: list[Component]
    real_nodes: list[dict] = field(default_factory=list)
    """The :class:`~tests.harness.nodes.NodePlan` of each real node (``down`` cleans them)."""
    pod_network: str = ""
    """The real nodes' pod network (:func:`~tests.harness.nodes.choose_pod_network`), each
    node's pod CIDR a /24 of it; empty without real nodes."""
    owner: list[str] = field(default_factory=list)
    """The pid and start time of the process the cluster lives and dies with (a test
    session): once that process is gone, the next :func:`up` stops what it left. Empty for
    a cluster people start by hand, which runs until ``down``."""

    def node_plans(self) -> list[nodes.NodePlan]:
        return [nodes.NodePlan.from_record(record) for record in self.real_nodes]

    @classmethod
    def load(cls, directory: Path) -> ClusterState | None:
        return cls._read(directory / STATE_FILE)

    @classmethod
    def _read(cls, path: Path) -> ClusterState | None:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        raw["components"] = [Component(**item) for item in raw["components"]]
        return cls(**raw)

    @property
    def registration(self) -> Path:
        """Where an owned cluster is recorded outside its directory, so it can be found
        (and stopped) after its owner was killed and its directory deleted."""
        return registry() / f"{nodes.cluster_id(Path(self.directory))}.json"

    def save(self) -> None:
        text = json.dumps(asdict(self), indent=2)
        paths = [Path(self.directory) / STATE_FILE]
        if self.owner:
            self.registration.parent.mkdir(parents=True, exist_ok=True)
            paths.append(self.registration)
        for path in paths:
            temporary = path.with_suffix(".tmp")
            temporary.write_text(text)
            os.replace(temporary, path)

    def abandoned(self) -> bool:
        """Owned by a process that is gone."""
        pid, started = self.owner
        return _start_time(int(pid)) != started


def registry() -> Path:
    return cache_root() / "clusters"


def default_directory() -> Path:
    return Path(os.environ.get("DLO_CLUSTER_DIR") or cache_root() / "run")


def _stat_fields(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[19] if len(fields) > 19 else None


def is_running(component: Component) -> bool:
    """Running (not a zombie) and still the process we started."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(component.pid, os.WNOHANG)  # reap it if it is our exited child
    fields = _stat_fields(component.pid)
    return len(fields) > 19 and fields[0] != "Z" and fields[19] == component.started


def _wait(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    log: Path | None,
    explain: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition``; on timeout raise with the last errors of ``log`` and what
    ``explain`` says (a CI record shows the exception, not the log files)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if condition():
                return
        time.sleep(0.5)
    hint = f"; see {log}" if log else ""
    details = ""
    if log is not None and log.is_file():
        details = f"\nlast errors of {log.name}:\n{log_excerpt(log.read_text(errors='replace'))}"
    if explain is not None:
        try:
            details += "\n" + explain()
        except Exception as error:  # the report must not hide the timeout
            details += f"\n(no details: {error!r})"
    raise ClusterError(f"{what} not ready after {timeout_s:.0f} s{hint}{details}")


def log_excerpt(text: str, lines: int = 12, width: int = 300) -> str:
    """The last errors of a klog log (``E``/``F`` lines) and babysitter restarts, or its
    last lines when it has none: what a report needs to say why a component is not ready."""
    every = text.splitlines()
    notable = [
        line
        for line in every
        if line.startswith(babysitter.RESTART_MARK)
        or (len(line) > 5 and line[0] in "EF" and line[1:5].isdigit())
    ]
    chosen = (notable or every)[-lines:]
    return "\n".join(f"    {line[:width]}" for line in chosen)


def kubeconfig_document(server: str, pki: pki_module.Pki) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "dlo",
                "cluster": {"server": server, "certificate-authority": str(pki.ca_cert)},
            }
        ],
        "users": [
            {
                "name": "dlo-admin",
                "user": {
                    "client-certificate": str(pki.admin_cert),
                    "client-key": str(pki.admin_key),
                },
            }
        ],
        "contexts": [{"name": "dlo", "context": {"cluster": "dlo", "user": "dlo-admin"}}],
        "current-context": "dlo",
    }


class _Launcher:
    """Starts the components of ``state``, recording each in it (and on disk) as it starts,
    so a run killed halfway leaves a record of what to stop."""

    def __init__(self, state: ClusterState, bin_dir: Path) -> None:
        self.state = state
        self.directory = Path(state.directory)
        self.bin = bin_dir

    def start(
        self,
        name: str,
        arguments: list[str],
        executable: str | None = None,
        *,
        supervised: bool = False,
    ) -> Path:
        """Start ``name`` (from the bin directory, or ``executable``) in its own session;
        ``supervised``: under :mod:`tests.harness.babysitter`, which restarts it whenever it
        exits (the node agents: a stock node's systemd does the same)."""
        log = self.directory / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        command = [executable or str(self.bin / name.split("@", maxsplit=1)[0]), *arguments]
        if supervised:
            command = [sys.executable, babysitter.__file__, "--", *command]
        self.state.components.append(_spawn(name, command, log, self.directory))
        self.state.save()
        return log


def _spawn(name: str, command: list[str], log: Path, directory: Path) -> Component:
    with log.open("ab") as stream:
        process = subprocess.Popen(
            command,
            stdout=stream,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=directory,
        )
    time.sleep(0.05)
    return Component(name, process.pid, _start_time(process.pid) or "", str(log), command)


def _stop(component: Component, timeout_s: float = 15) -> None:
    """SIGTERM the component's process group, SIGKILL it after ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(component.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while is_running(component) and time.monotonic() < deadline:
        time.sleep(0.1)
    if is_running(component):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(component.pid, signal.SIGKILL)


def restart(state: ClusterState, name: str, *, down_s: float = 0.0) -> None:
    """Stop the component ``name`` and start it again with the same command after
    ``down_s`` seconds (the kube-apiserver: waits until it is ready again)."""
    index = next(i for i, c in enumerate(state.components) if c.name == name)
    component = state.components[index]
    _stop(component)
    time.sleep(down_s)
    directory = Path(state.directory)
    state.components[index] = _spawn(name, component.command, Path(component.log), directory)
    state.save()
    if name == "kube-apiserver":
        _wait_api_server_ready(state.server, pki_module.Pki(directory / "pki"), Path(component.log))


def admin_context(pki: pki_module.Pki) -> ssl.SSLContext:
    """TLS as the cluster's admin: trusts the cluster CA, presents the admin certificate."""
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
    return context


def _wait_api_server_ready(server: str, pki: pki_module.Pki, log: Path) -> None:
    context = admin_context(pki)
    _wait(
        lambda: (
            urllib.request.urlopen(f"{server}/readyz", context=context, timeout=5).status == 200
        ),
        180,
        "kube-apiserver",
        log,
    )


def up(
    directory: Path | None = None,
    *,
    nodes: int = 3,
    gpus_per_node: int = 8,
    real_nodes: int = 0,
    service_cidr: str = SERVICE_CIDR,
    build: bool = True,
    owned: bool = False,
    progress: Progress = print,
) -> ClusterState:
    """Start the control plane (or return the one already running in ``directory``), with
    ``nodes`` fake GPU nodes and ``real_nodes`` real ones (:mod:`tests.harness.nodes`).

    ``build``: build the binaries and images it lacks and import them into the node stores
    (minutes on a fresh machine). The test fixtures pass False: the test command prepares
    everything before pytest, and a cluster that finds something missing refuses at once,
    naming the command that makes it, instead of building under a test's timeout.

    ``owned``: the cluster lives as long as the calling process (a test session); a later
    ``up`` stops it once that process is gone, with whatever else a killed run left."""
    directory = (directory or default_directory()).resolve()
    reap_abandoned(progress)
    existing = ClusterState.load(directory)
    if existing and all(is_running(component) for component in existing.components):
        progress(f"cluster already running: {existing.kubeconfig}")
        return existing
    if existing:
        down(directory, progress=progress)
    builder = Builder(progress=progress)
    node_binaries = NODE_BINARIES if real_nodes else ()
    if not build and (missing := builder.missing(node_binaries)):
        flag = " --real-nodes" if real_nodes else ""
        raise ClusterError(
            f"{', '.join(missing)} not built: run `python -m tests.cluster build{flag}` first "
            "(the test command does)"
        )
    bin_dir = builder.ensure(node_binaries)
    for stale in ("etcd-data", "pki"):
        shutil.rmtree(directory / stale, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    # Pods on real nodes call the apiserver through the kubernetes Service, whose endpoint
    # is the advertised address: the host's, not loopback.
    address = host_address() if real_nodes else LOOPBACK
    # Chosen before anything starts: a host with no free pod network refuses at once.
    pod_network = choose_pod_network(host_networks(), service_cidr) if real_nodes else None
    pki = pki_module.generate(directory / "pki", serving_ips=(address,))
    state = ClusterState(str(directory), "", "", [], owner=_owner() if owned else [])
    state.save()
    launcher = _Launcher(state, bin_dir)
    try:
        _start_components(
            state, pki, launcher, address=address, service_cidr=service_cidr, progress=progress
        )
        _register_fake_nodes(state, nodes, gpus_per_node, progress)
        if pod_network is not None:
            state.pod_network = str(pod_network)
            _start_real_nodes(state, launcher, real_nodes, build, progress)
    except BaseException:
        down(directory, progress=progress)
        raise
    return state


def _owner() -> list[str]:
    return [str(os.getpid()), _start_time(os.getpid()) or ""]


def reap_abandoned(progress: Progress = print) -> None:
    """Stop the clusters whose owner is gone (a test run that was killed): their
    components, containers, mounts, cgroups and bridges, and the record of them."""
    for record in sorted(registry().glob("*.json")) if registry().is_dir() else []:
        state = ClusterState._read(record)
        if state is None or not state.owner:
            record.unlink(missing_ok=True)
        elif state.abandoned():
            progress(f"stopping the cluster a killed run left in {state.directory}")
            _take_down(state, progress)


def _start_components(
    state: ClusterState,
    pki: pki_module.Pki,
    launcher: _Launcher,
    *,
    address: str,
    service_cidr: str,
    progress: Progress,
) -> None:
    directory = Path(state.directory)
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    progress("starting etcd")
    log = launcher.start(
        "etcd",
        [
            "--name",
            "dlo",
            "--data-dir",
            str(directory / "etcd-data"),
            "--listen-client-urls",
            etcd_url,
            "--advertise-client-urls",
            etcd_url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-cluster",
            f"dlo=http://127.0.0.1:{peer_port}",
            "--log-level",
            "warn",
            "--unsafe-no-fsync",
        ],
    )
    _wait(
        lambda: urllib.request.urlopen(f"{etcd_url}/health", timeout=2).status == 200,
        60,
        "etcd",
        log,
    )

    server = f"https://127.0.0.1:{api_port}"
    progress("starting kube-apiserver")
    log = launcher.start(
        "kube-apiserver",
        [
            "--etcd-servers",
            etcd_url,
            "--bind-address",
            LOOPBACK if address == LOOPBACK else "0.0.0.0",
            "--advertise-address",
            address,
            "--secure-port",
            str(api_port),
            "--authorization-mode",
            "RBAC",
            "--client-ca-file",
            str(pki.ca_cert),
            "--tls-cert-file",
            str(pki.serving_cert),
            "--tls-private-key-file",
            str(pki.serving_key),
            "--service-account-key-file",
            str(pki.service_account_public_key),
            "--service-account-signing-key-file",
            str(pki.service_account_key),
            "--service-account-issuer",
            "https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range",
            service_cidr,
            "--cert-dir",
            str(directory / "pki"),
            "--profiling=false",
            "--allow-privileged=true",
            # Real nodes are named, not resolvable: logs and exec go to their address.
            "--kubelet-preferred-address-types",
            "InternalIP,Hostname",
        ],
    )
    _wait_api_server_ready(server, pki, log)

    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(json.dumps(kubeconfig_document(server, pki), indent=2))
    common = [
        "--kubeconfig",
        str(kubeconfig),
        "--authentication-kubeconfig",
        str(kubeconfig),
        "--authorization-kubeconfig",
        str(kubeconfig),
        "--leader-elect=false",
        "--bind-address",
        "127.0.0.1",
    ]
    progress("starting kube-controller-manager and kube-scheduler")
    launcher.start(
        "kube-controller-manager",
        [
            *common,
            "--secure-port",
            str(free_port()),
            "--service-account-private-key-file",
            str(pki.service_account_key),
            "--root-ca-file",
            str(pki.ca_cert),
            "--use-service-account-credentials=false",
            "--controllers",
            "*",
            # kwok plays a fake node's kubelet only once: a node marked NotReady while
            # the API server restarts (its lease could not be renewed) has its Pods set
            # Ready=False for good, where a real kubelet would report them Ready again.
            # Tests that restart the API server are about the operator, not node health.
            "--node-monitor-grace-period",
            "10m",
        ],
    )
    launcher.start("kube-scheduler", [*common, "--secure-port", str(free_port())])
    progress("starting kwok")
    launcher.start(
        "kwok",
        [
            "--kubeconfig",
            str(kubeconfig),
            "--manage-all-nodes=false",
            "--manage-nodes-with-label-selector",
            "=".join(FAKE_NODE_LABEL),
            # No Stage given: kwok applies its built-in fast stages (node-initialize,
            # node heartbeat via leases, pod-ready, pod-complete, pod-delete).
            "--node-lease-duration-seconds",
            "40",
            "--server-address",
            f"127.0.0.1:{free_port()}",
        ],
    )
    state.kubeconfig, state.server = str(kubeconfig), server
    state.save()


def _register_fake_nodes(
    state: ClusterState, nodes: int, gpus_per_node: int, progress: Progress
) -> None:
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(config_file=state.kubeconfig))
    capacity = {
        "cpu": "64",
        "memory": "512Gi",
        "ephemeral-storage": "1Ti",
        "pods": "110",
        GPU_RESOURCE: str(gpus_per_node),
    }
    for index in range(nodes):
        name = f"dlo-gpu-{index}"
        body = client.V1Node(
            metadata=client.V1ObjectMeta(
                name=name,
                labels={
                    FAKE_NODE_LABEL[0]: FAKE_NODE_LABEL[1],
                    "kubernetes.io/hostname": name,
                    "nvidia.com/gpu.present": "true",
                },
                annotations={"node.alpha.kubernetes.io/ttl": "0"},
            ),
            status=client.V1NodeStatus(capacity=capacity, allocatable=capacity),
        )
        with contextlib.suppress(client.ApiException):
            api.create_node(body)
    progress(f"waiting for {nodes} fake GPU nodes to be Ready")
    kwok_log = Path(next(c.log for c in state.components if c.name == "kwok"))

    def all_ready() -> bool:
        ready = 0
        for node in api.list_node(label_selector="=".join(FAKE_NODE_LABEL)).items:
            conditions = {c.type: c.status for c in node.status.conditions or []}
            ready += conditions.get("Ready") == "True"
        return ready == nodes

    _wait(all_ready, 120, "fake nodes", kwok_log)


def down(directory: Path | None = None, *, progress: Progress = print) -> None:
    """Stop every recorded component, newest first; idempotent."""
    directory = (directory or default_directory()).resolve()
    state = ClusterState.load(directory)
    if state is not None:
        _take_down(state, progress)


def _take_down(state: ClusterState, progress: Progress) -> None:
    plans = {plan.name: plan for plan in state.node_plans()}
    for component in reversed(state.components):
        if not is_running(component):
            continue
        kind, _, node = component.name.partition("@")
        if kind == "containerd" and node in plans:
            # The kubelet has stopped; the store is kept for its images, not its containers.
            with contextlib.suppress(Exception):
                nodes.remove_containers(plans[node].socket)
        progress(f"stopping {component.name}")
        _stop(component)
    for plan in plans.values():
        progress(f"cleaning real node {plan.index}")
        nodes.clean_node(plan)
    (Path(state.directory) / STATE_FILE).unlink(missing_ok=True)
    state.registration.unlink(missing_ok=True)


def _start_cluster_dns(
    state: ClusterState, launcher: _Launcher, address: str, progress: Progress
) -> None:
    """CoreDNS on the host, and the kube-dns Service the kubelets name as nameserver."""
    from kubernetes import client, config

    port = free_port()
    corefile = Path(state.directory) / "Corefile"
    corefile.write_text(nodes.corefile(address, port, state.kubeconfig))
    progress("starting CoreDNS (cluster DNS of the real nodes)")
    log = launcher.start("coredns", ["-conf", str(corefile)])
    _wait(lambda: _tcp_open(address, port), 60, "CoreDNS", log)
    api = config.new_client_from_config(config_file=state.kubeconfig)
    service, endpoints = nodes.dns_service(address, port)
    client.CoreV1Api(api).create_namespaced_service("kube-system", service)
    client.DiscoveryV1Api(api).create_namespaced_endpoint_slice("kube-system", endpoints)


def _tcp_open(address: str, port: int) -> bool:
    with socket.create_connection((address, port), timeout=1):
        return True


def _start_real_nodes(
    state: ClusterState, launcher: _Launcher, count: int, build: bool, progress: Progress
) -> None:
    """containerd and a kubelet per node (on the node stores, which hold the images), then
    wait until Ready; each node's pod CIDR is a /24 of ``state.pod_network``."""
    from kubernetes import client, config

    from tests.harness import node_stores
    from tests.harness.images import ImageBuilder

    builder = ImageBuilder(progress=progress)
    images = builder.expected()
    references = {image.reference: image.archive for image in images.values()}
    if not build and (
        builder.missing()
        or nodes.missing_runtime()
        or not node_stores.ready(count, list(references))
    ):
        raise ClusterError(
            f"the images are not built or not in {count} node stores: run "
            f"`python -m tests.cluster images --real-nodes {count}` first (the test command does)"
        )
    images = builder.ensure()
    stores = node_stores.prepare(count, references, progress)
    directory = Path(state.directory)
    address = nodes.host_address()
    _start_cluster_dns(state, launcher, address, progress)
    for index in range(count):
        plan = nodes.NodePlan(
            index,
            nodes.cluster_id(directory),
            directory,
            free_port(),
            free_port(),
            nodes.node_pod_cidr(ipaddress.IPv4Network(state.pod_network), index),
            stores[index],
        )
        nodes.clean_node(plan)  # what a killed earlier run left
        state.real_nodes.append(plan.record())
        state.save()
        nodes.make_cgroup_parent(plan)
        containerd_toml, kubelet_json = nodes.write_node_files(plan, images["pause"].reference)
        progress(f"starting containerd for {plan.name}")
        log = launcher.start(
            f"containerd@{plan.name}",
            ["--config", str(containerd_toml)],
            executable=shutil.which("containerd"),
            supervised=True,
        )
        _wait(
            lambda plan=plan: nodes.containerd_answers(plan.socket),
            60,
            f"containerd of {plan.name}",
            log,
        )
        if removed := nodes.remove_containers(plan.socket):
            # What a killed earlier cluster left in the kept store: a new node starts with
            # none, and the CRI plugin reads its containers only when containerd starts.
            progress(f"removed {removed} containers an earlier cluster left on {plan.name}")
            restart(state, f"containerd@{plan.name}")
            _wait(
                lambda plan=plan: nodes.containerd_answers(plan.socket),
                60,
                f"containerd of {plan.name}",
                log,
            )
        progress(f"starting the kubelet of {plan.name}")
        launcher.start(
            f"kubelet@{plan.name}",
            [
                "--config",
                str(kubelet_json),
                "--kubeconfig",
                state.kubeconfig,
                "--root-dir",
                str(plan.root / "kubelet"),
                "--hostname-override",
                plan.name,
                "--node-labels",
                "=".join(nodes.REAL_NODE_LABEL),
                "--node-ip",
                address,
            ],
            supervised=True,
        )
    progress(
        f"starting kube-proxy (iptables; one for the host the real nodes share; "
        f"pod network {state.pod_network})"
    )
    launcher.start(
        "kube-proxy",
        [
            "--kubeconfig",
            state.kubeconfig,
            "--hostname-override",
            "dlo-real-0",
            "--proxy-mode",
            "iptables",
            "--cluster-cidr",
            state.pod_network,
            # Pods of one bridge reach a Service backed by a Pod of the same bridge through
            # the host: masquerading makes the reply come back the same way.
            "--masquerade-all",
            "--conntrack-max-per-core",
            "0",
            "--metrics-bind-address",
            f"127.0.0.1:{free_port()}",
            "--healthz-bind-address",
            f"127.0.0.1:{free_port()}",
        ],
        supervised=True,
    )
    api = client.CoreV1Api(config.new_client_from_config(config_file=state.kubeconfig))

    def all_ready() -> bool:
        ready = 0
        for node in api.list_node(label_selector="=".join(nodes.REAL_NODE_LABEL)).items:
            conditions = {c.type: c.status for c in node.status.conditions or []}
            ready += conditions.get("Ready") == "True"
        return ready == count

    def explain() -> str:
        """Per node: its Ready condition, whether its kubelet runs, how often it was
        restarted, and the last errors of its log."""
        found = {
            node.metadata.name: node
            for node in api.list_node(label_selector="=".join(nodes.REAL_NODE_LABEL)).items
        }
        parts = []
        for component in state.components:
            if not component.name.startswith("kubelet@"):
                continue
            name = component.name.split("@", 1)[1]
            ready = (
                next((c for c in (found[name].status.conditions or []) if c.type == "Ready"), None)
                if name in found
                else None
            )
            condition = (
                f"Ready={ready.status} ({ready.reason}: {ready.message})"
                if ready
                else "no Node object"
            )
            text = Path(component.log).read_text(errors="replace")
            restarts = text.count(babysitter.RESTART_MARK)
            running = "running" if is_running(component) else "exited"
            parts.append(
                f"  {name}: {condition}; babysitter {running}, kubelet restarted {restarts} "
                f"times; last errors of {component.log}:\n{log_excerpt(text)}"
            )
        return "\n".join(parts)

    _wait(all_ready, 180, f"{count} real nodes", None, explain)
