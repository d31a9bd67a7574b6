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

from dlo_worker.config import CompileMode, DType, Quantization, SkipLoad, Staging
from dlo_worker.config.values import LORA_NAME_PATTERN

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
    """cudaHostRegister/cudaHostAlloc need no RLIMIT_MEMLOCK (docs/limits.md); the default."""
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


RESERVED_ENV_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    "HOME",
    "USER",
)
"""Variables the operator or torchrun sets on every rank; with any ``DLO_`` or
``TORCHELASTIC_`` name they are refused in ``worker.env``."""
RESERVED_ENV_PREFIXES = ("DLO_", "TORCHELASTIC_")
RESERVED_METADATA_PREFIX = f"{GROUP}/"
"""Labels and annotations under this prefix are the operator's own (selectors, hashes)."""


class EnvVar(_Api):
    """An extra environment variable of every rank (e.g. an NCCL setting), as in a Pod."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both"
        )
    )

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
        description="Variable name; names the operator or torchrun sets are refused.",
    )
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="A Pod EnvVarSource: secretKeyRef, configMapKeyRef, fieldRef or "
        "resourceFieldRef.",
    )


class LocalObjectReference(_Api):
    """An object in the deployment's namespace, by name."""

    name: str = Field(min_length=1, description="Object name.")


def _env_rule() -> dict[str, Any]:
    names = ", ".join(f"'{name}'" for name in RESERVED_ENV_NAMES)
    prefixes = " || ".join(f"e.name.startsWith('{prefix}')" for prefix in RESERVED_ENV_PREFIXES)
    return _cel(
        f"self.all(e, !(e.name in [{names}]) && !({prefixes}))",
        "worker.env: the operator and torchrun set "
        + ", ".join(RESERVED_ENV_NAMES)
        + " and every DLO_ or TORCHELASTIC_ variable; use the matching spec field instead",
    )


class WorkerImage(_Api):
    """The worker container: its image and what the platform adds to it."""

    image: str = Field(min_length=1, description="Worker container image (entrypoint dlo-worker).")
    image_pull_policy: ImagePullPolicy = Field(
        default=ImagePullPolicy.IF_NOT_PRESENT,
        description="When the kubelet pulls the image (as in a Pod).",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default=[], description="Secrets for pulling the image from a private registry."
    )
    env: list[EnvVar] = Field(
        default=[],
        max_length=128,
        description="Extra environment variables of every rank and of the cache-warming Jobs.",
        json_schema_extra=_env_rule(),
    )
    service_account_name: str | None = Field(
        default=None,
        min_length=1,
        description="ServiceAccount of the worker Pods (default: the namespace's default).",
    )
    automount_service_account_token: bool = Field(
        default=False,
        description="Mount the ServiceAccount's API token into the worker Pods; the worker "
        "never calls the API, so only sidecars or platform agents need it.",
    )


class Hsdp(_Api):
    """Hybrid sharding of the host weights: shard within groups, replicate across them."""

    enabled: bool = Field(default=False, description="Shard over groups of shardSize ranks.")
    shard_size: int = Field(default=-1, ge=-1, description="-1 = world size / replicate size.")
    replicate_size: int = Field(default=1, ge=1, description="Groups holding a full copy.")


class Compile(_Api):
    """torch.compile of each DiT's repeated blocks (the worker's ``--compile``)."""

    enabled: bool = Field(
        default=False,
        description="Compile each DiT's blocks, one graph per block, resident or streamed "
        "alike; each engine's first step compiles.",
    )
    mode: CompileMode = Field(
        default=CompileMode.DEFAULT,
        description="torch.compile mode: default, max-autotune-no-cudagraphs, or "
        "reduce-overhead (CUDA graphs over each block, resident or streamed; nvidia-gpu "
        "only). Compiled graphs are kept on an emptyDir, or beside the runtime cache on "
        "the node when it is enabled.",
    )


MAX_LORAS = 16
MAX_PATH_LENGTH = 1024


class Lora(_Api):
    """A LoRA adapter every engine loads at start (the worker's ``--lora``), mounted
    read-only; exactly one source."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.hostPath), has(self.persistentVolumeClaim), "
                    "has(self.imagePath)].filter(x, x).size() == 1",
                    "message": "set exactly one of hostPath, persistentVolumeClaim, imagePath",
                },
                {
                    "rule": "!has(self.subPath) || has(self.persistentVolumeClaim)",
                    "message": "subPath applies to persistentVolumeClaim only",
                },
            ]
        }
    )

    name: str = Field(
        pattern=LORA_NAME_PATTERN,
        max_length=64,
        description="The name requests choose it by (loras[].name); unique in the list.",
    )
    scale: float = Field(
        default=1.0,
        ge=-10.0,
        le=10.0,
        description="Its scale in requests that name no adapters (every adapter applies), "
        "or the scale it is fused at.",
    )
    fuse: bool = Field(
        default=False,
        description="Fuse it into the model's weights at start (the worker's --fuse-lora): "
        "no per-step cost, it always applies and requests cannot choose it. The model then "
        "loads into private memory or a runtime-cache entry of its own, never a shared "
        "checkpoint mapping.",
    )
    # Path lengths bounded so the API server's CEL cost estimate fits a list of adapters.
    host_path: str | None = _absolute_path(
        "A LoRA safetensors file, or a directory holding one, on every node.",
        default=None,
        max_length=MAX_PATH_LENGTH,
    )
    persistent_volume_claim: str | None = Field(
        default=None, min_length=1, description="Name of a PVC in the same namespace."
    )
    sub_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="The adapter's file or directory inside the PVC (default: its root).",
        json_schema_extra=_cel(
            "!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
            "must be a relative path without '..'",
        ),
    )
    image_path: str | None = _absolute_path(
        "Path of an adapter baked into the worker image (no volume).",
        default=None,
        max_length=MAX_PATH_LENGTH,
    )


class Parallelism(_Api):
    """Parallel sizes of one engine; its world size is data x sequence x tensor."""

    data: int = Field(default=1, ge=1, description="DP ranks (request lanes) per engine.")
    sequence: int = Field(default=1, ge=1, description="SP ranks per engine.")
    tensor: int = Field(default=1, ge=1, description="TP ranks per engine.")
    hsdp: Hsdp = Field(default=Hsdp(), description="Hybrid-sharded host weights.")

    @property
    def world_size(self) -> int:
        return self.data * self.sequence * self.tensor


class RuntimeCache(_Api):
    """The node-local runtime weight cache (no-AllGather only)."""

    enabled: bool = Field(default=False, description="Serve DiT weights from the node cache.")
    host_path: str = _absolute_path(
        "Node directory holding cache entries; the same path on every node so engines on a "
        "node share one copy.",
        default="/var/cache/dlo-worker",
    )
    lock_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="How long a worker waits for another process building the same entry.",
    )
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


class StagingOptions(_Api):
    """How rank-local DLO packs mapped blocks (a checkpoint mapping or runtime-cache entry
    that is not registered) for the copy engine."""

    mode: Staging = Field(
        default=Staging.AUTO,
        description="ring (the native ring of cache-sized chunks), buffers (block-sized "
        "pinned buffers), or auto: the ring where the worker image built it, else buffers.",
    )
    chunk_mib: int | None = Field(
        default=None,
        ge=1,
        le=256,
        alias="chunkMiB",
        description="Chunk size (MiB) of the staging ring (default: from the node CPU's "
        "last-level cache).",
    )
    pack_threads: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Threads per rank that pack mapped blocks (default: the rank's share of "
        "the CPUs it may run on less 2, at most 8).",
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
    max_gpu_memory_gib: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        alias="maxGpuMemoryGiB",
        description="GPU memory (GiB) each worker's pipeline may use, activations included: "
        "planned per component at start (the DiT streamed only where the pipeline does not "
        "fit, with enabled false; a T5 text encoder streamed too where needed) and "
        "enforced on a larger GPU. Instead of gpuMemoryBudgetGiB and residentLayers; "
        "no-AllGather.",
    )
    stream_text_encoders: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="Text encoder components streamed through the DiT's slots (e.g. "
        "text_encoder_2, a T5; no-AllGather). maxGpuMemoryGiB chooses them when empty.",
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
    runtime_cache: RuntimeCache = Field(
        default=RuntimeCache(), description="The node-local runtime weight cache."
    )
    staging: StagingOptions = Field(
        default=StagingOptions(), description="How mapped blocks are packed for the GPU."
    )


class Resources(_Api):
    """Per-Pod CPU and memory (GPUs come from gpusPerNode).

    Every Pod gets a CPU request and a memory request equal to its limit: explicit
    per-Pod values win, otherwise they are derived per rank (see the fields). No CPU
    limit is set: CFS throttling would stall the pack threads and NCCL's proxy threads.
    """

    cpu: Quantity | None = Field(
        default=None, description="CPU request per Pod (default: gpusPerNode x cpuPerRank)."
    )
    cpu_per_rank: Quantity | None = Field(
        default=None,
        description="CPU request of one rank when `cpu` is not set (default: where the rank "
        "packs mapped blocks for its copies - rank-local DLO on GPUs without a pin limit - "
        "its pack threads, offload.staging.packThreads or 8, plus 2 for its model thread "
        "and the staging ring's feeder; else 4).",
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
    """Where engine Pods may run; the operator adds one Pod per node and warm-node
    preference on top."""

    node_selector: dict[str, str] | None = Field(
        default=None, description="Node labels every worker Pod requires."
    )
    tolerations: list[dict[str, Any]] | None = Field(
        default=None, description="Pod tolerations (also on the cache-warming Jobs)."
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Extra Pod affinity terms, merged with the operator's own.",
    )
    priority_class_name: str | None = Field(
        default=None,
        min_length=1,
        description="PriorityClass of the worker Pods (and the cache-warming Jobs).",
    )
    topology_spread_constraints: list[dict[str, Any]] | None = Field(
        default=None, description="Pod topologySpreadConstraints of the worker Pods."
    )
    topology_key: str | None = Field(
        default=None,
        description="Node label that keeps all Pods of one engine in one domain "
        "(e.g. an NVLink or rack label).",
    )


class SecretKey(_Api):
    """A key of a Secret in the deployment's namespace."""

    name: str = Field(min_length=1, description="Secret name.")
    key: str = Field(default="api-key", min_length=1, description="Key inside the Secret.")


def _metadata_rule(what: str) -> dict[str, Any]:
    return _cel(
        f"self.all(key, !key.startsWith('{RESERVED_METADATA_PREFIX}'))",
        f"podMetadata.{what}: keys under {RESERVED_METADATA_PREFIX} are the operator's own",
    )


class PodMetadata(_Api):
    """Labels and annotations added to every worker Pod and cache-warming Pod (mesh
    injection, cost allocation, policy selectors)."""

    labels: dict[str, str] = Field(
        default={},
        max_length=64,
        description="Extra Pod labels.",
        json_schema_extra=_metadata_rule("labels"),
    )
    annotations: dict[str, str] = Field(
        default={},
        max_length=64,
        description="Extra Pod annotations.",
        json_schema_extra=_metadata_rule("annotations"),
    )


class Serve(_Api):
    """How each engine's HTTP server treats requests."""

    max_queued_requests: int = Field(
        default=64, ge=1, description="Requests waiting beyond this are answered 429."
    )
    default_steps: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="Denoising steps of a request that names none (default: 25).",
    )
    default_width: int | None = Field(
        default=None,
        ge=1,
        le=8192,
        description="Image width of a request that names none (default: the pipeline's).",
    )
    default_height: int | None = Field(
        default=None,
        ge=1,
        le=8192,
        description="Image height of a request that names none (default: the pipeline's).",
    )


class Metrics(_Api):
    """Prometheus metrics of the workers (``/metrics`` on the HTTP port)."""

    scrape_annotations: bool = Field(
        default=True,
        description="Annotate worker Pods with prometheus.io/scrape, port and path.",
    )


class DiffusionDeploymentSpec(_Api):
    """The desired state: ``replicas`` independent engines of one model."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "(self.parallelism.data * self.parallelism.sequence * self.parallelism.tensor)"
            " % self.gpusPerNode == 0",
            "the world size (data x sequence x tensor) must be divisible by gpusPerNode",
        )
    )

    model: ModelSource = Field(description="The diffusers-format model directory.")
    worker: WorkerImage = Field(description="The worker container.")
    replicas: int = Field(default=1, ge=0, description="Independent engines.")
    parallelism: Parallelism = Field(
        default=Parallelism(), description="Parallel sizes of each engine."
    )
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
    dtype: DType = Field(
        default=DType.AUTO, description="Compute dtype (auto: the checkpoint's own)."
    )
    quantization: Quantization = Field(
        default=Quantization.NONE, description="Weight quantization of the streamed DiT blocks."
    )
    offload: Offload = Field(default=Offload(), description="Distributed layerwise offload.")
    compile: Compile = Field(default=Compile(), description="Compiled DiT blocks.")
    loras: list[Lora] = Field(
        default_factory=list,
        max_length=MAX_LORAS,
        description="LoRA adapters every engine loads at start; requests choose among them "
        "(all apply by default). A change rolls the engines.",
        json_schema_extra=_cel(
            "self.all(x, self.exists_one(y, y.name == x.name))",
            "each LoRA adapter needs a name of its own",
        ),
    )
    resources: Resources = Field(default=Resources(), description="CPU, memory and disk per Pod.")
    shm_size: Quantity = Field(default="16Gi", description="Size of the memory-backed /dev/shm.")
    scheduling: Scheduling = Field(default=Scheduling(), description="Where worker Pods run.")
    pod_metadata: PodMetadata = Field(
        default=PodMetadata(), description="Extra labels and annotations of the Pods."
    )
    serve: Serve = Field(default=Serve(), description="Request handling of each engine.")
    metrics: Metrics = Field(default=Metrics(), description="Prometheus scraping of the workers.")
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
    locked_memory: LockedMemory = Field(
        default=LockedMemory.NONE,
        description="How workers get a locked-memory limit: None, IpcLock or NriUlimit.",
    )
    disruption_budget: DisruptionBudget = Field(
        default=DisruptionBudget(), description="Engines evictions may take down at once."
    )
    network_policy: NetworkPolicy = Field(
        default=NetworkPolicy(), description="Per-engine network isolation."
    )


class Condition(_Api):
    """A Kubernetes-style condition: Available, Progressing or Degraded."""

    type: str = Field(description="Available, Progressing or Degraded.")
    status: str = Field(pattern="^(True|False|Unknown)$", description="True, False or Unknown.")
    reason: str = Field(description="One CamelCase word (docs/operator.md lists them).")
    message: str = Field(default="", description="What happened, for people.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, description="The spec generation this condition describes."
    )


class EngineStatus(_Api):
    """One engine: its Pods, phase, restarts and why it does not run."""

    index: int = Field(description="Engine number (Pods <name>-e<index>-n<node>).")
    phase: str = Field(
        description="Pending, Ready, Updating, Failed, or BackingOff (failed, waiting for "
        "its restart)."
    )
    pods: list[str] = Field(default=[], description="Names of the engine's Pods.")
    restarts: int = Field(default=0, description="Times the operator restarted the engine.")
    consecutive_restarts: int = Field(
        default=0,
        description="Restarts since the engine last served for 10 minutes: the backoff's exponent.",
    )
    last_restart_time: str | None = Field(default=None, description="When it last restarted.")
    next_restart_time: str | None = Field(
        default=None, description="While backing off: when the engine is restarted."
    )
    reason: str | None = Field(
        default=None,
        description="Why it does not run: StartupFailed, EngineFailed, ImagePullFailed, "
        "VolumeMountFailed, ConfigError, Unschedulable.",
    )
    message: str | None = Field(
        default=None, description="What the worker or the cluster reported."
    )


class CacheNodeStatus(_Api):
    """One node's runtime-cache warming."""

    node: str = Field(description="Node name.")
    state: str = Field(description="Pending, Warming, Warm or Failed.")
    reason: str = Field(default="", description="Why it is not Warm.")


class CacheStatus(_Api):
    """Per-node runtime-cache warming for the current identity."""

    warm_hash: str = Field(default="", description="Hash of the warm Jobs' template.")
    warm: str = Field(default="", description="<warm nodes>/<eligible nodes> (a printer column).")
    nodes: list[CacheNodeStatus] = Field(default=[], description="Per-node warming.")


class DiffusionDeploymentStatus(_Api):
    """What the operator observed; docs/operator.md#status explains every field."""

    replicas: int = Field(default=0, description="Engines that exist.")
    ready_replicas: int = Field(
        default=0, description="Engines serving requests (old or current spec)."
    )
    updated_replicas: int = Field(
        default=0, description="Engines whose Pods all run the current spec."
    )
    selector: str = Field(default="", description="Label selector of the Pods (scale).")
    observed_generation: int | None = Field(
        default=None, description="The spec generation the operator last reconciled."
    )
    conditions: list[Condition] = Field(default=[], description="Available, Progressing, Degraded.")
    engines: list[EngineStatus] = Field(default=[], description="Per-engine status.")
    cache: CacheStatus | None = Field(
        default=None, description="Runtime-cache warming (when the cache is enabled)."
    )
