"""The node-local runtime weight cache (design doc, "Post-load runtime cache").

After the ordinary loader produced a DiT's final CPU tensors, every process of a node
with the same identity maps one content-addressed entry instead of keeping a private
copy: the first builds and publishes it under a kernel lock, the others join. The entry
stores each streamed block in DLO's packed slot layout (one copy per dtype per block).
Any failure keeps the already-valid ordinary tensors, logs why and counts the reason.

A start whose source identity (checkpoint files' metadata and headers, config, dtype,
...) was recorded by an earlier build or join skips loading the DiT altogether and binds
its meta skeleton to the entry (skip-load).

What is verified when: every start checks the manifest (format, key, each file's size
and mtime). A build or join also compares every mapped byte with the tensors the process
loaded (it has them in memory, and the comparison runs at memory speed), so a join never
streams bytes that differ from an ordinary load. A skip-load start has no loaded tensors
and re-hashes every file against the manifest instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn
from tqdm.auto import tqdm

from dlo_worker import metrics
from dlo_worker.offload.plan import block_paths_for
from dlo_worker.runtime_cache.entry import (
    EntryError,
    RuntimeCacheEntry,
    component_layout,
    content_digest,
    entry_nbytes,
    read_manifest,
    verify_files,
    write_entry,
)
from dlo_worker.runtime_cache.identity import CacheIdentity, IdentityGuards, canonical_config
from dlo_worker.runtime_cache.store import CacheFallbackError, Outcome, RuntimeCacheStore

logger = logging.getLogger(__name__)

__all__ = [
    "CacheFallbackError",
    "CacheReport",
    "CacheRequest",
    "RuntimeCacheEntry",
    "RuntimeCacheStore",
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


def entry_for_source(
    request: CacheRequest, source: str
) -> tuple[RuntimeCacheEntry, CacheReport] | None:
    """Skip-load: the mapped entry recorded for this source identity, or None on a miss.

    There are no loaded tensors to compare with, so every file is re-hashed against the
    manifest (in parallel; the read also brings the entry into the page cache that
    streaming then reads). A corrupt entry is quarantined and the start loads ordinarily,
    which rebuilds it.
    """
    started = time.perf_counter()
    store = RuntimeCacheStore(request.root, request.lock_timeout, request.size_budget_bytes)
    try:
        store.prepare()
        key = store.lookup_source(source)
        entry = None if key is None else _open(store, key, store.entries / key)
    except (CacheFallbackError, EntryError) as error:
        logger.warning(
            "runtime cache skip-load missed",
            extra={"fields": {"source": source, "why": str(error)}},
        )
        return None
    if entry is None:
        return None
    corrupt = verify_files(entry.directory, entry.manifest)
    if corrupt:
        entry.close()
        store.repair(key, f"files whose SHA-256 differs from the manifest: {', '.join(corrupt)}")
        return None
    metrics.RUNTIME_CACHE_STARTS.labels(result="hit").inc()
    seconds = time.perf_counter() - started
    logger.info(
        "runtime cache attached",
        extra={"fields": {"key": key, "result": "hit", "seconds": round(seconds, 3)}},
    )
    size = sum(path.stat().st_size for path in entry.directory.iterdir())
    return entry, CacheReport("hit", key, size, seconds, "")


def record_source(request: CacheRequest, source: str, key: str) -> None:
    """After a build or join: the next start with this source may skip loading."""
    RuntimeCacheStore(request.root, request.lock_timeout).record_source(source, key)


def attach_runtime_cache(
    request: CacheRequest, components: list[tuple[str, nn.Module]]
) -> tuple[RuntimeCacheEntry | None, CacheReport]:
    """Build or join the entry of these loaded DiTs; returns the mapped entry (a
    ``HostWeightSource`` for the backend), or None on a fallback, and what happened."""
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
    size = sum(path.stat().st_size for path in outcome.directory.iterdir())
    return entry, CacheReport(result, key, size, seconds, "")


def identity_of(request: CacheRequest, components: list[tuple[str, nn.Module]]) -> CacheIdentity:
    """Hash the loaded tensors (with progress) and add the request's guards."""
    total = sum(t.nbytes for _, dit in components for t in dit.state_dict().values())
    with tqdm(
        total=total,
        desc="runtime cache: hashing",
        unit="B",
        unit_scale=True,
        disable=total < 2**30,
    ) as progress:
        digest = content_digest(components, progress.update)
    return CacheIdentity(
        tuple(
            (
                name,
                IdentityGuards(
                    dit_class=type(dit).__name__,
                    dit_config=canonical_config(dict(getattr(dit, "config", {}))),
                    dtype=str(next(dit.parameters()).dtype).removeprefix("torch."),
                    adapters=request.adapters.get(name, ()),
                    block_paths=tuple(block_paths_for(dit, request.block_paths)),
                    tensor_parallel_size=request.tensor_parallel[0],
                    tensor_parallel_rank=request.tensor_parallel[1],
                    sequence_parallel_size=request.sequence_parallel_size,
                ),
            )
            for name, dit in components
        ),
        digest,
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
            entry = _open(store, key, outcome.directory)
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


def _open(store: RuntimeCacheStore, key: str, directory: Path) -> RuntimeCacheEntry:
    release = store.use_lock(key)
    try:
        manifest = read_manifest(directory, key)
        return RuntimeCacheEntry(directory, manifest, release)
    except EntryError:
        release()
        raise
    except Exception as error:  # safetensors' own errors for a corrupt file
        release()
        raise EntryError(f"{directory}: cannot map the entry ({error})") from error


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
