"""What ties a child to its DiffusionDeployment: labels, annotations, names, the owner
reference and the spec hash (pure)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from dlo_operator.api import GROUP, KIND, VERSION, DiffusionDeploymentSpec

LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ENGINE = f"{GROUP}/engine"
LABEL_NODE_RANK = f"{GROUP}/node-rank"
LABEL_ROLE = f"{GROUP}/role"
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
"""On every child but Pods: a hash of the rendered object, so a changed rendering is patched."""
ROLE_LEADER, ROLE_WORKER = "leader", "worker"


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


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(
    owner: Owner, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    metadata = {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        metadata["annotations"] = annotations
    return metadata


def engine_labels(owner: Owner, engine: int) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: owner.name, LABEL_ENGINE: str(engine)}
