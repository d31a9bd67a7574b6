"""Real nodes on this machine, opt-in: per node a containerd (runc, overlayfs snapshots), a
CNI bridge with host-local addresses, and a kubelet, all as processes of the cluster.

Every node gets its own containerd (a kubelet garbage-collects whatever its runtime
shows, so two kubelets must not share one), state and socket directory, kubelet root
directory and ports, cgroup parent (``/dlo-<cluster>-<node>`` in every cgroup v1
controller, created here) and bridge with its own pod CIDR (the ``i``-th /24 of the pod
network :func:`choose_pod_network` picks, ``10.244.<i>.0/24`` on most hosts). The
images come from :mod:`tests.harness.images` as OCI archives, imported into each node's
containerd, so no registry is needed; the sandbox ("pause") image is the base image
sleeping. What this machine needs that a stock node would not:

- ``restrict_oom_score_adj``: the machine's root lacks ``CAP_SYS_RESOURCE``, so runc
  cannot lower a sandbox's OOM score to the -998 the CRI asks for;
- runc, not crun: crun refuses cgroup v1 hierarchies while cgroup v2 holds a controller.

The nodes share the host's network: it routes between the bridges, one kube-proxy
(iptables) serves Services for all of them, and one CoreDNS on the host answers for
``cluster.local`` behind the ``kube-dns`` Service (:data:`DNS_SERVICE_IP`, an
EndpointSlice naming the host), which is the nameserver every kubelet gives its Pods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.harness.build import BuildError, Progress

CGROUP_ROOT = Path("/sys/fs/cgroup")
REAL_NODE_LABEL = ("dlo.dev/node", "real")
RUNTIME_PACKAGES = {"containerd": "containerd", "ctr": "containerd"}
DNS_SERVICE_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
CNI_PLUGINS = Path("/usr/lib/cni")
"""Where Debian's containernetworking-plugins installs bridge, host-local, loopback."""
POD_NETWORK_CANDIDATES = tuple(
    ipaddress.IPv4Network(network)
    for network in (
        *(f"10.{second}.0.0/16" for second in range(244, 256)),
        *(f"172.{second}.0.0/16" for second in range(16, 32)),
        "192.168.0.0/16",
    )
)
"""Pod networks to choose from, in order: flannel's default first, then private ranges."""
NODE_PREFIX = 24
"""Each node's pod CIDR: one /24 of the pod network (what a stock controller-manager
allocates), its bridge holding the first address."""


class NetworkError(BuildError):
    """No pod network is free on this host; the message names what occupies them."""


def choose_pod_network(
    occupied: list[ipaddress.IPv4Network], service_cidr: str
) -> ipaddress.IPv4Network:
    """The first candidate pod network that overlaps no network the host already has an
    address or a route in, nor the Service range.

    The nodes' bridges add connected routes for their pod CIDRs; where the host already
    routes one of them elsewhere (a CI runner that is itself a Pod of a flannel cluster
    holds an address in 10.244.<n>.0/24), the older route wins, the host's replies to that
    bridge's Pods leave by the wrong interface and every connection to them ends in "no
    route to host"."""
    taken = [*occupied, ipaddress.IPv4Network(service_cidr)]
    for candidate in POD_NETWORK_CANDIDATES:
        if not any(candidate.overlaps(network) for network in taken):
            return candidate
    blocking = sorted(
        {str(network) for network in taken if any(map(network.overlaps, POD_NETWORK_CANDIDATES))}
    )
    raise NetworkError(
        f"no pod network is free on this host: each of the {len(POD_NETWORK_CANDIDATES)} "
        "candidates (10.244-255.0.0/16, 172.16-31.0.0/16, 192.168.0.0/16) overlaps one of "
        f"{', '.join(blocking)} (the host's addresses and routes, `ip -4 route show table "
        "all`, and the Service range); free one of them"
    )


def node_pod_cidr(pod_network: ipaddress.IPv4Network, index: int) -> str:
    """Node ``index``'s pod CIDR: the ``index``-th /24 of ``pod_network``."""
    return str(next(itertools.islice(pod_network.subnets(new_prefix=NODE_PREFIX), index, None)))


def host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this host has an address in or a route to (the default route,
    broadcast and multicast routes aside), in every routing table, from ``ip -json``."""
    addresses = json.loads(_ip("-4", "address", "show"))
    routes = json.loads(_ip("-4", "route", "show", "table", "all"))
    networks = [
        ipaddress.IPv4Interface(f"{info['local']}/{info['prefixlen']}").network
        for link in addresses
        for info in link.get("addr_info", [])
        if "local" in info
    ]
    for route in routes:
        destination = route.get("dst", "default")
        if destination != "default" and route.get("type") not in ("broadcast", "multicast"):
            networks.append(ipaddress.IPv4Network(destination, strict=False))
    return networks


def _ip(*arguments: str) -> str:
    command = ["ip", "-json", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetworkError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")
    return result.stdout or "[]"


@dataclass(frozen=True)
class NodePlan:
    """Everything one real node is configured with (pure data)."""

    index: int
    cluster_id: str
    directory: Path
    kubelet_port: int
    healthz_port: int
    pod_cidr: str
    """The node's pod addresses (:func:`node_pod_cidr`); its bridge holds the first."""
    store: Path
    """containerd's root (images, snapshots): kept across clusters under the cluster cache,
    one per node index, so a worker image of several GB is imported once and the temporary
    directories of earlier test runs do not each hold copies."""

    @classmethod
    def from_record(cls, record: dict) -> NodePlan:
        """The plan ``ClusterState.real_nodes`` recorded as JSON (:meth:`record`)."""
        return cls(
            **{**record, "directory": Path(record["directory"]), "store": Path(record["store"])}
        )

    def record(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "directory": str(self.directory),
            "store": str(self.store),
        }

    @property
    def name(self) -> str:
        return f"dlo-real-{self.index}"

    @property
    def bridge(self) -> str:
        return f"dlo{self.cluster_id[:6]}br{self.index}"

    @property
    def cgroup_parent(self) -> str:
        return f"/dlo-{self.cluster_id[:8]}-{self.index}"

    @property
    def root(self) -> Path:
        return self.directory / "nodes" / self.name

    @property
    def pod_logs(self) -> Path:
        """The containers' log files (``/var/log/pods`` on a stock node)."""
        return self.root / "pod-logs"

    @property
    def run_directory(self) -> Path:
        """containerd's state and sockets: short paths (unix sockets allow 108 bytes)."""
        return Path("/run") / f"dlo-{self.cluster_id[:8]}" / str(self.index)

    @property
    def socket(self) -> Path:
        return self.run_directory / "containerd.sock"


def cluster_id(directory: Path) -> str:
    return hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:12]


def containerd_config(plan: NodePlan, sandbox_image: str) -> str:
    """containerd's TOML (version 2 schema, containerd 1.6)."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join(
        [
            "version = 2",
            f'root = "{plan.store}"',
            f'state = "{plan.run_directory / "state"}"',
            "[grpc]",
            f'  address = "{plan.socket}"',
            "[debug]",
            '  level = "warn"',
            f"[{cri}]",
            f'  sandbox_image = "{sandbox_image}"',
            "  restrict_oom_score_adj = true",
            f"[{cri}.containerd]",
            '  snapshotter = "overlayfs"',
            f"[{cri}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]",
            "  SystemdCgroup = false",
            f"[{cri}.cni]",
            f'  bin_dir = "{CNI_PLUGINS}"',
            f'  conf_dir = "{plan.root / "cni"}"',
            "",
        ]
    )


def cni_config(plan: NodePlan) -> dict:
    """A bridge with host-local addresses from the node's pod CIDR; the host routes
    between the bridges of the nodes and masquerades traffic leaving the host."""
    return {
        "cniVersion": "1.0.0",
        "name": plan.name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": plan.bridge,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": plan.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(plan: NodePlan) -> dict:
    """The KubeletConfiguration (JSON is YAML): cgroupfs under the node's own parent, no
    eviction on this shared disk, anonymous read access for the API server's log calls."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": plan.cgroup_parent,
        "failSwapOn": False,
        "port": plan.kubelet_port,
        "readOnlyPort": 0,
        "healthzPort": plan.healthz_port,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [DNS_SERVICE_IP],
        "podCIDR": plan.pod_cidr,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "containerRuntimeEndpoint": f"unix://{plan.socket}",
        "podLogsDir": str(plan.pod_logs),
    }


def corefile(address: str, port: int, kubeconfig: str) -> str:
    """CoreDNS on the host: Services and Pods of the cluster domain from the apiserver
    (headless Service names included), everything else forwarded to the host's resolver."""
    return "\n".join(
        [
            f".:{port} {{",
            f"    bind {address}",
            "    errors",
            f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{",
            f"        kubeconfig {kubeconfig}",
            "        pods insecure",
            "        fallthrough in-addr.arpa ip6.arpa",
            "    }",
            "    forward . /etc/resolv.conf",
            "    cache 5",
            "}",
            "",
        ]
    )


def dns_service(address: str, port: int) -> tuple[dict, dict]:
    """The ``kube-dns`` Service at :data:`DNS_SERVICE_IP` and the EndpointSlice that sends
    it to CoreDNS on the host (no selector: CoreDNS is a host process, not a Pod)."""
    ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": "kube-system"},
        "spec": {
            "clusterIP": DNS_SERVICE_IP,
            "ports": [
                {"name": name, "protocol": protocol, "port": 53, "targetPort": port}
                for name, protocol in ports
            ],
        },
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kube-dns-host",
            "namespace": "kube-system",
            "labels": {
                "kubernetes.io/service-name": "kube-dns",
                "endpointslice.kubernetes.io/managed-by": "dlo.dev-tests",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        "ports": [{"name": name, "protocol": protocol, "port": port} for name, protocol in ports],
    }
    return service, endpoints


def host_address() -> str:
    """The address other hosts (and this host's bridges) reach this machine at."""
    route = subprocess.run(
        ["ip", "-4", "-o", "route", "get", "1.1.1.1"], capture_output=True, text=True, check=False
    ).stdout.split()
    if "src" in route:
        return route[route.index("src") + 1]
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True)
    return addresses.stdout.split()[0]


def missing_runtime() -> list[str]:
    missing = {
        package for command, package in RUNTIME_PACKAGES.items() if not shutil.which(command)
    }
    if not (CNI_PLUGINS / "bridge").is_file():
        missing.add("containernetworking-plugins")
    return sorted(missing)


def ensure_runtime(progress: Progress) -> None:
    missing = missing_runtime()
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise BuildError(f"real nodes need root and these packages: {', '.join(missing)}")
    progress(f"installing {', '.join(missing)} from the package mirror ...")
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
    ):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BuildError(f"`{' '.join(command)}` failed: {result.stderr[-2000:]}")


def _controllers() -> list[Path]:
    """Every cgroup v1 hierarchy (the kubelet checks its parent exists in each)."""
    return [
        path
        for path in CGROUP_ROOT.iterdir()
        if path.is_dir() and path.name != "unified" and (path / "cgroup.procs").exists()
    ]


def make_cgroup_parent(plan: NodePlan) -> None:
    for controller in _controllers():
        parent = controller / plan.cgroup_parent.lstrip("/")
        parent.mkdir(exist_ok=True)
        if controller.name == "cpuset":
            for name in ("cpuset.cpus", "cpuset.mems"):
                (parent / name).write_text((controller / name).read_text())


def _cgroup_processes(plan: NodePlan) -> set[int]:
    pids: set[int] = set()
    for controller in _controllers():
        parent = controller / plan.cgroup_parent.lstrip("/")
        if parent.is_dir():
            for procs in parent.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(line) for line in procs.read_text().split())
    return pids


def _shims(plan: NodePlan) -> set[int]:
    """containerd shims of this node (they outlive containerd, in containerd's cgroup)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if str(plan.socket).encode() in (proc / "cmdline").read_bytes():
                    pids.add(int(proc.name))
    return pids


def clean_node(plan: NodePlan) -> None:
    """After kubelet and containerd stopped: kill the node's containers and shims, unmount
    what they left, remove its cgroups and bridge. Idempotent."""
    for _ in range(20):
        pids = _cgroup_processes(plan) | _shims(plan)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    mounts = [
        line.split()[1]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith((str(plan.root), str(plan.run_directory), str(plan.store)))
    ]
    for mount in reversed(mounts):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    for controller in _controllers():
        parent = controller / plan.cgroup_parent.lstrip("/")
        if parent.is_dir():
            for child in sorted(
                (p for p in parent.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
            ):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()
    subprocess.run(["ip", "link", "delete", plan.bridge], capture_output=True, check=False)
    shutil.rmtree(plan.run_directory, ignore_errors=True)


def write_node_files(plan: NodePlan, sandbox_image: str) -> tuple[Path, Path]:
    """containerd's and the kubelet's configuration files; returns their paths."""
    (plan.root / "cni").mkdir(parents=True, exist_ok=True)
    plan.run_directory.mkdir(parents=True, exist_ok=True)
    containerd = plan.root / "containerd.toml"
    containerd.write_text(containerd_config(plan, sandbox_image))
    (plan.root / "cni" / "10-dlo.conflist").write_text(json.dumps(cni_config(plan), indent=2))
    kubelet = plan.root / "kubelet.json"
    kubelet.write_text(json.dumps(kubelet_config(plan), indent=2))
    return containerd, kubelet


def ctr(socket: Path, *arguments: str) -> str:
    """``ctr`` against the containerd serving on ``socket``, in the CRI's namespace."""
    command = ["ctr", "--address", str(socket), "-n", "k8s.io", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"`{' '.join(command)}` failed: {result.stderr[-2000:]}")
    return result.stdout


def containerd_answers(socket: Path) -> bool:
    """containerd serves on ``socket`` (the socket file alone may be a stale one)."""
    command = ["ctr", "--address", str(socket), "version"]
    return subprocess.run(command, capture_output=True, check=False, timeout=10).returncode == 0


def remove_containers(socket: Path) -> int:
    """Delete every container (and its task) of the containerd on ``socket``, whose store is
    kept across clusters for its images; returns how many there were."""
    for task in ctr(socket, "tasks", "ls", "-q").split():
        with contextlib.suppress(BuildError):
            ctr(socket, "tasks", "delete", "--force", task)
    containers = ctr(socket, "containers", "ls", "-q").split()
    if containers:
        ctr(socket, "containers", "delete", *containers)
    return len(containers)
