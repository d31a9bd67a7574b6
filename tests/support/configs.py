"""Worker configurations built from grouped option values, for the configuration tests."""

from __future__ import annotations

from typing import Any

import pytest

from dlo_worker.config import ConfigError, WorkerConfig, build_config

DLO = {"enable_distributed_layerwise_offload": True}
NO_ALLGATHER = {**DLO, "dlo_use_allgather": False}


def config(
    parallel: dict[str, Any] | None = None,
    offload: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
) -> WorkerConfig:
    return build_config(
        {"model": model or {}, "parallel": parallel or {}, "offload": offload or {}}
    )


def rejected(**groups: dict[str, Any]) -> str:
    """The one-line message of the configuration the groups make, which must be refused."""
    with pytest.raises(ConfigError) as error:
        config(**groups)
    message = str(error.value)
    assert "\n" not in message
    return message
