"""An engine's Pods: torchrun through ``dlo-worker launch`` with the worker's own flags,
the torch distributed environment, probes, the drain timing and placement (pure)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dlo_operator.api import RENDEZVOUS_PORT, DiffusionDeploymentSpec, LockedMemory
from dlo_operator.render.identity import (
    ANNOTATION_SPEC_HASH,
    LABEL_NODE_RANK,
    LABEL_ROLE,
    ROLE_LEADER,
    ROLE_WORKER,
    Owner,
    child_metadata,
    engine_labels,
    engine_service_name,
    pod_name,
    pods_per_engine,
    spec_hash,
)
from dlo_operator.render.pod_spec import (
    WORKER_HOME,
    WORKER_USER,
    container_resources,
    extra_env,
    platform_fields,
    runtime_cache_owner_container,
    security_contexts,
    volumes_and_mounts,
)
from dlo_operator.workerconfig import memory_floor_bytes, worker_config
from dlo_worker.config import WorkerConfig, to_flags
from dlo_worker.observability.logs import LOG_LEVEL_ENV

CONTAINER = "worker"
MASTER_PORT = RENDEZVOUS_PORT
TORCHRUN_EXIT_MARGIN_S = 10
ENDPOINT_REMOVAL_DELAY_S = 5
API_KEY_ENV = "DLO_API_KEY"
"""The worker reads its API key from this variable (``dlo-worker serve --api-key``)."""
NRI_ULIMIT_ANNOTATION = f"ulimits.nri.containerd.io/container.{CONTAINER}"
STARTUP_BUDGET_S = 3600


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
    env += extra_env(spec)
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
    same_engine = {"labelSelector": {"matchLabels": engine_labels(owner, engine)}}
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
        **engine_labels(owner, engine),
        LABEL_NODE_RANK: str(node),
        LABEL_ROLE: ROLE_LEADER if node == 0 else ROLE_WORKER,
    }
    annotations = {
        **spec.pod_metadata.annotations,
        **_scrape_annotations(spec),
        ANNOTATION_SPEC_HASH: spec_hash(spec),
    }
    pod_security, container_security = security_contexts(spec)
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
        "resources": container_resources(spec),
        "securityContext": container_security,
        # The worker writes its one-line error to /dev/termination-log; a crash without one
        # leaves its last log lines there. The operator reports either in the status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **_probes(spec),
    }
    if delay := endpoint_removal_delay(spec):
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": delay}}}
    volumes, mounts = volumes_and_mounts(spec)
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
        **platform_fields(spec),
        # Service links would add <SERVICE>_PORT variables next to torch's own environment.
        "enableServiceLinks": False,
        "securityContext": pod_security,
        "containers": [container],
        "volumes": volumes,
        "affinity": _affinity(owner, spec, engine, warm),
    }
    if any(volume["name"] == "runtime-cache" for volume in volumes):
        pod_spec["initContainers"] = [runtime_cache_owner_container(spec)]
    if spec.scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(spec.scheduling.node_selector)
    if spec.scheduling.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [
            dict(c) for c in spec.scheduling.topology_spread_constraints
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(owner, pod_name(owner, engine, node), labels, annotations),
        "spec": pod_spec,
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
