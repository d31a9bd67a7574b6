"""Checkpoint mmap preflight: prove a DiT can stream straight from its checkpoint files.

Pure functions over headers and runtime shapes; nothing is read or materialized here.
:func:`resolve_sources` finds exactly one source per runtime tensor (the plain
rule, then the adapters); :func:`rejection` says why a resolution cannot back a
checkpoint mapping, or nothing when it can. A rejection is a fallback to ordinary
loading, decided before anything is skipped. A shape that contradicts the model's
own config, or a dtype the model cannot run (an integer, boolean or float8 tensor for a
floating parameter), is corruption, not a fallback: :class:`CheckpointError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dlo_worker.config import HostBacking
from dlo_worker.loader.adapters import ADAPTERS, CheckpointAdapter, Source, TensorSpec
from dlo_worker.loader.checkpoint import (
    CheckpointError,
    CheckpointIndex,
    CheckpointTensor,
    dtype_problem,
)


@dataclass(frozen=True)
class Binding:
    """One runtime tensor bound to its checkpoint source."""

    name: str
    source: Source
    tensor: CheckpointTensor
    spec: TensorSpec


@dataclass
class Resolution:
    """The outcome of matching runtime tensors against a checkpoint."""

    bindings: dict[str, Binding] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.missing and not self.ambiguous

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(sorted({b.source.adapter for b in self.bindings.values() if b.source.adapter}))


def _source_shape(source: Source, tensor: CheckpointTensor) -> tuple[int, ...]:
    if source.rows is None:
        return tensor.shape
    return (source.rows.stop - source.rows.start, *tensor.shape[1:])


def resolve_sources(
    runtime: dict[str, TensorSpec],
    checkpoint: CheckpointIndex,
    adapters: tuple[CheckpointAdapter, ...] = ADAPTERS,
) -> Resolution:
    """Bind every runtime tensor to exactly one checkpoint source (pure)."""
    resolution = Resolution()
    consumed: set[str] = set()
    for name, spec in runtime.items():
        candidates = [Source(name)] if name in checkpoint.tensors else []
        candidates += [
            source
            for adapter in adapters
            if (source := adapter.resolve(name, runtime, checkpoint)) is not None
        ]
        if not candidates:
            resolution.missing.append(name)
            continue
        if len(candidates) > 1:
            resolution.ambiguous.append(name)
            continue
        (source,) = candidates
        tensor = checkpoint.tensors[source.key]
        if (problem := dtype_problem(tensor.dtype, spec.dtype)) is not None:
            raise CheckpointError(
                f"{tensor.file}: {source.key!r} {problem} ({name!r} of the model)"
            )
        if _source_shape(source, tensor) != spec.shape:
            raise CheckpointError(
                f"{tensor.file}: {source.key!r} has shape {list(tensor.shape)} but the model's "
                f"config.json needs {list(spec.shape)} for {name!r}; the weights and the config "
                "come from different models"
            )
        resolution.bindings[name] = Binding(name, source, tensor, spec)
        consumed.add(source.key)
    resolution.unused = sorted(set(checkpoint.tensors) - consumed)
    return resolution


@dataclass(frozen=True)
class Rejection:
    """Why preflight failed: a short ``code`` for metrics and a sentence for the log."""

    code: str
    message: str


def _first(names: list[str]) -> str:
    return f"{len(names)} (first: {names[0]!r})"


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _backing_rejection(candidates: Sequence[HostBacking]) -> Rejection | None:
    """Why the host backings rule checkpoint mmap out before any tensor is looked at."""
    if candidates[0] == HostBacking.RUNTIME_CACHE:
        return Rejection(
            "runtime-cache-preferred",
            "--dlo-runtime-cache-pin-limit-gib > 0 selects the transform-complete runtime cache "
            "over checkpoint mmap",
        )
    if HostBacking.CHECKPOINT_MMAP not in candidates:
        allowed = ", ".join(candidates)
        return Rejection(
            "topology",
            f"checkpoint mmap needs TP 1, no HSDP and no online quantization (allowed: {allowed})",
        )
    return None


def rejection(host_backings: Sequence[HostBacking], resolution: Resolution) -> Rejection | None:
    """Why this resolution cannot back a checkpoint mapping, or None when preflight passes.

    ``host_backings`` are the configuration's candidates, most preferred first."""
    if (refused := _backing_rejection(host_backings)) is not None:
        return refused
    if resolution.missing:
        return Rejection(
            "missing", f"runtime tensors without a checkpoint source: {_first(resolution.missing)}"
        )
    if resolution.ambiguous:
        return Rejection(
            "ambiguous",
            f"runtime tensors with more than one source: {_first(resolution.ambiguous)}",
        )
    if resolution.unused:
        return Rejection(
            "mixed",
            f"the checkpoint also holds tensors the DiT does not use: {_first(resolution.unused)}; "
            "a source that mixes DiT and other weights is loaded ordinarily as a unit",
        )
    for binding in resolution.bindings.values():
        if binding.tensor.dtype != binding.spec.dtype:
            return Rejection(
                "dtype",
                f"the checkpoint stores {_dtype_name(binding.tensor.dtype)} but the runtime dtype "
                f"is {_dtype_name(binding.spec.dtype)} ({binding.name!r}); the ordinary loader "
                "converts it",
            )
    return None
