"""DiffusionDeployment -> Kubernetes manifests (pure: no I/O, deterministic).

One engine is one torch.distributed world of ``data x sequence x tensor`` ranks on
``world / gpusPerNode`` Pods, one per node, named ``<name>-e<engine>-n<node>``.
Each Pod runs torchrun (through ``dlo-worker launch``) with ``gpusPerNode`` ranks of
``dlo-worker serve``; node 0
of every engine is the leader that serves requests. Per engine: a headless Service
(publishNotReadyAddresses, so ranks find node 0 while nothing is ready yet) and a
NetworkPolicy; per deployment: a client Service selecting the leaders and one
PodDisruptionBudget counted in engines.

Worker Pods are hardened like the operator's own Deployment: a non-root user, no
capabilities, no privilege escalation, the runtime's default seccomp profile, a
read-only root filesystem with emptyDirs for what the worker writes, and no
ServiceAccount token (workers never call the Kubernetes API).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from dlo_operator.api import (
    GROUP,
    KIND,
    RENDEZVOUS_PORT,
    VERSION,
    Accelerator,
    DiffusionDeploymentSpec,
    LockedMemory,
)
from dlo_operator.warming import (
    ANNOTATION_NODE,
    LABEL_WARM_HASH,
    WARM_DEADLINE_S,
    job_name,
    warm_arguments,
    warming_enabled,
)
from dlo_operator.workerconfig import (
    RUNTIME_CACHE_MOUNT_PATH,
    memory_floor_bytes,
    worker_config,
)
from dlo_worker.config import WorkerConfig, to_flags
from dlo_worker.observability.logs import LOG_LEVEL_ENV

LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ENGINE = f"{GROUP}/engine"
LABEL_NODE_RANK = f"{GROUP}/node-rank"
LABEL_ROLE = f"{GROUP}/role"
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
"""On every child but Pods: a hash of the rendered object, so a changed rendering is patched."""
ROLE_LEADER, ROLE_WORKER = "leader", "worker"

CONTAINER = "worker"
MASTER_PORT = RENDEZVOUS_PORT
TORCHRUN_EXIT_MARGIN_S = 10
ENDPOINT_REMOVAL_DELAY_S = 5
GPU_RESOURCE = "nvidia.com/gpu"
API_KEY_ENV = "DLO_API_KEY"
"""The worker reads its API key from this variable (``dlo-worker serve --api-key``)."""
NRI_ULIMIT_ANNOTATION = f"ulimits.nri.containerd.io/container.{CONTAINER}"
STARTUP_BUDGET_S = 3600
"""Loading and pinning a large DiT can take tens of minutes; liveness starts after it."""

WORKER_UID = 65532
"""The worker image's non-root user and group (``docker/worker.Dockerfile``)."""
WORKER_USER = "dlo"
WORKER_HOME = "/home/dlo"
"""An emptyDir: torch, Triton and Hugging Face write their caches under $HOME."""
INIT_CONTAINER_RUNTIME_CACHE = "runtime-cache-owner"


@dataclass(frozen=True)
class Owner:
    """The DiffusionDeployment the children belong to."""

    name: str
    namespace: str
    uid: str


def pods_per_engine(spec: DiffusionDeploymentSpec) -> int:
    return spec.parallelism.world_size // spec.gpus_per_node


def pod_name(owner: Owner, engine: int, node: int) -> str:
    return f"{owner.name}-e{engine}-n{node}"


def engine_service_name(owner: Owner, engine: int) -> str:
    return f"{owner.name}-e{engine}"


def spec_hash(spec: DiffusionDeploymentSpec) -> str:
    """Changes whenever the Pods would change; replicas are not part of a Pod."""
    relevant = spec.model_dump(mode="json", by_alias=True, exclude={"replicas"})
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def selector(owner: Owner) -> str:
    """The label selector reported in status (for the scale subresource)."""
    return f"{LABEL_DEPLOYMENT}={owner.name}"


def _owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    owner: Owner, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    metadata = {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [_owner_reference(owner)],
    }
    if annotations:
        metadata["annotations"] = annotations
    return metadata


def _engine_labels(owner: Owner, engine: int) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: owner.name, LABEL_ENGINE: str(engine)}


def _gib_quantity(value: Decimal) -> str:
    return f"{int((value / 2**30).to_integral_value(ROUND_CEILING))}Gi"


def worker_arguments(
    spec: DiffusionDeploymentSpec, config: WorkerConfig | None = None
) -> list[str]:
    """``serve`` and its flags, generated from the worker's own configuration model
    (``config``: the one ``spec`` validated into, when the caller has it already)."""
    serve = spec.serve
    defaults = {
        "--default-steps": serve.default_steps,
        "--default-width": serve.default_width,
        "--default-height": serve.default_height,
    }
    return [
        "serve",
        *to_flags(config if config is not None else worker_config(spec)),
        "--port",
        str(spec.port),
        "--max-queued-requests",
        str(serve.max_queued_requests),
        *(
            item
            for flag, value in defaults.items()
            if value is not None
            for item in (flag, str(value))
        ),
    ]


def _command(spec: DiffusionDeploymentSpec, config: WorkerConfig) -> list[str]:
    """torchrun through ``dlo-worker launch``, which exits 0 once every rank drained after
    SIGTERM (torchrun alone exits 1 then, and every stop would end the Pod in Error)."""
    return [
        "dlo-worker",
        "launch",
        "--",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "dlo_worker",
        *worker_arguments(spec, config),
    ]


def _env(owner: Owner, spec: DiffusionDeploymentSpec, engine: int, node: int) -> list[dict]:
    master = (
        f"{pod_name(owner, engine, 0)}.{engine_service_name(owner, engine)}.{owner.namespace}.svc"
    )
    values = {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(MASTER_PORT),
        "WORLD_SIZE": str(spec.parallelism.world_size),
        "NNODES": str(pods_per_engine(spec)),
        "NODE_RANK": str(node),
        "NPROC_PER_NODE": str(spec.gpus_per_node),
        LOG_LEVEL_ENV: spec.log_level.value,
        # torchrun SIGKILLs its ranks this long after forwarding SIGTERM (torch >= 2.12 reads
        # it; older releases use a fixed 30 s): the drain may use the Pod's grace period.
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(torchrun_shutdown_timeout(spec)),
        "HOME": WORKER_HOME,
        # torch names its compile caches after the user; a UID without a passwd entry (a
        # custom image, an arbitrary-UID platform) would make that lookup raise at import.
        "USER": WORKER_USER,
    }
    env: list[dict] = [{"name": key, "value": value} for key, value in values.items()]
    env += _extra_env(spec)
    if spec.api_key_secret is not None:
        # From the Secret, never on the command line (visible in the process list).
        secret = spec.api_key_secret
        env.append(
            {
                "name": API_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
            }
        )
    return env


def _extra_env(spec: DiffusionDeploymentSpec) -> list[dict]:
    """``worker.env`` as Pod env entries (the API server refused the reserved names)."""
    return [
        variable.model_dump(mode="json", by_alias=True, exclude_none=True)
        for variable in spec.worker.env
    ]


def _platform_fields(spec: DiffusionDeploymentSpec) -> dict[str, Any]:
    """Pod fields the platform sets, shared by engine Pods and warm Jobs: pull secrets,
    ServiceAccount and its token, priority, tolerations."""
    worker, scheduling = spec.worker, spec.scheduling
    fields: dict[str, Any] = {
        "automountServiceAccountToken": worker.automount_service_account_token,
    }
    if worker.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": s.name} for s in worker.image_pull_secrets]
    if worker.service_account_name:
        fields["serviceAccountName"] = worker.service_account_name
    if scheduling.priority_class_name:
        fields["priorityClassName"] = scheduling.priority_class_name
    if scheduling.tolerations:
        fields["tolerations"] = [dict(t) for t in scheduling.tolerations]
    return fields


def _scrape_annotations(spec: DiffusionDeploymentSpec) -> dict[str, str]:
    if not spec.metrics.scrape_annotations:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.port),
        "prometheus.io/path": "/metrics",
    }


def endpoint_removal_delay(spec: DiffusionDeploymentSpec) -> int:
    """Seconds a deleted worker keeps serving before its SIGTERM (a preStop sleep).

    Deleting a Pod removes it from its Services and sends SIGTERM at the same moment, and
    kube-proxy needs a moment to stop routing to it; a leader that closed intake at once
    would refuse the requests routed to it meanwhile. A quarter of the grace period at
    most, so the drain keeps the rest."""
    return min(ENDPOINT_REMOVAL_DELAY_S, spec.termination_grace_period_seconds // 4)


def torchrun_shutdown_timeout(spec: DiffusionDeploymentSpec) -> int:
    """The grace period less the preStop delay and the time torchrun itself needs to
    exit after its ranks."""
    remaining = spec.termination_grace_period_seconds - endpoint_removal_delay(spec)
    return max(remaining - TORCHRUN_EXIT_MARGIN_S, 0)


def _volumes(spec: DiffusionDeploymentSpec) -> tuple[list[dict], list[dict]]:
    volumes: list[dict] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        # The root filesystem is read-only: torchrun's error files and Python's temporary
        # files go to /tmp, compile and download caches to $HOME.
        {"name": "tmp", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
    ]
    mounts: list[dict] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "home", "mountPath": WORKER_HOME},
    ]
    model = spec.model
    if model.host_path:
        volumes.append(
            {"name": "model", "hostPath": {"path": model.host_path, "type": "Directory"}}
        )
    elif model.persistent_volume_claim:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {
                    "claimName": model.persistent_volume_claim,
                    "readOnly": True,
                },
            }
        )
    if model.host_path or model.persistent_volume_claim:
        mounts.append({"name": "model", "mountPath": model.mount_path, "readOnly": True})
    cache = spec.offload.runtime_cache
    if spec.offload.enabled and cache.enabled:
        volumes.append(
            {
                "name": "runtime-cache",
                "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"},
            }
        )
        mounts.append({"name": "runtime-cache", "mountPath": RUNTIME_CACHE_MOUNT_PATH})
    return volumes, mounts


def _cpu_quantity(value: Decimal) -> str:
    millicores = int((value * 1000).to_integral_value(ROUND_CEILING))
    return str(millicores // 1000) if millicores % 1000 == 0 else f"{millicores}m"


def derived_memory_bytes(spec: DiffusionDeploymentSpec) -> Decimal:
    """Per-Pod memory when ``resources.memory`` is unset: the ranks plus the floor."""
    per_rank = parse_quantity(spec.resources.memory_per_rank)
    return per_rank * spec.gpus_per_node + memory_floor_bytes(spec)


def _resources(spec: DiffusionDeploymentSpec) -> dict[str, dict[str, str]]:
    """GPUs, a CPU request, and memory requested and limited alike (Guaranteed memory).

    No CPU limit: throttling would stall the pack threads and NCCL's proxy threads.
    """
    cpu = spec.resources.cpu or _cpu_quantity(
        parse_quantity(spec.resources.cpu_per_rank) * spec.gpus_per_node
    )
    memory = spec.resources.memory or _gib_quantity(derived_memory_bytes(spec))
    disk = spec.resources.ephemeral_storage
    gpus = {GPU_RESOURCE: str(spec.gpus_per_node)}
    if spec.accelerator == Accelerator.NONE:
        gpus = {}
    return {
        "requests": {**gpus, "cpu": cpu, "memory": memory, "ephemeral-storage": disk},
        "limits": {**gpus, "memory": memory, "ephemeral-storage": disk},
    }


def _probes(spec: DiffusionDeploymentSpec) -> dict[str, dict]:
    def http(path: str, period_s: int, failures: int) -> dict:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period_s,
            "failureThreshold": failures,
            "timeoutSeconds": 5,
        }

    return {
        "startupProbe": http("/health/live", 10, STARTUP_BUDGET_S // 10),
        "livenessProbe": http("/health/live", 10, 6),
        "readinessProbe": http("/health/ready", 5, 3),
    }


def _affinity(
    owner: Owner, spec: DiffusionDeploymentSpec, engine: int, warm: Sequence[str]
) -> dict[str, Any]:
    affinity = json.loads(json.dumps(spec.scheduling.affinity or {}))
    if warm:
        preferred = affinity.setdefault("nodeAffinity", {}).setdefault(
            "preferredDuringSchedulingIgnoredDuringExecution", []
        )
        preferred.append(
            {
                "weight": 50,
                "preference": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/hostname", "operator": "In", "values": list(warm)}
                    ]
                },
            }
        )
    same_engine = {"labelSelector": {"matchLabels": _engine_labels(owner, engine)}}
    anti = affinity.setdefault("podAntiAffinity", {})
    anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
        {**same_engine, "topologyKey": "kubernetes.io/hostname"}
    )
    if spec.scheduling.topology_key:
        together = affinity.setdefault("podAffinity", {})
        together.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            {**same_engine, "topologyKey": spec.scheduling.topology_key}
        )
    return affinity


def _security_contexts(spec: DiffusionDeploymentSpec) -> tuple[dict, dict]:
    """(Pod, worker container) security contexts.

    ``IpcLock`` runs the worker as root with IPC_LOCK as its only capability: a
    capability added to a non-root container lands in the bounding set only and is
    never effective (Kubernetes sets no ambient capabilities), so mlock would still
    be refused. ``NriUlimit`` raises the memlock limit instead and keeps the non-root user.
    """
    pod = {
        "runAsNonRoot": True,
        "runAsUser": WORKER_UID,
        "runAsGroup": WORKER_UID,
        "fsGroup": WORKER_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    if spec.locked_memory == LockedMemory.IPC_LOCK:
        container["capabilities"]["add"] = ["IPC_LOCK"]
        container.update(runAsNonRoot=False, runAsUser=0)
    return pod, container


def _runtime_cache_owner(spec: DiffusionDeploymentSpec) -> dict[str, Any]:
    """Hands the node's cache directory to the worker user.

    The kubelet creates a missing hostPath directory as root with mode 0755, and fsGroup
    does not apply to hostPath volumes. This step runs as root with CHOWN as its only
    capability and changes the owner of that one directory (entries below it are written
    by the worker user); where it cannot, the worker's own fallback applies.
    """
    return {
        "name": INIT_CONTAINER_RUNTIME_CACHE,
        "image": spec.worker.image,
        "imagePullPolicy": spec.worker.image_pull_policy.value,
        # A directory that cannot be handed over (a read-only host path, a root-squashing
        # NFS) is left to the worker, which falls back to its ordinary tensors and says so
        # (cache-read-only): failing here would restart the engine for good.
        "command": [
            "sh",
            "-c",
            f'chown {WORKER_UID}:{WORKER_UID} "$0" || echo "runtime cache $0 cannot be handed '
            'to the worker user; the worker falls back to its ordinary tensors"',
            RUNTIME_CACHE_MOUNT_PATH,
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "runAsNonRoot": False,
            "runAsUser": 0,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
        "resources": {
            "requests": {"cpu": "10m", "memory": "32Mi", "ephemeral-storage": "16Mi"},
            "limits": {"cpu": "100m", "memory": "32Mi", "ephemeral-storage": "16Mi"},
        },
        "volumeMounts": [{"name": "runtime-cache", "mountPath": RUNTIME_CACHE_MOUNT_PATH}],
    }


def render_pod(
    owner: Owner,
    spec: DiffusionDeploymentSpec,
    engine: int,
    node: int,
    warm: Sequence[str] = (),
    *,
    config: WorkerConfig | None = None,
) -> dict[str, Any]:
    """One engine Pod; ``warm`` names nodes whose runtime cache holds the entry (preferred);
    ``config`` is the worker configuration ``spec`` validated into, if already known."""
    labels = {
        **spec.pod_metadata.labels,
        **_engine_labels(owner, engine),
        LABEL_NODE_RANK: str(node),
        LABEL_ROLE: ROLE_LEADER if node == 0 else ROLE_WORKER,
    }
    annotations = {
        **spec.pod_metadata.annotations,
        **_scrape_annotations(spec),
        ANNOTATION_SPEC_HASH: spec_hash(spec),
    }
    pod_security, container_security = _security_contexts(spec)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.worker.image,
        "imagePullPolicy": spec.worker.image_pull_policy.value,
        "command": _command(spec, config if config is not None else worker_config(spec)),
        "env": _env(owner, spec, engine, node),
        "ports": [
            {"name": "http", "containerPort": spec.port},
            {"name": "rendezvous", "containerPort": MASTER_PORT},
        ],
        "resources": _resources(spec),
        "securityContext": container_security,
        # The worker writes its one-line error to /dev/termination-log; a crash without one
        # leaves its last log lines there. The operator reports either in the status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **_probes(spec),
    }
    if delay := endpoint_removal_delay(spec):
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": delay}}}
    volumes, mounts = _volumes(spec)
    container["volumeMounts"] = mounts
    if spec.locked_memory == LockedMemory.NRI_ULIMIT:
        limit = int(memory_floor_bytes(spec))
        annotations[NRI_ULIMIT_ANNOTATION] = (
            f"- type: RLIMIT_MEMLOCK\n  soft: {limit}\n  hard: {limit}\n"
        )
    pod_spec: dict[str, Any] = {
        "hostname": pod_name(owner, engine, node),
        "subdomain": engine_service_name(owner, engine),
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        **_platform_fields(spec),
        # Service links would add <SERVICE>_PORT variables next to torch's own environment.
        "enableServiceLinks": False,
        "securityContext": pod_security,
        "containers": [container],
        "volumes": volumes,
        "affinity": _affinity(owner, spec, engine, warm),
    }
    if any(volume["name"] == "runtime-cache" for volume in volumes):
        pod_spec["initContainers"] = [_runtime_cache_owner(spec)]
    if spec.scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(spec.scheduling.node_selector)
    if spec.scheduling.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [
            dict(c) for c in spec.scheduling.topology_spread_constraints
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(owner, pod_name(owner, engine, node), labels, annotations),
        "spec": pod_spec,
    }


def _with_config_hash(item: dict[str, Any]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(item, sort_keys=True).encode()).hexdigest()[:16]
    item["metadata"].setdefault("annotations", {})[ANNOTATION_CONFIG_HASH] = digest
    return item


def render_engine_service(owner: Owner, engine: int) -> dict[str, Any]:
    labels = _engine_labels(owner, engine)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, engine_service_name(owner, engine), labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": [{"name": "rendezvous", "port": MASTER_PORT}],
        },
    }


def budget_min_available(spec: DiffusionDeploymentSpec) -> int:
    """Ready Pods the deployment keeps during voluntary disruptions.

    All Pods less ``maxUnavailableEngines``: an eviction is allowed only while fewer
    Pods than that are unready, and every disrupted engine has at least one unready
    Pod, so at most that many engines go down through evictions, however many Pods
    an engine has. The evicted engine's other Pods are deleted by the operator (not
    evicted), and further evictions wait until it is Ready again.
    """
    total = spec.replicas * pods_per_engine(spec)
    return max(total - spec.disruption_budget.max_unavailable_engines, 0)


def render_budget(owner: Owner, spec: DiffusionDeploymentSpec) -> dict[str, Any]:
    """One PodDisruptionBudget for the whole deployment, counted in engines."""
    labels = {LABEL_DEPLOYMENT: owner.name}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, owner.name, labels),
        "spec": {
            "minAvailable": budget_min_available(spec),
            "selector": {"matchLabels": labels},
            # A Pod stuck loading or crashing never blocks a drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_network_policy(
    owner: Owner, spec: DiffusionDeploymentSpec, engine: int
) -> dict[str, Any]:
    """All traffic among one engine's Pods; the HTTP port from anywhere; egress untouched."""
    labels = _engine_labels(owner, engine)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(owner, engine_service_name(owner, engine), labels),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": labels}}]},
                {"ports": [{"protocol": "TCP", "port": spec.port}]},
            ],
        },
    }


def render_client_service(owner: Owner, spec: DiffusionDeploymentSpec) -> dict[str, Any]:
    labels = {LABEL_DEPLOYMENT: owner.name}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, owner.name, labels),
        "spec": {
            "selector": {**labels, LABEL_ROLE: ROLE_LEADER},
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http"}],
        },
    }


def render_engine_pods(
    owner: Owner,
    spec: DiffusionDeploymentSpec,
    engine: int,
    warm: Sequence[str] = (),
    *,
    config: WorkerConfig | None = None,
) -> list[dict]:
    """Every Pod of one engine, from one worker configuration."""
    config = config if config is not None else worker_config(spec)
    return [
        render_pod(owner, spec, engine, node, warm, config=config)
        for node in range(pods_per_engine(spec))
    ]


def warm_template(
    spec: DiffusionDeploymentSpec, config: WorkerConfig | None = None
) -> dict[str, Any]:
    """The Pod template of every warm Job (:mod:`dlo_operator.warming`), before its node:
    ``dlo-worker cache warm`` with the engines' flags, image, volumes and hardening,
    without GPUs. Its Pod does not carry the deployment label: it is not an engine Pod."""
    pod_security, container_security = _security_contexts(spec)
    if spec.locked_memory == LockedMemory.IPC_LOCK:
        # Warming pins nothing: it keeps the non-root user.
        container_security = {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    volumes, mounts = _volumes(spec)
    resources = {
        kind: {key: value for key, value in values.items() if key != GPU_RESOURCE}
        for kind, values in _resources(spec).items()
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        **_platform_fields(spec),
        "enableServiceLinks": False,
        "securityContext": pod_security,
        "initContainers": [_runtime_cache_owner(spec)],
        "containers": [
            {
                "name": "warm",
                "image": spec.worker.image,
                "imagePullPolicy": spec.worker.image_pull_policy.value,
                "command": ["dlo-worker", *warm_arguments(spec, config)],
                "env": [
                    {"name": "HOME", "value": WORKER_HOME},
                    {"name": "USER", "value": WORKER_USER},
                    *_extra_env(spec),
                ],
                "resources": resources,
                "securityContext": container_security,
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    template: dict[str, Any] = {"spec": pod_spec}
    for field, values in spec.pod_metadata.model_dump().items():
        if values:
            template.setdefault("metadata", {})[field] = values
    return template


def template_hash(template: dict[str, Any]) -> str:
    """The identity of a warm template: a Job of another template is replaced."""
    rendered = json.dumps(template, sort_keys=True)
    return hashlib.sha256(rendered.encode()).hexdigest()[:10]


def warm_template_hash(spec: DiffusionDeploymentSpec) -> str:
    return template_hash(warm_template(spec))


def render_warm_job(
    owner: Owner,
    spec: DiffusionDeploymentSpec,
    node: str,
    *,
    template: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One node's warm Job: the warm template (rendered once by the caller, or here)
    pinned to ``node``."""
    shared = template if template is not None else warm_template(spec)
    digest = template_hash(shared)
    template = copy.deepcopy(shared)
    template["spec"]["nodeName"] = node
    template.setdefault("metadata", {}).setdefault("labels", {})[LABEL_WARM_HASH] = digest
    labels = {LABEL_DEPLOYMENT: owner.name, LABEL_WARM_HASH: digest}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(
            owner, job_name(owner.name, digest, node), labels, {ANNOTATION_NODE: node}
        ),
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": WARM_DEADLINE_S,
            "template": template,
        },
    }


def render_children(
    owner: Owner,
    spec: DiffusionDeploymentSpec,
    warm_on: Sequence[str] = (),
    *,
    warm_job_template: dict[str, Any] | None = None,
) -> list[dict]:
    """Every object besides Pods, each annotated with the hash of its rendering.

    The client Service and the budget; per engine a headless Service and, unless
    disabled, a NetworkPolicy; with the runtime cache, a warm Job per node of
    ``warm_on``. Objects of engines beyond ``replicas`` are not here, so scaling down
    removes them; warm Jobs of a former identity are not either.
    """
    items = [render_client_service(owner, spec), render_budget(owner, spec)]
    for engine in range(spec.replicas):
        items.append(render_engine_service(owner, engine))
        if spec.network_policy.enabled:
            items.append(render_network_policy(owner, spec, engine))
    if warming_enabled(spec) and warm_on:
        template = warm_job_template if warm_job_template is not None else warm_template(spec)
        items += [render_warm_job(owner, spec, node, template=template) for node in warm_on]
    return [_with_config_hash(item) for item in items]
