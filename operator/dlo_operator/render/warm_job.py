"""The runtime cache's warm Jobs: one template with the engines' flags, image, volumes and
hardening, pinned to each node that warms (pure)."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from dlo_operator.api import DiffusionDeploymentSpec, LockedMemory
from dlo_operator.render.identity import LABEL_DEPLOYMENT, Owner, child_metadata
from dlo_operator.render.pod_spec import (
    GPU_RESOURCE,
    WORKER_HOME,
    WORKER_USER,
    container_resources,
    extra_env,
    platform_fields,
    runtime_cache_owner_container,
    security_contexts,
    volumes_and_mounts,
)
from dlo_operator.warming import (
    ANNOTATION_NODE,
    LABEL_WARM_HASH,
    WARM_DEADLINE_S,
    job_name,
    warm_arguments,
)
from dlo_worker.config import WorkerConfig


def warm_template(
    spec: DiffusionDeploymentSpec, config: WorkerConfig | None = None
) -> dict[str, Any]:
    """The Pod template of every warm Job (:mod:`dlo_operator.warming`), before its node:
    ``dlo-worker cache warm`` with the engines' flags, image, volumes and hardening,
    without GPUs. Its Pod does not carry the deployment label: it is not an engine Pod."""
    pod_security, container_security = security_contexts(spec)
    if spec.locked_memory == LockedMemory.IPC_LOCK:
        # Warming pins nothing: it keeps the non-root user.
        container_security = {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    volumes, mounts = volumes_and_mounts(spec)
    resources = {
        kind: {key: value for key, value in values.items() if key != GPU_RESOURCE}
        for kind, values in container_resources(spec).items()
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        **platform_fields(spec),
        "enableServiceLinks": False,
        "securityContext": pod_security,
        "initContainers": [runtime_cache_owner_container(spec)],
        "containers": [
            {
                "name": "warm",
                "image": spec.worker.image,
                "imagePullPolicy": spec.worker.image_pull_policy.value,
                "command": ["dlo-worker", *warm_arguments(spec, config)],
                "env": [
                    {"name": "HOME", "value": WORKER_HOME},
                    {"name": "USER", "value": WORKER_USER},
                    *extra_env(spec),
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
        "metadata": child_metadata(
            owner, job_name(owner.name, digest, node), labels, {ANNOTATION_NODE: node}
        ),
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": WARM_DEADLINE_S,
            "template": template,
        },
    }
