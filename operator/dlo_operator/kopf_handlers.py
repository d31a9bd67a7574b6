"""kopf's handlers, wired onto one :class:`~dlo_operator.controller.Controller`.

Triggers: the DiffusionDeployment's create/resume/update, a 10 s timer that asks whether
a pass is due, its deletion (drain, then let go of the finalizer), and the events of its
Pods, Services, budgets, policies and warm Jobs, which queue a pass. Each handler only
translates kopf's arguments into a call of the controller; the indexes below keep what a
pass reads, fed by the watches kopf runs for those events anyway.

:func:`register` puts the handlers on a registry (``dlo-operator`` passes its own to
``kopf.run``), so one process holds exactly the controller it constructed.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from dlo_operator.api import GROUP, PLURAL, VERSION
from dlo_operator.controller import (
    CHILD_KINDS,
    DEPLOYMENT_INDEX,
    POD_INDEX,
    TIMER_INTERVAL_S,
    Controller,
    DeploymentKey,
)
from dlo_operator.reconcile import ObservedChild, ObservedPod
from dlo_operator.render import LABEL_DEPLOYMENT
from dlo_operator.warming import ObservedJob

ANNOTATION_PREFIX = GROUP
MAX_RETRY_DELAY_S = 60.0
DRAIN_WAIT = "waiting for the engines to drain"


class DrainWaitIsNotAnError(logging.Filter):
    """kopf logs every retry of a handler at ERROR (and posts it as an Event); the deletion
    handler retries while the engines drain, which is how every normal delete goes. Those
    records become INFO: shown with ``--verbose``, never posted, never an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if DRAIN_WAIT not in record.getMessage():
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        return logging.getLogger("dlo_operator").isEnabledFor(logging.INFO)


async def index_pod(namespace: str, labels: dict[str, str], body: Any, **_: Any) -> dict:
    return {(namespace, labels[LABEL_DEPLOYMENT]): ObservedPod.from_manifest(body)}


async def index_child(
    namespace: str, labels: dict[str, str], body: Any, param: str, **_: Any
) -> dict:
    child = ObservedChild.from_manifest(param, body)
    job = ObservedJob.from_manifest(body) if param == "Job" else None
    return {(namespace, labels[LABEL_DEPLOYMENT]): (child, job)}


async def index_deployment(namespace: str, name: str, body: Any, **_: Any) -> dict:
    """What a pass reads of the deployment, copied (not its managedFields)."""
    metadata = body["metadata"]
    kept = ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp")
    return {
        (namespace, name): {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {key: metadata[key] for key in kept if key in metadata},
            "spec": copy.deepcopy(dict(body.get("spec") or {})),
            "status": copy.deepcopy(dict(body.get("status") or {})),
        }
    }


def register(controller: Controller, registry: kopf.OperatorRegistry) -> None:
    """Put every handler and index on ``registry``, each calling ``controller``."""
    present = {LABEL_DEPLOYMENT: kopf.PRESENT}
    # A registry of one's own has none of kopf's fallback logins: log in with the
    # kubernetes client's credentials (in-cluster, else the kubeconfig), as kopf would.
    kopf.on.login(registry=registry)(kopf.login_via_client)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=ANNOTATION_PREFIX
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.posting.level = logging.WARNING
        objects = logging.getLogger("kopf.objects")
        if not any(isinstance(f, DrainWaitIsNotAnError) for f in objects.filters):
            objects.addFilter(DrainWaitIsNotAnError())
        # kopf hands its (live) indexes to every handler; the queue's threads read them.
        controller.start(kwargs)

    kopf.index(GROUP, VERSION, PLURAL, id=DEPLOYMENT_INDEX, registry=registry)(index_deployment)
    kopf.index("", "v1", "pods", id=POD_INDEX, labels=present, registry=registry)(index_pod)
    for kind, child in CHILD_KINDS.items():
        kopf.index(*child.resource, id=child.index, param=kind, labels=present, registry=registry)(
            index_child
        )

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    def on_change(name: str, namespace: str, retry: int, **_: Any) -> None:
        """Retried with a growing delay while the API server refuses something (the
        status, an Event and one log line per refusal already say what); the timer and
        Pod events keep reconciling meanwhile."""
        if failures := controller.sync(DeploymentKey(namespace, name)):
            delay = min(MAX_RETRY_DELAY_S, 2.0 ** min(retry + 1, 6))
            raise kopf.TemporaryError(f"{len(failures)} action(s) refused", delay=delay)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=TIMER_INTERVAL_S, registry=registry)
    def on_timer(name: str, namespace: str, spec: Any, **_: Any) -> None:
        cache = ((spec.get("offload") or {}).get("runtimeCache") or {}).get("enabled", False)
        key = DeploymentKey(namespace, name)
        if controller.pass_due_now(key, warming=bool(cache)):
            controller.sync(key)

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    def on_delete(name: str, namespace: str, **_: Any) -> None:
        """Hold kopf's finalizer until every Pod is gone, so ``kubectl delete`` returns
        once the engines have drained; the garbage collector then removes the rest."""
        if not controller.delete(DeploymentKey(namespace, name)):
            raise kopf.TemporaryError(DRAIN_WAIT, delay=2)

    @kopf.on.event("", "v1", "pods", labels=present, registry=registry)
    async def on_pod_event(
        labels: dict[str, str], namespace: str, body: Any, uid: str, **kwargs: Any
    ) -> None:
        key = DeploymentKey(namespace, labels[LABEL_DEPLOYMENT])
        controller.pod_event(kwargs["type"], uid, key, ObservedPod.from_manifest(body))

    @kopf.on.event("", "v1", "services", labels=present, registry=registry)
    @kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=present, registry=registry)
    @kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=present, registry=registry)
    async def on_child_event(
        labels: dict[str, str], namespace: str, body: Any, uid: str, **kwargs: Any
    ) -> None:
        key = DeploymentKey(namespace, labels[LABEL_DEPLOYMENT])
        child = ObservedChild.from_manifest(body["kind"], body)
        controller.child_event(kwargs["type"], uid, key, child)

    @kopf.on.event("batch", "v1", "jobs", labels=present, registry=registry)
    async def on_warm_job_event(
        labels: dict[str, str], namespace: str, name: str, **_: Any
    ) -> None:
        controller.job_event(DeploymentKey(namespace, labels[LABEL_DEPLOYMENT]), name)
