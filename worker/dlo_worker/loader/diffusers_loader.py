"""DiffusersPipelineLoader: load a diffusers directory and decide the DiT's host backing.

For each DiT component (``transformer``, ``transformer_2``) the loader runs the
checkpoint mmap preflight *before* materializing it:

- preflight passes: the DiT is built with empty (meta) parameters and bound to its
  checkpoint files in a :class:`HostWeightPlan`; it is never materialized privately,
  and the DLO backend consumes the plan;
- preflight fails but the checkpoint needs an adapter (e.g. fused QKV): the ordinary
  path loads it through the same adapter into private tensors;
- otherwise diffusers loads it the ordinary way.

Every other component is loaded by diffusers and moved to the device. Each
fallback is logged with its reason and counted in ``dlo_host_backing_fallbacks``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from dlo_worker import metrics
from dlo_worker.config import (
    HostBacking,
    OffloadPolicy,
    WorkerConfig,
    default_runtime_cache_root,
)
from dlo_worker.loader.adapters import TensorSpec
from dlo_worker.loader.checkpoint import read_checkpoint_index
from dlo_worker.loader.host_weight_plan import CheckpointMappings, ComponentPlan, HostWeightPlan
from dlo_worker.loader.model_directory import check_model_directory, quiet_diffusers_handlers
from dlo_worker.loader.preflight import Rejection, Resolution, rejection, resolve_sources
from dlo_worker.runtime_cache import (
    CacheReport,
    CacheRequest,
    RuntimeCacheEntry,
    attach_runtime_cache,
)

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

logger = logging.getLogger(__name__)

DIT_COMPONENTS = ("transformer", "transformer_2")


@dataclass(frozen=True)
class BackingDecision:
    """Which host backing the DiT weights got, and why (reported by the CLI)."""

    backing: HostBacking
    reason: str


def runtime_tensor_specs(model: nn.Module) -> dict[str, TensorSpec]:
    """Every parameter and persistent buffer the model's state dict holds, by name."""
    return {
        name: TensorSpec(tuple(tensor.shape), tensor.dtype)
        for name, tensor in model.state_dict(keep_vars=True).items()
    }


class DiffusersPipelineLoader:
    """Loads one pipeline directory once; hands its HostWeightPlan over exactly once."""

    def __init__(self, config: WorkerConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        if config.model.model is None:
            raise ValueError("--model is required")
        self.config = config
        self.model_dir = Path(config.model.model)
        self.dtype = dtype
        self.device = device
        self.streams_dit = config.effective().offload_policy == OffloadPolicy.DLO
        self.decision: BackingDecision | None = None
        self.cache_report: CacheReport | None = None
        """What the runtime cache did, when this load used it."""
        self._plan: HostWeightPlan | RuntimeCacheEntry | None = None
        self._loaded = False

    def take_host_weight_plan(self) -> HostWeightPlan | RuntimeCacheEntry | None:
        """The plan, transferring ownership to the caller; every later call returns None."""
        plan, self._plan = self._plan, None
        return plan

    def load(self) -> DiffusionPipeline:
        """Load every component; DiTs per their preflight outcome (see the module docstring)."""
        from diffusers import DiffusionPipeline

        if self._loaded:
            raise RuntimeError("DiffusersPipelineLoader.load() runs once per loader")
        self._loaded = True
        quiet_diffusers_handlers()
        check_model_directory(self.model_dir)
        started = time.perf_counter()
        index = json.loads((self.model_dir / "model_index.json").read_text())
        prebuilt: dict[str, nn.Module] = {}
        planned: dict[str, ComponentPlan] = {}
        adapters: dict[str, tuple[str, ...]] = {}
        reasons: list[str] = []
        for component in DIT_COMPONENTS:
            entry = index.get(component)
            if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers"):
                continue
            prepared = self._prepare_dit(component, entry[1])
            if prepared.module is not None:
                prebuilt[component] = prepared.module
            if prepared.plan is not None:
                planned[component] = prepared.plan
            adapters[component] = prepared.adapters
            reasons.append(f"{component}: {prepared.reason}")

        pipeline = DiffusionPipeline.from_pretrained(
            str(self.model_dir), dtype=self.dtype, local_files_only=True, **prebuilt
        )
        for name, component in pipeline.components.items():
            if isinstance(component, nn.Module) and name not in planned:
                streamed_later = self.streams_dit and name in DIT_COMPONENTS
                component.to(torch.device("cpu") if streamed_later else self.device)
        backing = HostBacking.ORDINARY
        if planned:
            self._plan = HostWeightPlan(HostBacking.CHECKPOINT_MMAP, planned)
            backing = HostBacking.CHECKPOINT_MMAP
        elif self._uses_runtime_cache():
            dits = [
                (name, module)
                for name in DIT_COMPONENTS
                if isinstance(module := pipeline.components.get(name), nn.Module)
            ]
            entry, self.cache_report = attach_runtime_cache(self._cache_request(adapters), dits)
            reasons.append(self.cache_report.describe())
            if entry is not None:
                self._plan = entry
                backing = HostBacking.RUNTIME_CACHE
        self.decision = BackingDecision(
            backing, "; ".join(reasons) or "the pipeline has no diffusers DiT component"
        )
        logger.info(
            "pipeline loaded",
            extra={
                "fields": {
                    "model": str(self.model_dir),
                    "pipeline": type(pipeline).__name__,
                    "dtype": str(self.dtype).removeprefix("torch."),
                    "device": str(self.device),
                    "host_backing": self.decision.backing,
                    "load_s": round(time.perf_counter() - started, 3),
                }
            },
        )
        return pipeline

    def _uses_runtime_cache(self) -> bool:
        """Rank-local DLO with the runtime cache among the host backings (a checkpoint plan,
        when preflight proved one, shares the checkpoint's own pages instead)."""
        effective = self.config.effective()
        return self.streams_dit and HostBacking.RUNTIME_CACHE in effective.host_backing_candidates

    def _cache_request(self, adapters: dict[str, tuple[str, ...]]) -> CacheRequest:
        offload, parallel = self.config.offload, self.config.parallel
        return CacheRequest(
            root=offload.dlo_runtime_cache_root or default_runtime_cache_root(),
            lock_timeout=offload.dlo_runtime_cache_lock_timeout,
            size_budget_bytes=None
            if offload.dlo_runtime_cache_size_budget_gib is None
            else int(offload.dlo_runtime_cache_size_budget_gib * 2**30),
            block_paths=offload.dlo_block_paths,
            adapters=adapters,
            # This release runs TP 1 only (execution_errors refuses more).
            tensor_parallel=(parallel.tensor_parallel_size, 0),
            sequence_parallel_size=parallel.sequence_parallel_size,
        )

    def _prepare_dit(self, component: str, class_name: str) -> PreparedDiT:
        import diffusers

        model_class = getattr(diffusers, class_name, None)
        if model_class is None:
            refused = Rejection("class", f"unknown diffusers class {class_name}")
            return PreparedDiT(None, None, _report_fallback(component, refused, self.streams_dit))
        return prepare_dit(
            self.config,
            self.model_dir / component,
            model_class,
            self.dtype,
            component=component,
        )


@dataclass(frozen=True)
class PreparedDiT:
    """The preflight outcome for one DiT directory."""

    module: nn.Module | None
    """Built here (meta parameters with a plan; private tensors via an adapter), or None
    for diffusers' ordinary loader."""
    plan: ComponentPlan | None
    reason: str
    adapters: tuple[str, ...] = ()
    """Checkpoint adapters the ordinary path loaded it through (part of a cache identity)."""


def prepare_dit(
    config: WorkerConfig,
    component_dir: Path,
    model_class: type,
    dtype: torch.dtype,
    *,
    component: str,
) -> PreparedDiT:
    """Run the checkpoint mmap preflight for one DiT directory (``config.json`` + safetensors).

    ``component`` names the DiT in the plan: the pipeline attribute (``transformer``),
    or ``model`` for a bare module handed to the backend. Raises
    :class:`~dlo_worker.loader.checkpoint.CheckpointError` for corrupt input.
    """
    streams_dit = config.effective().offload_policy == OffloadPolicy.DLO
    # Read even when DLO is off: a corrupt checkpoint is a clear error on every path.
    checkpoint = read_checkpoint_index(component_dir)
    if checkpoint is None:
        refused = Rejection("format", "no safetensors checkpoint")
        return PreparedDiT(None, None, _report_fallback(component, refused, streams_dit))
    skeleton = _skeleton(model_class, component_dir, dtype)
    if streams_dit:
        # Block discovery on the meta model: a DiT DLO cannot stream fails before any
        # weight is read (DiscoveryError names the fix).
        from dlo_worker.offload.plan import discover

        discover(skeleton, config.offload.dlo_block_paths)
    resolution = resolve_sources(runtime_tensor_specs(skeleton), checkpoint)
    if not streams_dit:
        reason = "ordinary (DLO is off, nothing streams)"
    else:
        refused = rejection(config, resolution) or _unproven_class(model_class)
        if refused is None:
            plan = ComponentPlan(component, resolution.bindings, resolution.adapters)
            adapters = f", adapters: {', '.join(plan.adapters)}" if plan.adapters else ""
            return PreparedDiT(
                skeleton,
                plan,
                f"checkpoint-mmap ({len(plan.bindings)} tensors in "
                f"{len(checkpoint.files)} file(s){adapters})",
            )
        reason = _report_fallback(component, refused, streams_dit)
    if resolution.complete and resolution.adapters:
        # diffusers cannot read an adapted layout: load it privately through the adapter.
        return PreparedDiT(
            _materialize(skeleton, resolution), None, reason, tuple(resolution.adapters)
        )
    return PreparedDiT(None, None, reason)


def _skeleton(model_class: type, component_dir: Path, dtype: torch.dtype) -> nn.Module:
    """The DiT with meta parameters (no weight memory); buffers keep their init values."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = model_class.from_config(model_class.load_config(str(component_dir)))
    _cast_state_like_from_pretrained(model, dtype)
    return model.eval()


def _cast_state_like_from_pretrained(model: nn.Module, dtype: torch.dtype) -> None:
    """Give floating parameters and persistent buffers ``dtype``, as diffusers' loader does
    while loading the state dict; non-persistent buffers keep their constructed dtype."""
    persistent = set(model.state_dict(keep_vars=True))
    cast: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, parameter in module._parameters.items():
            if parameter is not None and parameter.is_floating_point():
                if id(parameter) not in cast:
                    cast[id(parameter)] = nn.Parameter(
                        parameter.to(dtype), requires_grad=parameter.requires_grad
                    )
                module._parameters[name] = cast[id(parameter)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point() and prefix + name in persistent:
                module._buffers[name] = buffer.to(dtype)


def _report_fallback(component: str, refused: Rejection, streams_dit: bool) -> str:
    """Log and count a preflight failure (only when DLO would have used the plan)."""
    if streams_dit:
        metrics.HOST_BACKING_FALLBACKS.labels(reason=refused.code).inc()
        logger.warning(
            "checkpoint mmap preflight failed; loading ordinarily",
            extra={"fields": {"component": component, "reason": refused.message}},
        )
    return f"ordinary ({refused.message})"


def _unproven_class(model_class: type) -> Rejection | None:
    """Classes whose ordinary load changes dtypes per module are not proven for mmap."""
    if getattr(model_class, "_keep_in_fp32_modules", None):
        return Rejection(
            "keep-fp32",
            f"{model_class.__name__} keeps modules in float32 (_keep_in_fp32_modules)",
        )
    return None


def _materialize(skeleton: nn.Module, resolution: Resolution) -> nn.Module:
    """Private CPU tensors for every binding (transform applied, dtype converted)."""
    mappings = CheckpointMappings()
    try:
        state = {
            name: mappings.view(binding).to(dtype=binding.spec.dtype, copy=True)
            for name, binding in resolution.bindings.items()
        }
    finally:
        mappings.close()
    skeleton.load_state_dict(state, strict=True, assign=True)
    return skeleton
