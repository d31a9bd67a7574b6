"""The ``DiffusionDeployment`` API (``dlo.dev/v1alpha1``) as pydantic models.

These models are the single source of the CRD (:mod:`dlo_operator.crd` generates
``crds/`` from them) and of the operator's view of a resource. Field names are
snake_case in Python and camelCase on the wire. Rules that CEL can check live
next to the field (``x-kubernetes-validations``) so the API server refuses a bad
object before the operator sees it; the DLO compatibility matrix is checked by
the worker's own configuration code (:func:`dlo_operator.workerconfig.validate`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from dlo_worker.config import DType, Quantization, SkipLoad

GROUP = "dlo.dev"
VERSION = "v1alpha1"
KIND = "DiffusionDeployment"
PLURAL = "diffusiondeployments"
SINGULAR = "diffusiondeployment"
SHORT_NAMES = ("dd",)

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
RENDEZVOUS_PORT = 29500
"""The engine's torch rendezvous port (``MASTER_PORT``), on every worker Pod."""
_ABSOLUTE_CLEAN_PATH = "self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')"


def _cel(rule: str, message: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


def _absolute_path(description: str, **extra: Any) -> Any:
    return Field(
        description=description,
        json_schema_extra=_cel(_ABSOLUTE_CLEAN_PATH, "must be an absolute path without '..'"),
        **extra,
    )


Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN)]


class _Api(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ImagePullPolicy(StrEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class Accelerator(StrEnum):
    """What each rank of an engine runs on."""

    NVIDIA_GPU = "nvidia-gpu"
    """One ``nvidia.com/gpu`` per rank; NCCL between ranks."""
    NONE = "none"
    """CPU ranks with gloo: engines that run where there is no GPU (demos, CI)."""


class LogLevel(StrEnum):
    """The workers' log level (``$DLO_LOG_LEVEL`` of every rank)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LockedMemory(StrEnum):
    """How a worker gets a locked-memory limit high enough for mlock or RDMA registration."""

    NONE = "None"
    """cudaHostRegister/cudaHostAlloc need no RLIMIT_MEMLOCK (ANCHORS.md); the default."""
    IPC_LOCK = "IpcLock"
    """Add the IPC_LOCK capability; the worker then runs as root (capabilities added to a
    non-root container are not effective: Kubernetes sets no ambient capabilities)."""
    NRI_ULIMIT = "NriUlimit"
    """Ask containerd's NRI ulimit adjuster for an unlimited memlock via a Pod annotation."""


class ModelSource(_Api):
    """Where the diffusers-format model directory comes from; exactly one source."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "[has(self.hostPath), has(self.persistentVolumeClaim), has(self.imagePath)]"
            ".filter(x, x).size() == 1",
            "set exactly one of hostPath, persistentVolumeClaim, imagePath",
        )
    )

    host_path: str | None = _absolute_path(
        "Directory on every node (hostPath volume).", default=None
    )
    persistent_volume_claim: str | None = Field(
        default=None, min_length=1, description="Name of a PVC in the same namespace."
    )
    image_path: str | None = _absolute_path(
        "Path of a model baked into the worker image (no volume).", default=None
    )
    mount_path: str = _absolute_path(
        "Where the model appears in the worker container.", default="/models/model"
    )


class WorkerImage(_Api):
    image: str = Field(min_length=1, description="Worker container image (entrypoint dlo-worker).")
    image_pull_policy: ImagePullPolicy = ImagePullPolicy.IF_NOT_PRESENT


class Hsdp(_Api):
    enabled: bool = False
    shard_size: int = Field(default=-1, ge=-1, description="-1 = world size / replicate size.")
    replicate_size: int = Field(default=1, ge=1)


class Parallelism(_Api):
    """Parallel sizes of one engine; its world size is data x sequence x tensor."""

    data: int = Field(default=1, ge=1, description="DP ranks (request lanes) per engine.")
    sequence: int = Field(default=1, ge=1, description="SP ranks per engine.")
    tensor: int = Field(default=1, ge=1, description="TP ranks per engine.")
    hsdp: Hsdp = Hsdp()

    @property
    def world_size(self) -> int:
        return self.data * self.sequence * self.tensor


class RuntimeCache(_Api):
    """The node-local runtime weight cache (no-AllGather only)."""

    enabled: bool = False
    host_path: str = _absolute_path(
        "Node directory holding cache entries; the same path on every node so engines on a "
        "node share one copy.",
        default="/var/cache/dlo-worker",
    )
    lock_timeout_seconds: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    pin_limit_gib: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        alias="pinLimitGiB",
        description="Host-registration budget per worker process (GiB) for direct copies "
        "from the runtime cache or an exactly matching checkpoint; 0 = bounded staging.",
    )
    size_budget_gib: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        alias="sizeBudgetGiB",
        description="Upper bound of the cache directory on a node (GiB); least recently used "
        "entries no worker maps are evicted.",
    )
    skip_load: SkipLoad = Field(
        default=SkipLoad.PREFERRED,
        description="Bind the DiT to its entry without reading the checkpoint when the "
        "model's source is recorded on the node; required makes a miss a start-up error.",
    )


class Offload(_Api):
    """DLO options, mirroring the worker's ``--dlo-*`` flags."""

    enabled: bool = Field(default=True, description="Stream DiT blocks with DLO.")
    use_all_gather: bool = Field(default=True, description="Shard host weights over DP/SP.")
    resident_layers: int = Field(
        default=0, ge=0, description="Blocks kept on the GPU, spread evenly (no-AllGather)."
    )
    gpu_memory_budget_gib: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        alias="gpuMemoryBudgetGiB",
        description="GPU memory for the DiT's weights: non-block weights, two slots and as "
        "many resident blocks as fit (instead of residentLayers; no-AllGather).",
    )
    all_gather_shard_buffers: int = Field(
        default=4,
        ge=2,
        le=64,
        description="AllGather: GPU buffers for this rank's block shards, copied up to this "
        "many blocks ahead of their gather (2 uses the least GPU memory).",
    )
    block_paths: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, description="DiT block-list attribute paths (default: discovered)."
    )
    runtime_cache: RuntimeCache = RuntimeCache()


class Resources(_Api):
    """Per-Pod CPU and memory (GPUs come from gpusPerNode).

    Every Pod gets a CPU request and a memory request equal to its limit: explicit
    per-Pod values win, otherwise they are derived per rank (see the fields). No CPU
    limit is set: CFS throttling would stall the pack threads and NCCL's proxy threads.
    """

    cpu: Quantity | None = Field(
        default=None, description="CPU request per Pod (default: gpusPerNode x cpuPerRank)."
    )
    cpu_per_rank: Quantity = Field(
        default="4", description="CPU request of one rank when `cpu` is not set."
    )
    memory: Quantity | None = Field(
        default=None,
        description="Memory request and limit per Pod; it must hold the pinned budget and "
        "/dev/shm (default: gpusPerNode x memoryPerRank + pinned budget + shmSize).",
    )
    memory_per_rank: Quantity = Field(
        default="16Gi",
        description="Host memory of one rank besides the pinned budget and /dev/shm "
        "(process, host weights, loading) when `memory` is not set.",
    )
    ephemeral_storage: Quantity = Field(
        default="10Gi",
        description="Node disk per Pod (request and limit) for /tmp, the caches under $HOME "
        "and container logs; the root filesystem is read-only.",
    )


class DisruptionBudget(_Api):
    """How many engines voluntary disruptions (kubectl drain, evictions) may take down at once.

    One PodDisruptionBudget covers the deployment. Evicting one Pod of a multi-Pod engine
    stops that whole engine (the operator restarts it elsewhere), so the budget counts
    engines, not Pods; Pods that are not Ready are always evictable.
    """

    max_unavailable_engines: int = Field(
        default=1,
        ge=0,
        description="Engines that evictions may disrupt at the same time; 0 = healthy Pods "
        "are never evicted (a drain waits until you delete them).",
    )


class NetworkPolicy(_Api):
    """A NetworkPolicy per engine: its Pods talk freely to each other (NCCL, gloo and the
    rendezvous use ephemeral ports); from anywhere else only the HTTP port is open."""

    enabled: bool = Field(default=True, description="Render the per-engine NetworkPolicy.")


class Scheduling(_Api):
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None
    affinity: dict[str, Any] | None = None
    topology_key: str | None = Field(
        default=None,
        description="Node label that keeps all Pods of one engine in one domain "
        "(e.g. an NVLink or rack label).",
    )


class SecretKey(_Api):
    """A key of a Secret in the deployment's namespace."""

    name: str = Field(min_length=1, description="Secret name.")
    key: str = Field(default="api-key", min_length=1, description="Key inside the Secret.")


class DiffusionDeploymentSpec(_Api):
    """The desired state: ``replicas`` independent engines of one model."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "(self.parallelism.data * self.parallelism.sequence * self.parallelism.tensor)"
            " % self.gpusPerNode == 0",
            "the world size (data x sequence x tensor) must be divisible by gpusPerNode",
        )
    )

    model: ModelSource
    worker: WorkerImage
    replicas: int = Field(default=1, ge=0, description="Independent engines.")
    parallelism: Parallelism = Parallelism()
    gpus_per_node: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Ranks per Pod: GPUs, or CPU processes with accelerator none.",
    )
    accelerator: Accelerator = Field(
        default=Accelerator.NVIDIA_GPU,
        description="nvidia-gpu: one nvidia.com/gpu per rank (NCCL); none: CPU ranks with "
        "gloo and no GPU request, for demos and CI (much slower).",
    )
    dtype: DType = DType.AUTO
    quantization: Quantization = Quantization.NONE
    offload: Offload = Offload()
    resources: Resources = Resources()
    shm_size: Quantity = Field(default="16Gi", description="Size of the memory-backed /dev/shm.")
    scheduling: Scheduling = Scheduling()
    port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description=f"Worker HTTP port (not {RENDEZVOUS_PORT}, the engine's rendezvous port).",
        json_schema_extra=_cel(
            f"self != {RENDEZVOUS_PORT}",
            f"port {RENDEZVOUS_PORT} is the engine's torch rendezvous port (MASTER_PORT), "
            "which every worker Pod also listens on: choose another port",
        ),
    )
    api_key_secret: SecretKey | None = Field(
        default=None,
        description="Require 'Authorization: Bearer <key>' on generation routes, the key "
        "read from this Secret (health and metrics stay open). Default: no API key.",
    )
    termination_grace_period_seconds: int = Field(
        default=120, ge=0, description="Time for drain, DLO disable and process-group teardown."
    )
    log_level: LogLevel = Field(
        default=LogLevel.WARNING,
        description="Worker log level: warning is quiet; info adds the lifecycle (loading, "
        "ready, intake closed, DLO disabled, process groups destroyed) and a line per request.",
    )
    locked_memory: LockedMemory = LockedMemory.NONE
    disruption_budget: DisruptionBudget = DisruptionBudget()
    network_policy: NetworkPolicy = NetworkPolicy()


class Condition(_Api):
    type: str
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class EngineStatus(_Api):
    index: int
    phase: str
    """Pending, Ready, Updating, Failed, or BackingOff (failed, waiting for its restart)."""
    pods: list[str] = []
    restarts: int = 0
    consecutive_restarts: int = 0
    """Restarts since the engine last served for 10 minutes: the backoff's exponent."""
    last_restart_time: str | None = None
    next_restart_time: str | None = None
    """While backing off: when the engine is restarted."""
    reason: str | None = None
    """Why it does not run: StartupFailed, EngineFailed, ImagePullFailed, ConfigError,
    Unschedulable (its message says what the worker or the cluster reported)."""
    message: str | None = None


class CacheNodeStatus(_Api):
    node: str
    state: str
    """Pending, Warming, Warm or Failed."""
    reason: str = ""


class CacheStatus(_Api):
    """Per-node runtime-cache warming for the current identity."""

    warm_hash: str = ""
    warm: str = ""
    """``<warm nodes>/<eligible nodes>`` (a printer column)."""
    nodes: list[CacheNodeStatus] = []


class DiffusionDeploymentStatus(_Api):
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    """Engines whose Pods all run the current spec."""
    selector: str = ""
    observed_generation: int | None = None
    conditions: list[Condition] = []
    engines: list[EngineStatus] = []
    cache: CacheStatus | None = None
