"""The PodDisruptionBudget, counted in engines (pure)."""

from __future__ import annotations

from typing import Any

from dlo_operator.api import DiffusionDeploymentSpec
from dlo_operator.render.identity import LABEL_DEPLOYMENT, Owner, child_metadata, pods_per_engine


def budget_min_available(spec: DiffusionDeploymentSpec) -> int:
    """Ready Pods the deployment keeps during voluntary disruptions.

    All Pods less ``maxUnavailableEngines``: an eviction is allowed only while fewer
    Pods than that are unready, and every disrupted engine has at least one unready
    Pod, so at most that many engines go down through evictions, however many Pods
    an engine has. The evicted engine's other Pods are deleted by the operator (not
    evicted), and further evictions wait until it is Ready again.
    """
    total = spec.replicas * pods_per_engine(spec)
    return max(total - spec.disruption_budget.max_unavailable_engines, 0)


def render_budget(owner: Owner, spec: DiffusionDeploymentSpec) -> dict[str, Any]:
    """One PodDisruptionBudget for the whole deployment, counted in engines."""
    labels = {LABEL_DEPLOYMENT: owner.name}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner, owner.name, labels),
        "spec": {
            "minAvailable": budget_min_available(spec),
            "selector": {"matchLabels": labels},
            # A Pod stuck loading or crashing never blocks a drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
