"""DiffusersPipelineLoader: load a diffusers directory and decide the DiT's host backing.

For each DiT component (``transformer``, ``transformer_2``) the loader runs the
checkpoint mmap preflight *before* materializing it:

- preflight passes: the DiT is built with empty (meta) parameters and bound to its
  checkpoint files in a :class:`MappedCheckpoint`; it is never materialized privately,
  and the DLO backend consumes the mapping;
- preflight fails but the checkpoint needs an adapter (e.g. fused QKV): the ordinary
  path loads it through the same adapter into private tensors;
- otherwise diffusers loads it the ordinary way.

Every other component is loaded by diffusers and moved to the device. Each
fallback is logged with its reason and counted in ``dlo_host_backing_fallbacks``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from dlo_worker.config import HostBacking, LoadSettings, SkipLoad
from dlo_worker.errors import UserFixableError
from dlo_worker.loader.adapters import TensorSpec
from dlo_worker.loader.checkpoint import CheckpointError, read_checkpoint_index
from dlo_worker.loader.components import diffusers_skeleton, inspect_pipeline
from dlo_worker.loader.finite import check_finite, check_finite_parameters
from dlo_worker.loader.mapped_checkpoint import (
    CheckpointMappings,
    ComponentBindings,
    MappedCheckpoint,
)
from dlo_worker.loader.model_directory import (
    check_model_directory,
    dit_classes,
    quiet_diffusers_handlers,
)
from dlo_worker.loader.placement import stays_on_host
from dlo_worker.loader.preflight import Rejection, Resolution, rejection, resolve_sources
from dlo_worker.observability import metrics
from dlo_worker.runtime_cache import (
    CacheReport,
    CacheRequest,
    RuntimeCacheEntry,
    SkipLoadHit,
    attach_runtime_cache,
    entry_for_source,
    record_source,
)
from dlo_worker.runtime_cache.source import component_source, source_key

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

logger = logging.getLogger(__name__)

DIT_COMPONENTS = ("transformer", "transformer_2")


@dataclass(frozen=True)
class BackingDecision:
    """Which host backing the DiT weights got, and why (reported by the CLI)."""

    backing: HostBacking
    reason: str


@dataclass(frozen=True)
class HostWeightEdit:
    """A change written into the loaded pipeline's weights before the DiTs' host backing
    is chosen (``--fuse-lora``). It needs private host weights: the configuration never
    offers a checkpoint mapping with it, and a runtime-cache entry built from the edited
    DiTs is keyed by :attr:`identity` too (its content digest already differs)."""

    identity: tuple[str, ...]
    """What the edit writes, as the runtime cache's source and entry identities hold it."""
    apply: Callable[[DiffusionPipeline, frozenset[str]], None]
    """Edits the pipeline but the given DiT components (bound to an entry that was built
    with the edit: a skip-load hit)."""
    skeleton: Callable[[nn.Module], None] | None = None
    """Gives a DiT's meta skeleton the structure ``apply`` gives the loaded DiT (FP8
    linears), so a skip-load hit binds the entry built from it; ``None``: unchanged."""


def runtime_tensor_specs(model: nn.Module) -> dict[str, TensorSpec]:
    """Every parameter and persistent buffer the model's state dict holds, by name."""
    return {
        name: TensorSpec(tuple(tensor.shape), tensor.dtype)
        for name, tensor in model.state_dict(keep_vars=True).items()
    }


class DiffusersPipelineLoader:
    """Loads one pipeline directory once; hands its DiTs' host weights over exactly once."""

    def __init__(
        self,
        settings: LoadSettings,
        *,
        dtype: torch.dtype,
        device: torch.device,
        edit: HostWeightEdit | None = None,
    ) -> None:
        self.settings = settings
        self.edit = edit
        self.model_dir = settings.model_dir
        self.dtype = dtype
        self.device = device
        self.policy = settings.offload_policy
        self.streams_dit = settings.streams_dit
        self.decision: BackingDecision | None = None
        self.cache_report: CacheReport | None = None
        """What the runtime cache did, when this load used it."""
        self._host_weights: MappedCheckpoint | RuntimeCacheEntry | None = None
        self._loaded = False

    def take_host_weights(self) -> MappedCheckpoint | RuntimeCacheEntry | None:
        """The DiTs' host weights (a checkpoint mapping or a runtime-cache entry), transferring
        ownership to the caller; None when the DiTs are ordinary tensors, and every later call."""
        host_weights, self._host_weights = self._host_weights, None
        return host_weights

    def load(
        self, check_pipeline: Callable[[DiffusionPipeline], None] | None = None
    ) -> DiffusionPipeline:
        """Load every component; DiTs per their preflight outcome (see the module docstring).

        Every component is checked first (:func:`~dlo_worker.loader.components.inspect_pipeline`)
        and ``check_pipeline`` sees the pipeline's meta skeleton before any weight is read
        (or, for a pipeline that cannot be built so, the loaded pipeline); every loaded
        component's parameters, and a checkpoint-mapped DiT's, must be finite.
        """
        from diffusers import DiffusionPipeline

        if self._loaded:
            raise RuntimeError("DiffusersPipelineLoader.load() runs once per loader")
        self._loaded = True
        quiet_diffusers_handlers()
        check_model_directory(self.model_dir)
        inspection = inspect_pipeline(self.model_dir, self.dtype)
        if check_pipeline is not None and inspection.meta_pipeline is not None:
            check_pipeline(inspection.meta_pipeline)
        started = time.perf_counter()
        classes = dit_classes(self.model_dir, DIT_COMPONENTS)
        source = self._cache_source(classes) if self.settings.runtime_cache else None
        hit = self._skip_load(source)
        prepared = self._prepare_dits(classes, hit)
        pipeline = DiffusionPipeline.from_pretrained(
            str(self.model_dir),
            dtype=self.dtype,
            local_files_only=True,
            **inspection.loaded,
            **prepared.prebuilt,
        )
        if check_pipeline is not None and inspection.meta_pipeline is None:
            check_pipeline(pipeline)
        for name, component in pipeline.components.items():
            if isinstance(component, nn.Module) and name not in prepared.bound:
                check_finite_parameters(self.model_dir / name, component)
                on_host = (
                    (self.streams_dit and name in DIT_COMPONENTS)
                    or name in self.settings.streamed_text_encoders
                    or stays_on_host(self.policy, name, DIT_COMPONENTS)
                )
                component.to(torch.device("cpu") if on_host else self.device)
        if self.edit is not None:
            if prepared.mapped:
                raise RuntimeError(
                    f"{sorted(prepared.mapped)} mapped from the checkpoint, which an edit of "
                    "the weights must never write: the configuration offers no mapping then"
                )
            self.edit.apply(pipeline, frozenset(prepared.bound))
        backing = self._host_backing(pipeline, hit, prepared, source)
        reasons = prepared.reasons
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

    def _prepare_dits(self, dit_classes: dict[str, str], hit: SkipLoadHit | None) -> PreparedDiTs:
        """Skeletons bound to the entry on a skip-load hit, else each DiT's preflight."""
        prepared = PreparedDiTs()
        if hit is not None:
            self.cache_report = hit.report
            for component, skeleton in hit.skeletons.items():
                prepared.prebuilt[component] = skeleton
                prepared.bound.add(component)
            prepared.reasons.append(hit.report.describe())
            return prepared
        for component, class_name in dit_classes.items():
            dit = self._prepare_dit(component, class_name)
            if dit.module is not None:
                prepared.prebuilt[component] = dit.module
            if dit.bindings is not None:
                prepared.mapped[component] = dit.bindings
                prepared.bound.add(component)
            prepared.adapters[component] = dit.adapters
            prepared.reasons.append(f"{component}: {dit.reason}")
        return prepared

    def _host_backing(
        self,
        pipeline: DiffusionPipeline,
        hit: SkipLoadHit | None,
        prepared: PreparedDiTs,
        source: CacheSource | None,
    ) -> HostBacking:
        """Hand over the skip-load entry, the checkpoint mapping, or the runtime cache built
        or joined from the loaded DiTs (recording their source for the next start)."""
        if hit is not None:
            self._host_weights = hit.entry
            return HostBacking.RUNTIME_CACHE
        if prepared.mapped:
            mapped = MappedCheckpoint(HostBacking.CHECKPOINT_MMAP, prepared.mapped)
            try:
                _check_mapped_finite(self.model_dir, mapped, prepared)
            except BaseException:
                mapped.close()
                raise
            self._host_weights = mapped
            return HostBacking.CHECKPOINT_MMAP
        if self.settings.runtime_cache is None:
            # A checkpoint mapping, when preflight proved one, shares the checkpoint's own
            # pages; without the runtime cache among the backings the DiTs stay ordinary.
            return HostBacking.ORDINARY
        dits = [
            (name, module)
            for name in DIT_COMPONENTS
            if isinstance(module := pipeline.components.get(name), nn.Module)
        ]
        request = self._cache_request(prepared.adapters)
        entry, report = attach_runtime_cache(request, dits)
        self.cache_report = report
        prepared.reasons.append(report.describe())
        if entry is None:
            return HostBacking.ORDINARY
        self._host_weights = entry
        if source is not None and report.key is not None:
            record_source(request, source.key, report.key)
        return HostBacking.RUNTIME_CACHE

    def _cache_source(self, dit_classes: dict[str, str]) -> CacheSource | None:
        """The source identity of the pipeline's DiTs (headers and metadata only), or None
        when one has no safetensors checkpoint or an unknown class."""
        import diffusers

        components, skeletons, adapters = {}, {}, {}
        for component, class_name in dit_classes.items():
            model_class = getattr(diffusers, class_name, None)
            component_dir = self.model_dir / component
            checkpoint = read_checkpoint_index(component_dir)
            if model_class is None or checkpoint is None:
                return None
            skeleton = diffusers_skeleton(model_class, component_dir, self.dtype)
            resolution = resolve_sources(runtime_tensor_specs(skeleton), checkpoint)
            adapters[component] = resolution.adapters if resolution.complete else ()
            if self.edit is not None and self.edit.skeleton is not None:
                # After resolving against the checkpoint, which holds the unedited tensors.
                self.edit.skeleton(skeleton)
            components[component] = component_source(
                files=checkpoint.files,
                config_json=(component_dir / "config.json").read_text(),
                dit_class=class_name,
                adapters=adapters[component],
            )
            skeletons[component] = skeleton
        if not components:
            return None
        key = source_key(
            components,
            dtype=str(self.dtype),
            block_paths=self.settings.block_paths,
            backings=list(self.settings.host_backings),
            edits=self.edit.identity if self.edit is not None else (),
        )
        return CacheSource(key, skeletons, adapters)

    def _skip_load(self, source: CacheSource | None) -> SkipLoadHit | None:
        """The verified entry recorded for ``source`` (skip-load), per the configured mode:
        None on a miss (a corrupt entry is quarantined and the ordinary load rebuilds it),
        refused when required."""
        cache = self.settings.runtime_cache
        if source is None or cache is None or cache.skip_load == SkipLoad.OFF:
            return None
        found = entry_for_source(self._cache_request(source.adapters), source.key, source.skeletons)
        if isinstance(found, SkipLoadHit):
            return found
        if cache.skip_load == SkipLoad.REQUIRED:
            raise RuntimeCacheMissError(
                f"--dlo-runtime-cache-skip-load required: {found}; run `dlo-worker cache "
                "warm` with the same flags first, or use preferred"
            )
        return None

    def _cache_request(self, adapters: dict[str, tuple[str, ...]]) -> CacheRequest:
        cache = self.settings.runtime_cache
        if cache is None:
            raise RuntimeError("the runtime cache is not among this load's host backings")
        return CacheRequest(
            root=cache.root,
            lock_timeout=cache.lock_timeout_s,
            size_budget_bytes=cache.size_budget_bytes,
            block_paths=self.settings.block_paths,
            adapters=adapters,
            # This release runs TP 1 only (execution_errors refuses more).
            tensor_parallel=(cache.tensor_parallel_size, 0),
            sequence_parallel_size=cache.sequence_parallel_size,
            edits=self.edit.identity if self.edit is not None else (),
        )

    def _prepare_dit(self, component: str, class_name: str) -> PreparedDiT:
        import diffusers

        model_class = getattr(diffusers, class_name, None)
        if model_class is None:
            refused = Rejection("class", f"unknown diffusers class {class_name}")
            return PreparedDiT(None, None, _report_fallback(component, refused, self.streams_dit))
        return prepare_dit(
            self.settings,
            self.model_dir / component,
            model_class,
            self.dtype,
            component=component,
        )


class RuntimeCacheMissError(RuntimeError, UserFixableError):
    """Skip-load was required and the runtime cache holds no entry for this source."""


@dataclass
class PreparedDiTs:
    """What the loader hands diffusers and keeps for the backend, for every DiT."""

    prebuilt: dict[str, nn.Module] = field(default_factory=dict)
    mapped: dict[str, ComponentBindings] = field(default_factory=dict)
    bound: set[str] = field(default_factory=set)
    """Components bound to host weights (meta tensors): never moved."""
    adapters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CacheSource:
    """The DiTs' source identity and the meta skeletons built to compute it."""

    key: str
    skeletons: dict[str, nn.Module]
    adapters: dict[str, tuple[str, ...]]
    """The checkpoint adapters an ordinary load of each DiT goes through (a guard)."""


@dataclass(frozen=True)
class PreparedDiT:
    """The preflight outcome for one DiT directory."""

    module: nn.Module | None
    """Built here (meta parameters with bindings; private tensors via an adapter), or None
    for diffusers' ordinary loader."""
    bindings: ComponentBindings | None
    """Set when preflight proved the checkpoint maps this DiT."""
    reason: str
    adapters: tuple[str, ...] = ()
    """Checkpoint adapters the ordinary path loaded it through (part of a cache identity)."""


def prepare_dit(
    settings: LoadSettings,
    component_dir: Path,
    model_class: type,
    dtype: torch.dtype,
    *,
    component: str,
) -> PreparedDiT:
    """Run the checkpoint mmap preflight for one DiT directory (``config.json`` + safetensors).

    ``component`` names the DiT in the mapping: the pipeline attribute (``transformer``),
    or ``model`` for a bare module handed to the backend. Raises
    :class:`~dlo_worker.loader.checkpoint.CheckpointError` for corrupt input.
    """
    streams_dit = settings.streams_dit
    # Read even when DLO is off: a corrupt checkpoint is a clear error on every path.
    checkpoint = read_checkpoint_index(component_dir)
    if checkpoint is None:
        no_checkpoint = Rejection("format", "no safetensors checkpoint")
        return PreparedDiT(None, None, _report_fallback(component, no_checkpoint, streams_dit))
    skeleton = diffusers_skeleton(model_class, component_dir, dtype)
    if streams_dit:
        # Block discovery on the meta model: a DiT DLO cannot stream fails before any
        # weight is read (DiscoveryError names the fix).
        from dlo_worker.offload.plan import discover

        discover(skeleton, settings.block_paths)
    resolution = resolve_sources(runtime_tensor_specs(skeleton), checkpoint)
    check_config_matches_weights(component_dir, skeleton, resolution)
    if not streams_dit:
        reason = "ordinary (DLO is off, nothing streams)"
    else:
        refused = rejection(settings.host_backings, resolution) or _unproven_class(model_class)
        if refused is None:
            bindings = ComponentBindings(component, resolution.bindings, resolution.adapters)
            adapters = f", adapters: {', '.join(bindings.adapters)}" if bindings.adapters else ""
            return PreparedDiT(
                skeleton,
                bindings,
                f"checkpoint-mmap ({len(bindings.bindings)} tensors in "
                f"{len(checkpoint.files)} file(s){adapters})",
            )
        reason = _report_fallback(component, refused, streams_dit)
    if resolution.complete and resolution.adapters:
        # diffusers cannot read an adapted layout: load it privately through the adapter.
        return PreparedDiT(
            _materialize(skeleton, resolution), None, reason, tuple(resolution.adapters)
        )
    return PreparedDiT(None, None, reason)


def _check_mapped_finite(model_dir: Path, mapped: MappedCheckpoint, prepared: PreparedDiTs) -> None:
    """A DiT bound to its checkpoint was never loaded, so nothing else read its weights
    yet: scan its parameters through the mapping (the only read at start; it also fills
    the page cache the first step streams from)."""
    for component in mapped.components:
        parameters = [name for name, _ in prepared.prebuilt[component].named_parameters()]
        check_finite(
            model_dir / component, ((name, mapped.tensor(component, name)) for name in parameters)
        )


def check_config_matches_weights(
    component_dir: Path, skeleton: nn.Module, resolution: Resolution
) -> None:
    """``config.json`` and the weights describe the same model: every parameter has a
    source, and no checkpoint tensor belongs to one of the model's own modules without
    being used (``num_layers`` one too high or too low). Tensors of other components (a
    mixed source) may sit beside them. Raises :class:`CheckpointError` naming the file."""
    parameters = {name for name, _ in skeleton.named_parameters()}
    missing = [name for name in resolution.missing if name in parameters]
    if missing:
        raise CheckpointError(
            f"{component_dir}: config.json describes {len(missing)} parameter(s) the weights "
            f"lack (first: {missing[0]!r}); config.json and the checkpoint disagree (e.g. "
            "num_layers): fix config.json or copy the matching weights"
        )
    own_modules = {name for name, _ in skeleton.named_children()}
    stray = [key for key in resolution.unused if key.split(".", 1)[0] in own_modules]
    if stray:
        raise CheckpointError(
            f"{component_dir}: the weights hold {len(stray)} tensor(s) of this model's own "
            f"modules that config.json does not describe (first: {stray[0]!r}); config.json "
            "and the checkpoint disagree (e.g. num_layers): fix config.json or copy the "
            "matching weights"
        )


def _report_fallback(component: str, refused: Rejection, streams_dit: bool) -> str:
    """Log and count a preflight failure (only when DLO would have used the mapping)."""
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
