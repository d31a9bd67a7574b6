"""Kubernetes Events about a DiffusionDeployment, posted with the API client from any thread.

kopf's ``kopf.event()`` reads its settings from the handler's context, which the work
queue's threads (:mod:`dlo_operator.workqueue`) do not have: there it raises
``LookupError`` and the Event is lost. Passes run on both, so every Event goes through
:func:`post_event`, which needs only a client. A post that fails is logged, never
retried into a second copy: Events report, they are not state (the status is).
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

from kubernetes import client

from dlo_operator import metrics
from dlo_operator.apicalls import write

logger = logging.getLogger(__name__)

COMPONENT = "dlo-operator"
MAX_MESSAGE_CHARACTERS = 1024
"""Longer messages are cut (the API server refuses Events over its size limits)."""


def event_manifest(
    body: dict[str, Any], reason: str, message: str, *, warning: bool, now: datetime.datetime
) -> dict[str, Any]:
    """A core/v1 Event about the object ``body`` (pure)."""
    metadata = body["metadata"]
    if len(message) > MAX_MESSAGE_CHARACTERS:
        message = message[: MAX_MESSAGE_CHARACTERS - 3] + "..."
    timestamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{metadata['name']}.", "namespace": metadata["namespace"]},
        "involvedObject": {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata["uid"],
            "resourceVersion": metadata.get("resourceVersion"),
        },
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": socket.gethostname(),
        "firstTimestamp": timestamp,
        "lastTimestamp": timestamp,
        "count": 1,
    }


def post_event(
    api: client.ApiClient, body: dict[str, Any], reason: str, message: str, *, warning: bool
) -> None:
    """Post one Event about ``body``; a refusal or no answer is logged, not raised."""
    manifest = event_manifest(
        body, reason, message, warning=warning, now=datetime.datetime.now(datetime.UTC)
    )
    try:
        write(
            client.CoreV1Api(api).create_namespaced_event, body["metadata"]["namespace"], manifest
        )
        metrics.EVENTS.labels(reason=reason).inc()
    except Exception as error:  # an Event lost must not fail the pass that made the change
        metadata = body["metadata"]
        logger.warning(
            "Event %s about %s/%s not posted: %s",
            reason,
            metadata["namespace"],
            metadata["name"],
            error,
        )
