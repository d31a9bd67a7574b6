"""Per-node runtime-cache warming (pure: no I/O, deterministic).

With the runtime cache enabled, every eligible node gets one Job that runs
``dlo-worker cache warm`` with the engines' own worker flags, the same image and the
node's cache hostPath, so the entry exists before (or while) engines start there and
their workers skip loading. Eligible: Ready, schedulable, carrying the spec's
nodeSelector labels and at least ``gpusPerNode`` allocatable GPUs (where engines can
run). The Job's name carries a hash of what decides the entry (image and flags): a spec
change that changes the identity renders new Jobs, and the old ones stop being rendered
(the operator never deletes cache entries; the node's size budget evicts them).

Each node's state comes from its Job: Pending (not started), Warming, Warm, Failed
(with the Job's reason). Engines prefer Warm nodes (a preferred node affinity).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from dlo_operator.api import (
    GROUP,
    Accelerator,
    CacheNodeStatus,
    CacheStatus,
    DiffusionDeploymentSpec,
)
from dlo_operator.workerconfig import worker_config
from dlo_worker.config import WorkerConfig, to_flags

LABEL_WARM_HASH = f"{GROUP}/cache-warm"
ANNOTATION_NODE = f"{GROUP}/node"
WARM_DEADLINE_S = 6 * 3600
"""A warm Job that has not finished by then (a hung copy of a huge model) is failed."""

PENDING, WARMING, WARM, FAILED = "Pending", "Warming", "Warm", "Failed"


@dataclass(frozen=True)
class ObservedNode:
    """What eligibility needs to know about a node."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    ready: bool = True
    schedulable: bool = True
    gpus: int = 0

    @classmethod
    def from_manifest(cls, node: dict[str, Any], gpu_resource: str) -> ObservedNode:
        metadata, spec, status = node["metadata"], node.get("spec") or {}, node.get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        allocatable = status.get("allocatable") or {}
        return cls(
            name=metadata["name"],
            labels=dict(metadata.get("labels") or {}),
            ready=conditions.get("Ready") == "True",
            schedulable=not spec.get("unschedulable", False),
            gpus=int(allocatable.get(gpu_resource, 0)),
        )


@dataclass(frozen=True)
class ObservedJob:
    """A warm Job: its node, the hash it warms for and how it ended (if it did)."""

    name: str
    node: str
    warm_hash: str
    state: str
    reason: str = ""

    @classmethod
    def from_manifest(cls, job: dict[str, Any]) -> ObservedJob:
        metadata, status = job["metadata"], job.get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        if conditions.get("Complete", {}).get("status") == "True":
            state, reason = WARM, ""
        elif conditions.get("Failed", {}).get("status") == "True":
            failed = conditions["Failed"]
            state = FAILED
            reason = f"{failed.get('reason', '')}: {failed.get('message', '')}".strip(": ")
        elif status.get("active"):
            state, reason = WARMING, ""
        else:
            state, reason = PENDING, ""
        return cls(
            name=metadata["name"],
            node=(metadata.get("annotations") or {}).get(ANNOTATION_NODE, ""),
            warm_hash=(metadata.get("labels") or {}).get(LABEL_WARM_HASH, ""),
            state=state,
            reason=reason,
        )


def warming_enabled(spec: DiffusionDeploymentSpec) -> bool:
    return spec.offload.enabled and spec.offload.runtime_cache.enabled


def warm_arguments(spec: DiffusionDeploymentSpec, config: WorkerConfig | None = None) -> list[str]:
    """``dlo-worker`` arguments of a warm Job: ``cache warm`` with the engines' flags."""
    return ["cache", "warm", *to_flags(config if config is not None else worker_config(spec))]


def eligible_nodes(spec: DiffusionDeploymentSpec, nodes: list[ObservedNode]) -> list[ObservedNode]:
    """Nodes an engine Pod could run on (see the module docstring), by name."""
    selector = spec.scheduling.node_selector or {}
    return sorted(
        (
            node
            for node in nodes
            if node.ready
            and node.schedulable
            and (spec.accelerator == Accelerator.NONE or node.gpus >= spec.gpus_per_node)
            and all(node.labels.get(key) == value for key, value in selector.items())
        ),
        key=lambda node: node.name,
    )


def job_name(deployment: str, template_hash: str, node: str) -> str:
    """``<deployment>-warm-<template hash>-<node hash>``: at most 63 characters, and a new
    name whenever the Job's template changes (a Job's template cannot be patched)."""
    node_digest = hashlib.sha256(node.encode()).hexdigest()[:8]
    return f"{deployment[:36]}-warm-{template_hash}-{node_digest}"


def cache_status(
    spec: DiffusionDeploymentSpec,
    nodes: list[ObservedNode],
    jobs: list[ObservedJob],
    current: str,
) -> CacheStatus:
    """Each eligible node's state for the current warm template (hash ``current``), and
    ``warm/eligible``."""
    by_node = {job.node: job for job in jobs if job.warm_hash == current}
    statuses = [
        CacheNodeStatus(
            node=node.name,
            state=by_node[node.name].state if node.name in by_node else PENDING,
            reason=by_node[node.name].reason if node.name in by_node else "",
        )
        for node in eligible_nodes(spec, nodes)
    ]
    warm = sum(status.state == WARM for status in statuses)
    return CacheStatus(warm_hash=current, warm=f"{warm}/{len(statuses)}", nodes=statuses)


def warm_nodes(status: CacheStatus | None) -> list[str]:
    return [node.node for node in status.nodes if node.state == WARM] if status else []
