"""The node-local runtime weight cache (docs/runtime-cache.md).

After the ordinary loader produced a DiT's final CPU tensors, every process of a node
with the same identity maps one content-addressed entry instead of keeping a private
copy: the first builds and publishes it under a kernel lock, the others join. The entry
stores each streamed block in DLO's packed slot layout (one copy per dtype per block).
Any failure keeps the already-valid ordinary tensors, logs why and counts the reason.

A start whose source identity (checkpoint files' metadata and headers, config, dtype,
...) was recorded by an earlier build or join skips loading the DiT altogether and binds
its meta skeleton to the entry (skip-load).

What is verified when: every start checks the manifest (its schema, that its identity
hashes to its key, its layout re-derived from its shapes, each file's kind, size and
mtime). A build or join also compares every mapped byte with the tensors the process
loaded (it has them in memory, and the comparison runs at memory speed), so a join never
streams bytes that differ from an ordinary load. A skip-load start has no loaded tensors:
it checks that the entry is this model's (every tensor's name and shape, the packed
layout and the identity's guards, against the model's meta skeleton) and re-derives the
content digest from the mapped views, which the key was made from.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from dlo_worker.observability import metrics
from dlo_worker.offload.layout import DTypeLayout
from dlo_worker.offload.plan import block_paths_for
from dlo_worker.runtime_cache.digest import content_digest, state_tensors
from dlo_worker.runtime_cache.entry import (
    EntryError,
    RuntimeCacheEntry,
    component_layout,
    entry_nbytes,
    write_entry,
)
from dlo_worker.runtime_cache.identity import CacheIdentity, IdentityGuards, canonical_config
from dlo_worker.runtime_cache.store import (
    CacheFallbackError,
    Outcome,
    RuntimeCacheStore,
    directory_bytes,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CacheFallbackError",
    "CacheReport",
    "CacheRequest",
    "RuntimeCacheEntry",
    "RuntimeCacheStore",
    "SkipLoadHit",
    "attach_runtime_cache",
    "entry_for_source",
    "record_source",
]


@dataclass(frozen=True)
class CacheRequest:
    """Where the cache lives and the guards the loaded tensors cannot tell."""

    root: Path
    lock_timeout: float
    size_budget_bytes: int | None = None
    """Upper bound of the entries on the node (least recently used ones are evicted)."""
    block_paths: Sequence[str] | None = None
    adapters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The loader's checkpoint adapters per DiT component."""
    tensor_parallel: tuple[int, int] = (1, 0)
    """``(size, rank)``."""
    sequence_parallel_size: int = 1
    edits: tuple[str, ...] = ()
    """What was written into the loaded weights (fused LoRA adapters), in order."""


@dataclass(frozen=True)
class CacheReport:
    """What one start did with the cache (``dlo-worker cache warm`` prints it as JSON)."""

    result: str
    """``built``, ``joined``, ``hit`` (skip-load) or ``fallback``."""
    key: str | None
    bytes: int
    seconds: float
    reason: str
    """Why it fell back (the metric's label and the message), empty otherwise."""

    def describe(self) -> str:
        if self.result == "fallback":
            return f"ordinary (runtime cache fell back: {self.reason})"
        if self.result == "hit":
            return f"runtime-cache (skip-load hit on entry {self.key}: no checkpoint tensor read)"
        return f"runtime-cache ({self.result} entry {self.key})"


@dataclass(frozen=True)
class SkipLoadHit:
    """A skip-load hit: the mapped entry, its report, and the skeletons bound to it."""

    entry: RuntimeCacheEntry
    report: CacheReport
    skeletons: dict[str, nn.Module]


def entry_for_source(
    request: CacheRequest, source: str, skeletons: dict[str, nn.Module]
) -> SkipLoadHit | str:
    """Skip-load: the entry recorded for this source identity, verified, with the meta
    ``skeletons`` bound to its dtypes; or why there is none.

    There are no loaded tensors to compare with. The entry must be this model's (names,
    shapes, layout and guards against the skeletons; otherwise the record is dropped) and
    its mapped views must have the content digest its key was made from (in parallel; the
    read also brings the entry into the page cache that streaming then reads). A corrupt
    entry is quarantined and the start loads ordinarily, which rebuilds it.
    """
    started = time.perf_counter()
    store = RuntimeCacheStore(request.root, request.lock_timeout, request.size_budget_bytes)
    found = _recorded_entry(store, source)
    if isinstance(found, str):
        return found
    entry, key = found, found.directory.name
    foreign, corrupt = _bind_all(entry, skeletons, request)
    if foreign is not None:
        entry.close()
        store.forget_source(source, foreign)
        return f"the entry recorded for this model is another's ({foreign})"
    if corrupt is None:
        with tqdm(
            total=entry.mapped_bytes,
            desc="runtime cache: verifying",
            unit="B",
            unit_scale=True,
            disable=entry.mapped_bytes < 2**30,
        ) as progress:
            corrupt = entry.content_problem(progress.update)
    if corrupt is not None:
        entry.close()
        _quarantine(store, key, corrupt)
        return f"{corrupt}; quarantined"
    metrics.RUNTIME_CACHE_STARTS.labels(result="hit").inc()
    seconds = time.perf_counter() - started
    logger.info(
        "runtime cache attached",
        extra={"fields": {"key": key, "result": "hit", "seconds": round(seconds, 3)}},
    )
    report = CacheReport("hit", key, directory_bytes(entry.directory), seconds, "")
    return SkipLoadHit(entry, report, skeletons)


def _recorded_entry(store: RuntimeCacheStore, source: str) -> RuntimeCacheEntry | str:
    """The mapped entry recorded for ``source`` (its manifest checked), or why there is
    none; an entry that fails its checks is quarantined."""
    try:
        store.prepare()
        key = store.lookup_source(source)
        if key is None:
            return f"no runtime-cache entry is recorded for this model under {store.root}"
        if not store.entry(key).is_dir():
            return f"the entry recorded for this model ({key}) was evicted or removed"
        return store.open(key)
    except CacheFallbackError as error:
        logger.warning(
            "runtime cache skip-load missed",
            extra={"fields": {"source": source, "why": str(error)}},
        )
        return str(error)
    except EntryError as error:
        assert key is not None  # only opening the recorded entry raises EntryError
        _quarantine(store, key, str(error))
        return f"{error}; quarantined"


def _quarantine(store: RuntimeCacheStore, key: str, why: str) -> None:
    try:
        store.repair(key, why)
    except CacheFallbackError as error:  # a read-only root keeps it; the start still misses
        logger.warning(
            "runtime cache entry failed verification and stays",
            extra={"fields": {"key": key, "why": why, "not_quarantined": str(error)}},
        )


def _bind_all(
    entry: RuntimeCacheEntry, skeletons: dict[str, nn.Module], request: CacheRequest
) -> tuple[str | None, str | None]:
    """:func:`_bind` for every DiT: ``(foreign, corrupt)``, both None when all bind."""
    if set(skeletons) != set(entry.components):
        return f"it holds {sorted(entry.components)}, the model's DiTs {sorted(skeletons)}", None
    for component, skeleton in skeletons.items():
        found = _bind(entry, component, skeleton, request)
        if found is not None:
            return found
    return None, None


def _bind(
    entry: RuntimeCacheEntry, component: str, skeleton: nn.Module, request: CacheRequest
) -> tuple[str | None, str | None] | None:
    """Give the meta skeleton the entry's dtypes (a class may keep some modules in
    float32); or ``(foreign, corrupt)``: why the entry belongs to another model or
    configuration (its identity guards differ: class, config, dtype, adapters, block lists,
    parallel sizes), or why, with this model's guards, it does not hold this model's
    tensors (names, shapes, packed layout): corruption."""
    recorded = entry.manifest.identity["components"][component]
    expected = _as_json(asdict(_guards(request, component, skeleton)))
    if _without_dtype(expected) != _without_dtype(recorded):
        return f"{component}: built for another model or configuration", None
    found = _bind_tensors(entry, component, skeleton)
    if found is not None:
        return found
    if _as_json(asdict(_guards(request, component, skeleton))) != recorded:
        return f"{component}: built for another model or configuration", None
    layout = _layout_problem(entry, component, skeleton, request)
    return None if layout is None else (None, layout)


def _bind_tensors(
    entry: RuntimeCacheEntry, component: str, skeleton: nn.Module
) -> tuple[str | None, str | None] | None:
    """The skeleton's tensors take the entry's dtypes where diffusers' loading would
    differ from the start's dtype; ``(foreign, corrupt)`` where the entry's tensors are
    not this model's (another dtype; other names or shapes)."""
    state = skeleton.state_dict(keep_vars=True)
    names = entry.names(component)
    if names != set(state):
        differing = sorted(names ^ set(state))
        return None, f"{component}: other tensors than the model's (first: {differing[0]!r})"
    for name, tensor in state.items():
        stored = entry.tensor(component, name)
        if stored.shape != tensor.shape:
            return None, (
                f"{component}.{name} has shape {list(stored.shape)} in the entry, "
                f"{list(tensor.shape)} in the model"
            )
        if stored.dtype != tensor.dtype:
            if not _kept_in_float32(skeleton, tensor, stored):
                return (
                    f"{component}.{name} is {stored.dtype} in the entry, {tensor.dtype} here",
                    None,
                )
            tensor.data = torch.empty_like(tensor, dtype=stored.dtype, device="meta")
    return None


def _layout_problem(
    entry: RuntimeCacheEntry, component: str, skeleton: nn.Module, request: CacheRequest
) -> str | None:
    """Why the entry's packed layout is not the one the (bound) skeleton packs into."""
    packed = component_layout(component, skeleton, request.block_paths)
    derived = [
        (
            block.name,
            {_dtype_name(dtype): _spans(layout) for dtype, layout in block.layout.by_dtype.items()},
        )
        for block in packed.blocks
    ]
    stored_layout = [
        (
            block.name,
            {
                name: [_span(*span) for span in record.spans]
                for name, record in block.dtypes.items()
            },
        )
        for block in entry.manifest.components[component].blocks
    ]
    if derived != stored_layout:
        return f"{component}: its packed block layout is not the one the model packs into"
    return None


def _kept_in_float32(skeleton: nn.Module, tensor: torch.Tensor, stored: torch.Tensor) -> bool:
    """Whether the entry's float32 copy of a tensor the skeleton has in the start's dtype is
    how diffusers loads it (a class that keeps some modules in float32); no other dtype
    ever differs from the one this start asks for."""
    return (
        bool(getattr(type(skeleton), "_keep_in_fp32_modules", None))
        and tensor.is_floating_point()
        and stored.dtype == torch.float32
    )


def _as_json(value: object) -> object:
    """``value`` as JSON reads it back (tuples become lists), to compare with a manifest."""
    return json.loads(json.dumps(value))


def _without_dtype(guards: object) -> object:
    return (
        {key: value for key, value in guards.items() if key != "dtype"}
        if isinstance(guards, dict)
        else guards
    )


def _spans(layout: DTypeLayout) -> list[tuple]:
    return [_span(span.name, span.offset, span.numel, span.shape) for span in layout.spans]


def _span(name: str, offset: int, numel: int, shape: Sequence[int]) -> tuple:
    return (name, offset, numel, tuple(shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def record_source(request: CacheRequest, source: str, key: str) -> None:
    """After a build or join: the next start with this source may skip loading."""
    RuntimeCacheStore(request.root, request.lock_timeout).record_source(source, key)


def attach_runtime_cache(
    request: CacheRequest, components: list[tuple[str, nn.Module]]
) -> tuple[RuntimeCacheEntry | None, CacheReport]:
    """Build or join the entry of these loaded DiTs; returns the mapped entry (a
    ``HostWeights`` for the backend), or None on a fallback, and what happened."""
    started = time.perf_counter()
    try:
        entry, outcome = _attach(request, components)
    except CacheFallbackError as error:
        metrics.HOST_BACKING_FALLBACKS.labels(reason=error.reason).inc()
        metrics.RUNTIME_CACHE_STARTS.labels(result="fallback").inc()
        logger.warning(
            "runtime cache unavailable; the DiT keeps its ordinary tensors",
            extra={"fields": {"reason": error.reason, "why": str(error)}},
        )
        seconds = time.perf_counter() - started
        return None, CacheReport("fallback", None, 0, seconds, f"{error.reason}: {error}")
    result = "built" if outcome.built else "joined"
    seconds = time.perf_counter() - started
    metrics.RUNTIME_CACHE_STARTS.labels(result=result).inc()
    if outcome.built:
        metrics.RUNTIME_CACHE_BUILD_SECONDS.observe(seconds)
    key = outcome.directory.name
    logger.info(
        "runtime cache attached",
        extra={"fields": {"key": key, "result": result, "seconds": round(seconds, 3)}},
    )
    return entry, CacheReport(result, key, directory_bytes(outcome.directory), seconds, "")


def identity_of(request: CacheRequest, components: list[tuple[str, nn.Module]]) -> CacheIdentity:
    """Hash the loaded tensors (with progress) and add the request's guards."""
    tensors = state_tensors(components)
    total = sum(tensor.nbytes for _, tensor in tensors)
    with tqdm(
        total=total,
        desc="runtime cache: hashing",
        unit="B",
        unit_scale=True,
        disable=total < 2**30,
    ) as progress:
        digest = content_digest(tensors, progress.update)
    return CacheIdentity(
        tuple((name, _guards(request, name, dit)) for name, dit in components), digest
    )


def _guards(request: CacheRequest, component: str, dit: nn.Module) -> IdentityGuards:
    return IdentityGuards(
        dit_class=type(dit).__name__,
        dit_config=canonical_config(dict(getattr(dit, "config", {}))),
        dtype=str(next(dit.parameters()).dtype).removeprefix("torch."),
        adapters=request.adapters.get(component, ()),
        block_paths=tuple(block_paths_for(dit, request.block_paths)),
        tensor_parallel_size=request.tensor_parallel[0],
        tensor_parallel_rank=request.tensor_parallel[1],
        sequence_parallel_size=request.sequence_parallel_size,
        edits=request.edits,
    )


def _attach(
    request: CacheRequest, components: list[tuple[str, nn.Module]]
) -> tuple[RuntimeCacheEntry, Outcome]:
    """Build or join, open, and compare; a corrupt entry is quarantined and rebuilt once."""
    _check_layouts(components)
    layouts = [component_layout(name, dit, request.block_paths) for name, dit in components]
    identity = identity_of(request, components)
    key = identity.key
    store = RuntimeCacheStore(request.root, request.lock_timeout, request.size_budget_bytes)
    nbytes = entry_nbytes(layouts)
    for attempt in range(2):
        outcome = store.build_or_join(key, nbytes, lambda d: write_entry(d, identity, layouts))
        if outcome.built:
            metrics.RUNTIME_CACHE_BYTES.inc(nbytes)
        try:
            entry = store.open(key)
        except EntryError as error:
            store.repair(key, str(error))
            if attempt:
                raise CacheFallbackError("cache-corrupt", str(error)) from error
            continue
        differs = entry.matches(components)
        if differs is None:
            return entry, outcome
        entry.close()
        store.repair(key, f"mapped bytes differ from the loaded tensors at {differs}")
        if attempt:
            raise CacheFallbackError(
                "cache-corrupt", f"runtime-cache entry {key} differs at {differs} after a rebuild"
            )
    raise AssertionError("unreachable")


def _check_layouts(components: list[tuple[str, nn.Module]]) -> None:
    """Tensors that are not plain CPU tensors, or that alias each other (tied weights),
    cannot be stored once each: such DiTs keep their ordinary tensors."""
    seen: dict[tuple[int, int], str] = {}
    for name, dit in components:
        for tensor_name, tensor in dit.state_dict(keep_vars=True).items():
            if tensor.device.type != "cpu":
                raise CacheFallbackError(
                    "cache-layout", f"{name}.{tensor_name} is not a CPU tensor ({tensor.device})"
                )
            if tensor.numel() == 0:
                continue
            where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if where in seen:
                raise CacheFallbackError(
                    "cache-layout",
                    f"{name}.{tensor_name} shares its storage with {seen[where]}; tied "
                    "weights are not cached",
                )
            seen[where] = f"{name}.{tensor_name}"
