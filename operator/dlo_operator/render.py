"""DiffusionDeployment -> Kubernetes manifests (pure: no I/O, deterministic).

One engine is one torch.distributed world of ``data x sequence x tensor`` ranks on
``world / gpusPerNode`` Pods, one per node, named ``<name>-e<engine>-n<node>``.
Each Pod runs torchrun with ``gpusPerNode`` ranks of ``dlo-worker serve``; node 0
of every engine is the leader that serves requests. Per engine: a headless Service
(publishNotReadyAddresses, so ranks find node 0 while nothing is ready yet) and a
PodDisruptionBudget; per deployment: a client Service selecting the leaders.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

from dlo_operator.api import (
    GROUP,
    KIND,
    VERSION,
    DiffusionDeploymentSpec,
    LockedMemory,
)
from dlo_operator.workerconfig import (
    RUNTIME_CACHE_MOUNT_PATH,
    memory_floor_bytes,
    worker_config,
)
from dlo_worker.config import to_flags

LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ENGINE = f"{GROUP}/engine"
LABEL_NODE_RANK = f"{GROUP}/node-rank"
LABEL_ROLE = f"{GROUP}/role"
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"
ROLE_LEADER, ROLE_WORKER = "leader", "worker"

CONTAINER = "worker"
MASTER_PORT = 29500
TORCHRUN_EXIT_MARGIN_S = 10
GPU_RESOURCE = "nvidia.com/gpu"
NRI_ULIMIT_ANNOTATION = f"ulimits.nri.containerd.io/container.{CONTAINER}"
STARTUP_BUDGET_S = 3600
"""Loading and pinning a large DiT can take tens of minutes; liveness starts after it."""


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


def worker_arguments(spec: DiffusionDeploymentSpec) -> list[str]:
    """``serve`` and its flags, generated from the worker's own configuration model."""
    return ["serve", *to_flags(worker_config(spec)), "--port", str(spec.port)]


def _command(spec: DiffusionDeploymentSpec) -> list[str]:
    return [
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "dlo_worker",
        *worker_arguments(spec),
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
        # torchrun SIGKILLs its ranks this long after forwarding SIGTERM (torch >= 2.12 reads
        # it; older releases use a fixed 30 s): the drain may use the Pod's grace period.
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(torchrun_shutdown_timeout(spec)),
    }
    return [{"name": key, "value": value} for key, value in values.items()]


def torchrun_shutdown_timeout(spec: DiffusionDeploymentSpec) -> int:
    """The grace period less the time torchrun itself needs to exit after its ranks."""
    return max(spec.termination_grace_period_seconds - TORCHRUN_EXIT_MARGIN_S, 0)


def _volumes(spec: DiffusionDeploymentSpec) -> tuple[list[dict], list[dict]]:
    volumes: list[dict] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}
    ]
    mounts: list[dict] = [{"name": "dshm", "mountPath": "/dev/shm"}]
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


def _resources(spec: DiffusionDeploymentSpec) -> dict[str, dict[str, str]]:
    gpus = str(spec.gpus_per_node)
    limits: dict[str, str] = {GPU_RESOURCE: gpus}
    requests: dict[str, str] = {GPU_RESOURCE: gpus}
    memory = spec.resources.memory or _gib_quantity(memory_floor_bytes(spec))
    requests["memory"] = memory
    if spec.resources.memory:
        limits["memory"] = memory
    if spec.resources.cpu:
        requests["cpu"] = limits["cpu"] = spec.resources.cpu
    return {"requests": requests, "limits": limits}


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


def _affinity(owner: Owner, spec: DiffusionDeploymentSpec, engine: int) -> dict[str, Any]:
    affinity = json.loads(json.dumps(spec.scheduling.affinity or {}))
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


def render_pod(
    owner: Owner, spec: DiffusionDeploymentSpec, engine: int, node: int
) -> dict[str, Any]:
    labels = {
        **_engine_labels(owner, engine),
        LABEL_NODE_RANK: str(node),
        LABEL_ROLE: ROLE_LEADER if node == 0 else ROLE_WORKER,
    }
    annotations = {ANNOTATION_SPEC_HASH: spec_hash(spec)}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.worker.image,
        "imagePullPolicy": spec.worker.image_pull_policy.value,
        "command": _command(spec),
        "env": _env(owner, spec, engine, node),
        "ports": [
            {"name": "http", "containerPort": spec.port},
            {"name": "rendezvous", "containerPort": MASTER_PORT},
        ],
        "resources": _resources(spec),
        **_probes(spec),
    }
    volumes, mounts = _volumes(spec)
    container["volumeMounts"] = mounts
    if spec.locked_memory == LockedMemory.IPC_LOCK:
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    elif spec.locked_memory == LockedMemory.NRI_ULIMIT:
        limit = int(memory_floor_bytes(spec))
        annotations[NRI_ULIMIT_ANNOTATION] = (
            f"- type: RLIMIT_MEMLOCK\n  soft: {limit}\n  hard: {limit}\n"
        )
    pod_spec: dict[str, Any] = {
        "hostname": pod_name(owner, engine, node),
        "subdomain": engine_service_name(owner, engine),
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "containers": [container],
        "volumes": volumes,
        "affinity": _affinity(owner, spec, engine),
    }
    if spec.scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(spec.scheduling.node_selector)
    if spec.scheduling.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.scheduling.tolerations]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(owner, pod_name(owner, engine, node), labels, annotations),
        "spec": pod_spec,
    }


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


def render_engine_budget(
    owner: Owner, spec: DiffusionDeploymentSpec, engine: int
) -> dict[str, Any]:
    """No voluntary eviction of any Pod of a running engine: one lost rank stops all."""
    labels = _engine_labels(owner, engine)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, engine_service_name(owner, engine), labels),
        "spec": {"minAvailable": pods_per_engine(spec), "selector": {"matchLabels": labels}},
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


def render_engine(owner: Owner, spec: DiffusionDeploymentSpec, engine: int) -> list[dict]:
    """Every object of one engine: its Pods, headless Service and PodDisruptionBudget."""
    pods = [render_pod(owner, spec, engine, node) for node in range(pods_per_engine(spec))]
    return [*pods, render_engine_service(owner, engine), render_engine_budget(owner, spec, engine)]
