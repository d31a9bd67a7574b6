"""The worker configuration: every option, its default, and every rule that combines them.

This package is the configuration plane of the DLO design and the only place option
combinations are validated. It imports no torch, so the operator can validate a
DiffusionDeployment with the worker's own rules before it creates anything.

- :mod:`.values`: the enumerations options take;
- :mod:`.schema`: the option groups and :class:`WorkerConfig` (defaults, ranges);
- :mod:`.rules`: what the design refuses, and what this release cannot execute;
- :mod:`.effective`: what the worker will do, derived once from a valid configuration;
- :mod:`.flags`: the CLI spelling (``--`` + the field name with dashes).

Field names follow the flags users know from the DLO design (``--dlo-*``); rule messages
name the flags involved and say how to fix the combination.
"""

from __future__ import annotations

from dlo_worker.config.effective import (
    EffectiveConfig,
    LoadSettings,
    RuntimeCacheSettings,
    default_runtime_cache_root,
    dlo_sharding_group,
    load_settings,
    resolve,
)
from dlo_worker.config.flags import (
    NEGATIVE_FLAGS,
    describe_validation_error,
    flag_for,
    to_flags,
)
from dlo_worker.config.rules import combination_errors, execution_errors, runtime_lora_errors
from dlo_worker.config.schema import (
    DEFAULT_RUNTIME_CACHE_LOCK_TIMEOUT_S,
    ConfigError,
    ModelOptions,
    OffloadOptions,
    ParallelOptions,
    WorkerConfig,
    build_config,
)
from dlo_worker.config.values import (
    CompileMode,
    DType,
    HostBacking,
    LoraAdapter,
    OffloadPolicy,
    Quantization,
    ShardingGroup,
    SkipLoad,
    Staging,
    TransferMode,
)

__all__ = [
    "DEFAULT_RUNTIME_CACHE_LOCK_TIMEOUT_S",
    "NEGATIVE_FLAGS",
    "CompileMode",
    "ConfigError",
    "DType",
    "EffectiveConfig",
    "HostBacking",
    "LoadSettings",
    "LoraAdapter",
    "ModelOptions",
    "OffloadOptions",
    "OffloadPolicy",
    "ParallelOptions",
    "Quantization",
    "RuntimeCacheSettings",
    "ShardingGroup",
    "SkipLoad",
    "Staging",
    "TransferMode",
    "WorkerConfig",
    "build_config",
    "combination_errors",
    "default_runtime_cache_root",
    "describe_validation_error",
    "dlo_sharding_group",
    "execution_errors",
    "flag_for",
    "load_settings",
    "resolve",
    "runtime_lora_errors",
    "to_flags",
]
