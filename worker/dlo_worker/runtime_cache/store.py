"""The cache root on a node: build or join an entry under a kernel lock, publish atomically.

Layout of a root::

    entries/<key>/          published entries (manifest.json + safetensors files)
    locks/<key>.build       exclusive flock while one process builds or repairs <key>
    locks/<key>.use         shared flock held by every process that maps <key>
    tmp/<key>.<pid>.<n>/    an entry being written (same filesystem: rename is atomic)
    quarantine/<key>.<t>/   corrupt entries moved aside (mapped pages stay valid)

``flock`` belongs to the open file description, so a killed process releases its locks
with its last descriptor: a lock file alone never means a live writer. Only the holder
of ``<key>.build`` removes ``tmp/<key>.*`` (a dead writer's leftovers) and publishes with
``rename(2)`` after fsyncing the files and the new directory, then fsyncs ``entries/``:
readers see either no entry or a complete one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path

from dlo_worker.errors import UserFixableError
from dlo_worker.runtime_cache.entry import (
    MANIFEST,
    EntryError,
    fsync_directory,
    read_manifest,
    verify_files,
)

logger = logging.getLogger(__name__)

FREE_SPACE_MARGIN = 256 * 2**20
"""Kept free beyond an entry's bytes when checking the disk before writing."""
_temporaries = count()


class CacheFallbackError(RuntimeError):
    """The cache cannot serve this start; the ordinary tensors stay in use.

    ``reason`` is the label counted in ``dlo_host_backing_fallbacks_total``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class CacheEntryInUseError(RuntimeError, UserFixableError):
    """An entry a command was asked to remove is missing, mapped or being built."""


@dataclass(frozen=True)
class Outcome:
    """Where the entry is and whether this process built it."""

    directory: Path
    built: bool


class RuntimeCacheStore:
    """One cache root; see the module docstring."""

    def __init__(
        self, root: Path, lock_timeout: float, size_budget_bytes: int | None = None
    ) -> None:
        self.root = root
        self.lock_timeout = lock_timeout
        self.size_budget_bytes = size_budget_bytes
        self.entries = root / "entries"
        self.locks = root / "locks"
        self.tmp = root / "tmp"
        self.quarantine = root / "quarantine"
        self.sources = root / "sources"

    def prepare(self) -> None:
        """Create the root's directories (a read-only or foreign root falls back)."""
        try:
            for directory in (self.entries, self.locks, self.tmp, self.quarantine, self.sources):
                directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise _fallback_for(error, f"cannot prepare the cache root {self.root}") from error

    def build_or_join(self, key: str, nbytes: int, write: Callable[[Path], None]) -> Outcome:
        """Join ``key`` if it is published and sound, else build it with ``write`` (which
        fills a directory) under the build lock. Raises :class:`CacheFallbackError`."""
        self.prepare()
        entry = self.entries / key
        if self._sound(entry, key):
            return Outcome(entry, built=False)
        with self.build_lock(key):
            if self._sound(entry, key):
                # Another process published it while this one waited.
                return Outcome(entry, built=False)
            if entry.exists():
                self._quarantine(entry, key, "it failed validation")
            self._remove_temporaries(key)
            self._make_room(key, nbytes)
            self._check_free_space(nbytes)
            staging = self.tmp / f"{key}.{os.getpid()}.{next(_temporaries)}"
            try:
                staging.mkdir()
                write(staging)
                fsync_directory(staging)
                os.rename(staging, entry)
                fsync_directory(self.entries)
            except OSError as error:
                shutil.rmtree(staging, ignore_errors=True)
                raise _fallback_for(error, f"cannot publish runtime-cache entry {key}") from error
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        logger.info("runtime cache entry published", extra={"fields": {"key": key}})
        return Outcome(entry, built=True)

    def repair(self, key: str, why: str) -> None:
        """Move a corrupt published entry aside under the build lock (processes that map it
        keep their pages; the next start rebuilds)."""
        entry = self.entries / key
        with self.build_lock(key):
            if entry.exists():
                self._quarantine(entry, key, why)

    @contextmanager
    def build_lock(self, key: str) -> Iterator[None]:
        """Exclusive ``locks/<key>.build``, waiting at most ``lock_timeout`` seconds."""
        descriptor = self._open_lock(f"{key}.build")
        try:
            deadline = time.monotonic() + self.lock_timeout
            delay = 0.02
            while True:
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise CacheFallbackError(
                            "cache-lock-timeout",
                            f"another process held the runtime-cache build lock of {key} for "
                            f"more than {self.lock_timeout:g} s "
                            "(--dlo-runtime-cache-lock-timeout)",
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.5)
            yield
        finally:
            os.close(descriptor)

    def use_lock(self, key: str) -> Callable[[], None]:
        """Take the shared ``locks/<key>.use`` for as long as the entry is mapped; returns
        its release (eviction takes it exclusively without waiting, so a mapped entry is
        never evicted)."""
        descriptor = self._open_lock(f"{key}.use")
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        os.utime(descriptor)  # the entry's last use, for eviction

        def release() -> None:
            os.close(descriptor)

        return release

    def entries_by_last_use(self) -> list[tuple[float, str, int]]:
        """``(last use, key, bytes)`` of every published entry, least recently used first."""
        found = []
        for entry in self.entries.iterdir() if self.entries.exists() else ():
            use_lock = self.locks / f"{entry.name}.use"
            last_use = use_lock.stat().st_mtime if use_lock.exists() else 0.0
            size = sum(path.stat().st_size for path in entry.iterdir() if path.is_file())
            found.append((last_use, entry.name, size))
        return sorted(found)

    def record_source(self, source: str, key: str) -> None:
        """Remember that ``source`` (a source identity) loads to entry ``key``; atomic."""
        self.prepare()
        record = self.sources / f"{source}.json"
        staging = self.tmp / f"{source}.source.{os.getpid()}.{next(_temporaries)}"
        try:
            staging.write_text(json.dumps({"key": key, "recorded": _iso(time.time())}) + "\n")
            os.rename(staging, record)
        except OSError as error:
            staging.unlink(missing_ok=True)
            logger.warning(
                "runtime cache source not recorded (the next start loads ordinarily)",
                extra={"fields": {"source": source, "why": str(error)}},
            )

    def lookup_source(self, source: str) -> str | None:
        """The entry key recorded for ``source`` if that entry is published and sound."""
        try:
            key = json.loads((self.sources / f"{source}.json").read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return key if isinstance(key, str) and self._sound(self.entries / key, key) else None

    def describe(self) -> list[dict]:
        """Every published entry: key, DiT classes, bytes, creation, last use and how many
        processes map it now (``dlo-worker cache ls``)."""
        described = []
        for last_use, key, size in reversed(self.entries_by_last_use()):
            entry = self.entries / key
            try:
                manifest = json.loads((entry / MANIFEST).read_text())
            except (OSError, ValueError):
                manifest = {}
            identity = manifest.get("identity", {}).get("components", {})
            described.append(
                {
                    "key": key,
                    "components": {name: g.get("dit_class") for name, g in identity.items()},
                    "bytes": size,
                    "created": manifest.get("created"),
                    "last_use": _iso(last_use) if last_use else None,
                    "in_use_by": processes_holding(self.locks / f"{key}.use"),
                }
            )
        return described

    def verify(self, key: str) -> list[str]:
        """Problems of a published entry, re-hashing every file (``dlo-worker cache verify``):
        an unreadable or mismatched manifest, a missing or resized file, a changed digest."""
        entry = self.entries / key
        try:
            manifest = read_manifest(entry, key)
        except EntryError as error:
            return [str(error)]
        return [
            f"{entry / name}: its SHA-256 differs from the manifest's"
            for name in verify_files(entry, manifest)
        ]

    def remove(self, key: str) -> None:
        """Delete an entry no process maps (``dlo-worker cache rm``)."""
        if not (self.entries / key).exists():
            raise CacheEntryInUseError(f"no runtime-cache entry {key} under {self.root}")
        if not self.evict(key):
            raise CacheEntryInUseError(
                f"runtime-cache entry {key} is in use by "
                f"{processes_holding(self.locks / f'{key}.use')} process(es) or being built; "
                "stop them first"
            )

    def evict(self, key: str) -> bool:
        """Remove ``key`` unless a process maps or builds it (never waits); True if removed."""
        entry = self.entries / key
        use = self._open_lock(f"{key}.use")
        build = self._open_lock(f"{key}.build")
        try:
            for descriptor in (use, build):
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
            if not entry.exists():
                return False
            doomed = self.tmp / f"{key}.evicted.{time.time_ns()}"
            os.rename(entry, doomed)
            fsync_directory(self.entries)
            shutil.rmtree(doomed, ignore_errors=True)
        finally:
            os.close(build)
            os.close(use)
        logger.info("runtime cache entry evicted", extra={"fields": {"key": key}})
        return True

    def _make_room(self, key: str, nbytes: int) -> None:
        """Evict least recently used entries no process maps until ``nbytes`` more fit the
        size budget (the caller holds ``key``'s build lock)."""
        budget = self.size_budget_bytes
        if budget is None:
            return
        if nbytes > budget:
            raise CacheFallbackError(
                "cache-budget",
                f"the entry needs {nbytes / 2**30:.2f} GiB, more than the cache's size budget "
                f"of {budget / 2**30:.2f} GiB (--dlo-runtime-cache-size-budget-gib)",
            )
        entries = [item for item in self.entries_by_last_use() if item[1] != key]
        used = sum(size for *_, size in entries)
        busy = []
        for _, other, size in entries:
            if used + nbytes <= budget:
                return
            if self.evict(other):
                used -= size
            else:
                busy.append(other)
        if used + nbytes > budget:
            raise CacheFallbackError(
                "cache-budget",
                f"the entry needs {nbytes / 2**30:.2f} GiB and the cache's size budget of "
                f"{budget / 2**30:.2f} GiB is held by entries in use ({', '.join(busy)}); "
                "raise --dlo-runtime-cache-size-budget-gib",
            )

    def _open_lock(self, name: str) -> int:
        try:
            return os.open(self.locks / name, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise _fallback_for(error, f"cannot open the lock {self.locks / name}") from error

    def _sound(self, entry: Path, key: str) -> bool:
        if not entry.exists():
            return False
        try:
            read_manifest(entry, key)
        except EntryError as error:
            logger.warning(
                "runtime cache entry rejected", extra={"fields": {"key": key, "why": str(error)}}
            )
            return False
        return True

    def _quarantine(self, entry: Path, key: str, why: str) -> None:
        target = self.quarantine / f"{key}.{time.time_ns()}"
        os.rename(entry, target)
        fsync_directory(self.entries)
        logger.warning(
            "runtime cache entry quarantined",
            extra={"fields": {"key": key, "why": why, "moved_to": str(target)}},
        )

    def _remove_temporaries(self, key: str) -> None:
        """A dead writer's leftovers (only the build-lock holder calls this)."""
        for leftover in self.tmp.glob(f"{key}.*"):
            shutil.rmtree(leftover, ignore_errors=True)
            logger.info(
                "removed a dead writer's temporary entry",
                extra={"fields": {"key": key, "path": str(leftover)}},
            )

    def _check_free_space(self, nbytes: int) -> None:
        free = shutil.disk_usage(self.root).free
        if free < nbytes + FREE_SPACE_MARGIN:
            raise CacheFallbackError(
                "cache-disk-full",
                f"the cache root {self.root} has {free / 2**30:.2f} GiB free; the entry needs "
                f"{nbytes / 2**30:.2f} GiB (+{FREE_SPACE_MARGIN / 2**20:.0f} MiB); free space "
                "or point --dlo-runtime-cache-root elsewhere",
            )


def processes_holding(lock: Path) -> int:
    """How many open descriptions hold a shared ``flock`` on ``lock`` (from /proc/locks)."""
    try:
        status = lock.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return 0
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    return sum(
        1
        for line in table.splitlines()
        if (fields := line.split()) and "FLOCK" in fields and "READ" in fields and device in fields
    )


def _iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


def _fallback_for(error: OSError, what: str) -> CacheFallbackError:
    if error.errno == errno.ENOSPC:
        return CacheFallbackError("cache-disk-full", f"{what}: the disk is full ({error})")
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return CacheFallbackError("cache-read-only", f"{what}: {error}")
    return CacheFallbackError("cache-error", f"{what}: {error}")
