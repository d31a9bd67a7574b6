"""The parts of a Pod that engine Pods and warm Jobs share: the worker image's user, the
hardening, volumes, resources and the fields the platform sets (pure)."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from dlo_operator.api import Accelerator, DiffusionDeploymentSpec, LockedMemory
from dlo_operator.workerconfig import (
    COMPILE_CACHE_MOUNT_PATH,
    RUNTIME_CACHE_MOUNT_PATH,
    compile_cache_dir,
    lora_path,
    memory_floor_bytes,
    runtime_cache_mounted,
)

GPU_RESOURCE = "nvidia.com/gpu"
WORKER_UID = 65532
"""The worker image's non-root user and group (``docker/worker.Dockerfile``)."""
WORKER_USER = "dlo"
WORKER_HOME = "/home/dlo"
"""An emptyDir: torch, Triton and Hugging Face write their caches under $HOME."""
INIT_CONTAINER_RUNTIME_CACHE = "runtime-cache-owner"


def gib_quantity(value: Decimal) -> str:
    return f"{int((value / 2**30).to_integral_value(ROUND_CEILING))}Gi"


def extra_env(spec: DiffusionDeploymentSpec) -> list[dict]:
    """``worker.env`` as Pod env entries (the API server refused the reserved names)."""
    return [
        variable.model_dump(mode="json", by_alias=True, exclude_none=True)
        for variable in spec.worker.env
    ]


def platform_fields(spec: DiffusionDeploymentSpec) -> dict[str, Any]:
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


def volumes_and_mounts(spec: DiffusionDeploymentSpec) -> tuple[list[dict], list[dict]]:
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
    if runtime_cache_mounted(spec):
        volumes.append(
            {
                "name": "runtime-cache",
                "hostPath": {
                    "path": spec.offload.runtime_cache.host_path,
                    "type": "DirectoryOrCreate",
                },
            }
        )
        mounts.append({"name": "runtime-cache", "mountPath": RUNTIME_CACHE_MOUNT_PATH})
    for index, lora in enumerate(spec.loras):
        if lora.image_path:
            continue  # in the image: nothing to mount
        volume = f"lora-{index}"
        if lora.host_path:
            volumes.append({"name": volume, "hostPath": {"path": lora.host_path}})
        else:
            claim = {"claimName": lora.persistent_volume_claim, "readOnly": True}
            volumes.append({"name": volume, "persistentVolumeClaim": claim})
        mount = {"name": volume, "mountPath": lora_path(lora), "readOnly": True}
        if lora.sub_path:
            mount["subPath"] = lora.sub_path
        mounts.append(mount)
    if compile_cache_dir(spec) == COMPILE_CACHE_MOUNT_PATH:
        volumes.append({"name": "compile-cache", "emptyDir": {}})
        mounts.append({"name": "compile-cache", "mountPath": COMPILE_CACHE_MOUNT_PATH})
    return volumes, mounts


def cpu_quantity(value: Decimal) -> str:
    millicores = int((value * 1000).to_integral_value(ROUND_CEILING))
    return str(millicores // 1000) if millicores % 1000 == 0 else f"{millicores}m"


RANK_CPUS = Decimal(4)
"""CPU request of a rank that does not pack its blocks (AllGather, pinned or registered)."""
WORKER_PACK_THREADS = 8
"""The worker's default pack threads where its CPUs allow (``MAX_PACK_THREADS``)."""
WORKER_BUSY_THREADS = 2
"""A packing rank's threads besides its packers: the one that launches the model's kernels
and the staging ring's feeder (``BUSY_THREADS_PER_RANK``)."""


def packs_mapped_blocks(spec: DiffusionDeploymentSpec) -> bool:
    """Whether the ranks are expected to pack their blocks for every copy: rank-local DLO
    on GPUs (the checkpoint mapping or the runtime cache is staged through pack threads)
    without a pin limit (with one, the mapping is registered and copied directly)."""
    return (
        spec.accelerator == Accelerator.NVIDIA_GPU
        and spec.offload.enabled
        and not spec.offload.use_all_gather
        and spec.offload.runtime_cache.pin_limit_gib == 0
    )


def rank_cpus(spec: DiffusionDeploymentSpec) -> Decimal:
    """CPU request of one rank: ``resources.cpuPerRank``, else what its busy threads take.

    A packing rank's pack threads, its model thread and its feeder run all the time; a
    request below that lets other Pods' work share their CPUs, and beside four busy threads
    of other work the staging ring went from 1.05x to 1.11-1.24x private pinned
    (docs/benchmarks.md, leases 19 and 20).
    """
    if spec.resources.cpu_per_rank is not None:
        return Decimal(parse_quantity(spec.resources.cpu_per_rank))
    if not packs_mapped_blocks(spec):
        return RANK_CPUS
    packers = spec.offload.staging.pack_threads or WORKER_PACK_THREADS
    return Decimal(packers + WORKER_BUSY_THREADS)


def derived_memory_bytes(spec: DiffusionDeploymentSpec) -> Decimal:
    """Per-Pod memory when ``resources.memory`` is unset: the ranks plus the floor."""
    per_rank = parse_quantity(spec.resources.memory_per_rank)
    return per_rank * spec.gpus_per_node + memory_floor_bytes(spec)


def container_resources(spec: DiffusionDeploymentSpec) -> dict[str, dict[str, str]]:
    """GPUs, a CPU request, and memory requested and limited alike (Guaranteed memory).

    No CPU limit: throttling would stall the pack threads and NCCL's proxy threads.
    """
    cpu = spec.resources.cpu or cpu_quantity(rank_cpus(spec) * spec.gpus_per_node)
    memory = spec.resources.memory or gib_quantity(derived_memory_bytes(spec))
    disk = spec.resources.ephemeral_storage
    gpus = {GPU_RESOURCE: str(spec.gpus_per_node)}
    if spec.accelerator == Accelerator.NONE:
        gpus = {}
    return {
        "requests": {**gpus, "cpu": cpu, "memory": memory, "ephemeral-storage": disk},
        "limits": {**gpus, "memory": memory, "ephemeral-storage": disk},
    }


def security_contexts(spec: DiffusionDeploymentSpec) -> tuple[dict, dict]:
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


def runtime_cache_owner_container(spec: DiffusionDeploymentSpec) -> dict[str, Any]:
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
