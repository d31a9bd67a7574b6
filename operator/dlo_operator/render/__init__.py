"""DiffusionDeployment -> Kubernetes manifests (pure: no I/O, deterministic), one module per
kind of object: :mod:`.engine_pod`, :mod:`.services`, :mod:`.budget`, :mod:`.warm_job`,
from the parts in :mod:`.identity` and :mod:`.pod_spec`.

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

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from dlo_operator.api import DiffusionDeploymentSpec
from dlo_operator.render.budget import budget_min_available, render_budget
from dlo_operator.render.engine_pod import (
    CONTAINER,
    NRI_ULIMIT_ANNOTATION,
    render_engine_pods,
    render_pod,
    worker_arguments,
)
from dlo_operator.render.identity import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_SPEC_HASH,
    LABEL_DEPLOYMENT,
    LABEL_ENGINE,
    LABEL_NODE_RANK,
    LABEL_ROLE,
    Owner,
    pod_name,
    pods_per_engine,
    selector,
    spec_hash,
)
from dlo_operator.render.pod_spec import GPU_RESOURCE, WORKER_UID
from dlo_operator.render.services import (
    render_client_service,
    render_engine_service,
    render_network_policy,
)
from dlo_operator.render.warm_job import (
    render_warm_job,
    template_hash,
    warm_template,
    warm_template_hash,
)
from dlo_operator.warming import warming_enabled

__all__ = [
    "ANNOTATION_CONFIG_HASH",
    "ANNOTATION_SPEC_HASH",
    "CONTAINER",
    "GPU_RESOURCE",
    "LABEL_DEPLOYMENT",
    "LABEL_ENGINE",
    "LABEL_NODE_RANK",
    "LABEL_ROLE",
    "NRI_ULIMIT_ANNOTATION",
    "WORKER_UID",
    "Owner",
    "budget_min_available",
    "pod_name",
    "pods_per_engine",
    "render_children",
    "render_client_service",
    "render_engine_pods",
    "render_pod",
    "render_warm_job",
    "selector",
    "spec_hash",
    "template_hash",
    "warm_template",
    "warm_template_hash",
    "worker_arguments",
]


def _with_config_hash(item: dict[str, Any]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(item, sort_keys=True).encode()).hexdigest()[:16]
    item["metadata"].setdefault("annotations", {})[ANNOTATION_CONFIG_HASH] = digest
    return item


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
