"""DiffusionDeployment specs for operator tests: a small valid base plus overrides."""

from __future__ import annotations

from typing import Any

from dlo_operator.api import DiffusionDeploymentSpec


def deployment_spec(**overrides: Any) -> DiffusionDeploymentSpec:
    """Two GPUs per Pod, DP=2 (one Pod per engine) unless overridden; camelCase keys."""
    base: dict[str, Any] = {
        "model": {"hostPath": "/models/flux"},
        "worker": {"image": "dlo-worker:0.1"},
        "gpusPerNode": 2,
        "parallelism": {"data": 2},
    }
    return DiffusionDeploymentSpec.model_validate({**base, **overrides})
