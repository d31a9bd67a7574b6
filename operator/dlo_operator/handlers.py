"""kopf wiring: every trigger runs the same idempotent sync; all decisions live in reconcile.

Triggers: the DiffusionDeployment's create/resume/update, a 10 s timer, and any
event of a child Pod (a failed or deleted rank restarts its engine promptly).
I/O only: read the object and its Pods, call :func:`dlo_operator.reconcile.reconcile`,
create and delete what it says (409/404 are success: another sync did it),
patch status and post Events.

Run it with ``dlo-operator`` (:mod:`dlo_operator.__main__`).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes import client, utils
from kubernetes import config as kube_config
from pydantic import ValidationError

from dlo_operator.api import (
    GROUP,
    PLURAL,
    VERSION,
    DiffusionDeploymentSpec,
    DiffusionDeploymentStatus,
)
from dlo_operator.reconcile import Actions, Event, ObservedPod, deletion_order, reconcile
from dlo_operator.render import LABEL_DEPLOYMENT, Owner

ANNOTATION_PREFIX = GROUP
TIMER_INTERVAL_S = 10.0

_api: client.ApiClient | None = None


def api() -> client.ApiClient:
    """One client per process: in-cluster credentials, else the kubeconfig."""
    global _api  # noqa: PLW0603 (process-wide client, created on first use)
    if _api is None:
        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        _api = client.ApiClient()
    return _api


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING


def _post(body: dict[str, Any], events: list[Event]) -> None:
    for event in events:
        kopf.event(
            body,
            type="Warning" if event.warning else "Normal",
            reason=event.reason,
            message=event.message,
        )


def _apply(namespace: str, actions: Actions) -> None:
    core = client.CoreV1Api(api())
    for item in actions.create:
        try:
            utils.create_from_dict(api(), item, namespace=namespace)
        except utils.FailToCreateError as failure:
            if any(error.status != 409 for error in failure.api_exceptions):
                raise
    for name in actions.delete_pods:
        try:
            core.delete_namespaced_pod(name, namespace)
        except client.ApiException as error:
            if error.status != 404:
                raise


def sync(name: str, namespace: str) -> None:
    """Bring one DiffusionDeployment's children and status in line with its spec."""
    objects = client.CustomObjectsApi(api())
    try:
        body = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except client.ApiException as error:
        if error.status == 404:
            return
        raise
    metadata = body["metadata"]
    if metadata.get("deletionTimestamp"):
        return
    generation = metadata.get("generation", 0)
    try:
        spec = DiffusionDeploymentSpec.model_validate(body["spec"])
        previous = DiffusionDeploymentStatus.model_validate(body.get("status") or {})
    except ValidationError as error:
        message = f"spec does not match the API models: {error.errors()[0]['msg']}"
        _post(body, [Event("InvalidSpec", message, warning=True)])
        return
    pods = (
        client.CoreV1Api(api())
        .list_namespaced_pod(namespace, label_selector=f"{LABEL_DEPLOYMENT}={name}")
        .items
    )
    observed = [ObservedPod.from_manifest(api().sanitize_for_serialization(p)) for p in pods]
    owner = Owner(name=name, namespace=namespace, uid=metadata["uid"])
    actions = reconcile(owner, spec, generation, observed, previous)
    _apply(namespace, actions)
    status = actions.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": status}
    )
    _post(body, actions.events)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_change(name: str, namespace: str, **_: Any) -> None:
    sync(name, namespace)


@kopf.timer(GROUP, VERSION, PLURAL, interval=TIMER_INTERVAL_S)
def on_timer(name: str, namespace: str, **_: Any) -> None:
    sync(name, namespace)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_delete(name: str, namespace: str, **_: Any) -> None:
    """Stop every engine's worker ranks before its leader; owner references do the rest.

    Retried until the workers are gone, then the leaders are deleted and kopf releases
    its finalizer so the garbage collector removes Services and budgets.
    """
    core = client.CoreV1Api(api())
    pods = [
        ObservedPod.from_manifest(api().sanitize_for_serialization(pod))
        for pod in core.list_namespaced_pod(
            namespace, label_selector=f"{LABEL_DEPLOYMENT}={name}"
        ).items
    ]
    workers = [pod for pod in pods if pod.node_rank > 0]
    targets = workers or pods
    for pod_name in deletion_order(targets):
        try:
            core.delete_namespaced_pod(pod_name, namespace)
        except client.ApiException as error:
            if error.status != 404:
                raise
    if workers or any(not pod.terminating for pod in pods):
        raise kopf.TemporaryError("waiting for the ranks to stop", delay=2)


@kopf.on.event("", "v1", "pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def on_pod_event(labels: dict[str, str], namespace: str, **_: Any) -> None:
    sync(labels[LABEL_DEPLOYMENT], namespace)
