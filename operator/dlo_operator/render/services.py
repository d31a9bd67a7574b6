"""How clients and ranks reach an engine: the client Service in front of the leaders, a
headless Service per engine for the rendezvous, and the engine's NetworkPolicy (pure)."""

from __future__ import annotations

from typing import Any

from dlo_operator.api import DiffusionDeploymentSpec
from dlo_operator.render.engine_pod import MASTER_PORT
from dlo_operator.render.identity import (
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    ROLE_LEADER,
    Owner,
    child_metadata,
    engine_labels,
    engine_service_name,
)


def render_engine_service(owner: Owner, engine: int) -> dict[str, Any]:
    labels = engine_labels(owner, engine)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, engine_service_name(owner, engine), labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": [{"name": "rendezvous", "port": MASTER_PORT}],
        },
    }


def render_network_policy(
    owner: Owner, spec: DiffusionDeploymentSpec, engine: int
) -> dict[str, Any]:
    """All traffic among one engine's Pods; the HTTP port from anywhere; egress untouched."""
    labels = engine_labels(owner, engine)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(owner, engine_service_name(owner, engine), labels),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": labels}}]},
                {"ports": [{"protocol": "TCP", "port": spec.port}]},
            ],
        },
    }


def render_client_service(owner: Owner, spec: DiffusionDeploymentSpec) -> dict[str, Any]:
    labels = {LABEL_DEPLOYMENT: owner.name}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, owner.name, labels),
        "spec": {
            "selector": {**labels, LABEL_ROLE: ROLE_LEADER},
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http"}],
        },
    }
