"""The cache root on a node: build or join an entry under a kernel lock, publish atomically.

Layout of a root::

    entries/<key>/          published entries (manifest.json + safetensors files)
    locks/<key>.build       exclusive flock while one process builds or repairs <key>
    locks/<key>.use         shared flock held by every process that maps <key>
    locks/budget            exclusive flock while one process evicts and publishes
    tmp/<key>.<pid>.<n>/    an entry being written (same filesystem: rename is atomic)
    quarantine/<key>.<t>/   corrupt entries moved aside (mapped pages stay valid)
    sources/<source>.json   source identity -> entry key (skip-load)

``flock`` belongs to the open file description, so a killed process releases its locks
with its last descriptor: a lock file alone never means a live writer. A writer holds
``<key>.build`` while it writes ``tmp/<key>.*``, so every start removes the temporaries
whose build lock it can take (a dead writer's leftovers). Publishing is ``rename(2)``
after fsyncing the files and the new directory, then an fsync of ``entries/``: readers
see either no entry or a complete one.

Nothing here leaves the root: keys are 40 hexadecimal digits (never a path), the root's
directories must be directories (a symbolic link there is refused) and no file inside
is opened through a link. A read-only root can still be read and joined (locks are taken
on read-only descriptors); whatever needs to write reports it as ``cache-read-only``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path

from dlo_worker.errors import UserFixableError
from dlo_worker.observability import metrics
from dlo_worker.runtime_cache.entry import (
    EntryError,
    RuntimeCacheEntry,
    file_problems,
    fsync_directory,
    read_manifest,
)

logger = logging.getLogger(__name__)

FREE_SPACE_MARGIN = 256 * 2**20
"""Kept free beyond an entry's bytes when checking the disk before writing."""
SOURCE_RECORD_TEMPORARY_S = 600.0
"""A source record's temporary file older than this is a dead writer's (writing one takes
milliseconds; its writer holds no lock to tell)."""
KEY = re.compile(r"[0-9a-f]{40}")
_temporaries = count()


class CacheFallbackError(RuntimeError, UserFixableError):
    """The cache cannot serve this start (the ordinary tensors stay in use) or this command.

    ``reason`` is the label counted in ``dlo_host_backing_fallbacks_total``; the message
    says what to fix (a ``cache`` command prints it as its one line).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class CacheEntryInUseError(RuntimeError, UserFixableError):
    """An entry a command was asked to remove is missing, mapped or being built."""


class InvalidCacheKeyError(ValueError, UserFixableError):
    """A name given as an entry key is not one (keys are never paths)."""


def check_key(key: str) -> str:
    """``key`` if it is an entry key (40 lowercase hexadecimal digits), else refused."""
    if not KEY.fullmatch(key):
        raise InvalidCacheKeyError(
            f"{key!r} is not a runtime-cache key (40 hexadecimal digits, as "
            "`dlo-worker cache ls` lists them)"
        )
    return key


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

    @property
    def _directories(self) -> tuple[Path, ...]:
        return (self.entries, self.locks, self.tmp, self.quarantine, self.sources)

    def prepare(self) -> None:
        """Create the root's directories where missing, check them, and reclaim dead
        writers' temporaries (what a start does first)."""
        for directory in self._directories:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                if not (error.errno in _READ_ONLY and directory.is_dir()):
                    raise _fallback_for(
                        error, f"cannot prepare the cache root {self.root}"
                    ) from error
        self.check_directories()
        self.reclaim_temporaries()

    def check_directories(self) -> None:
        """Every directory of the root that exists is a directory, not a link out of it."""
        for directory in self._directories:
            try:
                mode = directory.lstat().st_mode
            except FileNotFoundError:
                continue
            except OSError as error:
                raise _fallback_for(error, f"cannot read the cache root {self.root}") from error
            if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
                raise CacheFallbackError(
                    "cache-error",
                    f"{directory} is {kind}; the cache root's directories must be its own "
                    "(remove it, or point --dlo-runtime-cache-root / --root elsewhere)",
                )

    def entry(self, key: str) -> Path:
        """Where entry ``key`` lives; refuses a key that is not one, and an entry that is a
        symbolic link (dlo-worker never writes one: it would lead out of the root)."""
        path = self.entries / check_key(key)
        if path.is_symlink():
            raise CacheFallbackError(
                "cache-error",
                f"{path} is a symbolic link, not an entry dlo-worker wrote; it is left alone "
                "(remove the link yourself if nothing needs it)",
            )
        return path

    def build_or_join(self, key: str, nbytes: int, write: Callable[[Path], None]) -> Outcome:
        """Join ``key`` if it is published and sound, else build it with ``write`` (which
        fills a directory) under the build lock. Raises :class:`CacheFallbackError`."""
        self.prepare()
        entry = self.entry(key)
        if self._sound(entry, key):
            return Outcome(entry, built=False)
        with self.build_lock(key):
            if self._sound(entry, key):
                # Another process published it while this one waited.
                return Outcome(entry, built=False)
            if entry.exists():
                self._quarantine(entry, key, "it failed validation")
            self._remove_temporaries(key)
            with self._budget_lock():
                self._make_room(key, nbytes)
            self._check_free_space(nbytes)
            staging = self.tmp / f"{key}.{os.getpid()}.{next(_temporaries)}"
            try:
                staging.mkdir()
                write(staging)
                fsync_directory(staging)
                with self._budget_lock():
                    # Headers and the manifest add to the tensors' bytes: the budget holds
                    # the bytes on disk.
                    self._make_room(key, directory_bytes(staging))
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

    def open(self, key: str) -> RuntimeCacheEntry:
        """Map published entry ``key`` under its shared use lock (raises EntryError)."""
        directory = self.entry(key)
        release = self.use_lock(key)
        try:
            return RuntimeCacheEntry(directory, read_manifest(directory, key), release)
        except EntryError:
            release()
            raise
        except Exception as error:  # safetensors' own errors for a corrupt file
            release()
            raise EntryError(f"{self.entries / key}: cannot map the entry ({error})") from error

    def repair(self, key: str, why: str) -> None:
        """Move a corrupt published entry aside under the build lock (processes that map it
        keep their pages; the next start rebuilds)."""
        entry = self.entry(key)
        with self.build_lock(key):
            if entry.exists():
                self._quarantine(entry, key, why)

    @contextmanager
    def build_lock(self, key: str) -> Iterator[None]:
        """Exclusive ``locks/<key>.build``, waiting at most ``lock_timeout`` seconds."""
        with self._exclusive(
            f"{check_key(key)}.build",
            f"another process held the runtime-cache build lock of {key} for more than "
            f"{self.lock_timeout:g} s (--dlo-runtime-cache-lock-timeout)",
        ):
            yield

    @contextmanager
    def _budget_lock(self) -> Iterator[None]:
        """Exclusive ``locks/budget`` while evicting and publishing, so processes building
        different keys cannot overshoot the size budget together (none without a budget)."""
        if self.size_budget_bytes is None:
            yield
            return
        with self._exclusive(
            "budget",
            f"another process held the runtime-cache budget lock for more than "
            f"{self.lock_timeout:g} s (--dlo-runtime-cache-lock-timeout)",
        ):
            yield

    @contextmanager
    def _exclusive(self, name: str, timeout_message: str) -> Iterator[None]:
        descriptor = self._open_lock(name)
        try:
            deadline = time.monotonic() + self.lock_timeout
            delay = 0.02
            while True:
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise CacheFallbackError("cache-lock-timeout", timeout_message) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.5)
            yield
        finally:
            os.close(descriptor)

    def use_lock(self, key: str) -> Callable[[], None]:
        """Take the shared ``locks/<key>.use`` for as long as the entry is mapped; returns
        its release (eviction takes it exclusively without waiting, so a mapped entry is
        never evicted)."""
        descriptor = self._open_lock(f"{check_key(key)}.use")
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        try:
            os.utime(descriptor)  # the entry's last use, for eviction
        except OSError as error:
            # A read-only root: nothing can evict there, so nothing needs the last use.
            logger.debug("last use not recorded", extra={"fields": {"why": str(error)}})

        def release() -> None:
            os.close(descriptor)

        return release

    def entries_by_last_use(self) -> list[tuple[float, str, int]]:
        """``(last use, key, bytes)`` of every published entry, least recently used first.
        Names in ``entries/`` that are not keys, and links, are no entries: skipped."""
        found = []
        for entry in self.entries.iterdir() if self.entries.is_dir() else ():
            if not KEY.fullmatch(entry.name) or entry.is_symlink() or not entry.is_dir():
                logger.warning(
                    "not a runtime-cache entry, left alone", extra={"fields": {"path": str(entry)}}
                )
                continue
            use_lock = self.locks / f"{entry.name}.use"
            last_use = use_lock.lstat().st_mtime if use_lock.exists() else 0.0
            found.append((last_use, entry.name, directory_bytes(entry)))
        return sorted(found)

    def record_source(self, source: str, key: str) -> None:
        """Remember that ``source`` (a source identity) loads to entry ``key``; atomic."""
        self.prepare()
        record = self.sources / f"{check_key(source)}.json"
        staging = self.tmp / f"{source}.source.{os.getpid()}.{next(_temporaries)}"
        try:
            staging.write_text(
                json.dumps({"key": check_key(key), "recorded": _iso(time.time())}) + "\n"
            )
            os.rename(staging, record)
        except OSError as error:
            staging.unlink(missing_ok=True)
            logger.warning(
                "runtime cache source not recorded (the next start loads ordinarily)",
                extra={"fields": {"source": source, "why": str(error)}},
            )

    def lookup_source(self, source: str) -> str | None:
        """The entry key recorded for ``source``, if any (whether that entry is sound is
        for opening it to tell)."""
        try:
            descriptor = os.open(
                self.sources / f"{check_key(source)}.json", os.O_RDONLY | os.O_NOFOLLOW
            )
            with os.fdopen(descriptor) as handle:
                key = json.load(handle)["key"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return key if isinstance(key, str) and KEY.fullmatch(key) else None

    def forget_source(self, source: str, why: str) -> None:
        """Drop the record of ``source`` (it names an entry of another model)."""
        try:
            (self.sources / f"{check_key(source)}.json").unlink(missing_ok=True)
        except OSError as error:
            logger.warning("source record kept", extra={"fields": {"why": str(error)}})
        metrics.RUNTIME_CACHE_CORRUPT.labels(what="source-record").inc()
        logger.warning(
            "runtime cache source record dropped", extra={"fields": {"source": source, "why": why}}
        )

    def describe(self) -> list[dict]:
        """Every published entry: key, DiT classes, bytes, creation, last use and how many
        processes map it now (``dlo-worker cache ls``)."""
        self.check_directories()
        described = []
        for last_use, key, size in reversed(self.entries_by_last_use()):
            try:
                manifest = read_manifest(self.entries / key, key)
                identity = manifest.identity.get("components", {})
                classes = {name: guards.get("dit_class") for name, guards in identity.items()}
                created, problem = manifest.created, None
            except EntryError as error:
                classes, created, problem = {}, None, str(error)
            described.append(
                {
                    "key": key,
                    "components": classes,
                    "bytes": size,
                    "created": created,
                    "last_use": _iso(last_use) if last_use else None,
                    "in_use_by": processes_holding(self.locks / f"{key}.use"),
                    "problem": problem,
                }
            )
        return described

    def verify(self, key: str) -> list[str]:
        """Problems of a published entry (``dlo-worker cache verify``), re-deriving all a
        start trusts: the manifest's schema, key and layout, each file's kind, size and
        time, the content digest of the mapped tensors, and each file's SHA-256. Reads
        without locks, so a read-only root verifies too."""
        self.check_directories()
        directory = self.entry(key)
        if not directory.is_dir():
            raise CacheEntryInUseError(f"no runtime-cache entry {key} under {self.root}")
        try:
            manifest = read_manifest(directory, key)
            entry = RuntimeCacheEntry(directory, manifest, lambda: None)
        except EntryError as error:
            return [str(error)]
        except Exception as error:  # safetensors' own errors for a corrupt file
            return [f"{directory}: cannot map the entry ({error})"]
        try:
            content = entry.content_problem()
        finally:
            entry.close()
        return [*([content] if content else []), *file_problems(directory, manifest)]

    def remove(self, key: str) -> None:
        """Delete an entry no process maps (``dlo-worker cache rm``)."""
        self.check_directories()
        if not self.entry(key).is_dir():
            raise CacheEntryInUseError(f"no runtime-cache entry {key} under {self.root}")
        if not self.evict(key):
            raise CacheEntryInUseError(
                f"runtime-cache entry {key} is in use by "
                f"{processes_holding(self.locks / f'{key}.use')} process(es) or being built; "
                "stop them first"
            )

    def evict(self, key: str) -> bool:
        """Remove ``key`` unless a process maps or builds it (never waits); True if removed."""
        entry = self.entry(key)
        use = self._open_lock(f"{key}.use")
        try:
            build = self._open_lock(f"{key}.build")
        except BaseException:
            os.close(use)
            raise
        try:
            for descriptor in (use, build):
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
            if not entry.is_dir():
                return False
            doomed = self.tmp / f"{key}.evicted.{time.time_ns()}"
            try:
                os.rename(entry, doomed)
                fsync_directory(self.entries)
            except OSError as error:
                raise _fallback_for(error, f"cannot remove runtime-cache entry {key}") from error
            shutil.rmtree(doomed, ignore_errors=True)
        finally:
            os.close(build)
            os.close(use)
        logger.info("runtime cache entry evicted", extra={"fields": {"key": key}})
        return True

    def reclaim_temporaries(self) -> None:
        """Remove what dead writers left in ``tmp/``: entries being written whose build lock
        is free, interrupted evictions, and stale source-record files. A live writer holds
        its key's build lock, so its temporary is never touched."""
        try:
            leftovers = list(self.tmp.iterdir())
        except OSError:
            return
        for leftover in leftovers:
            key, _, kind = leftover.name.partition(".")
            if leftover.is_symlink() or not KEY.fullmatch(key):
                continue
            try:
                if kind.startswith("source."):
                    dead = time.time() - leftover.lstat().st_mtime > SOURCE_RECORD_TEMPORARY_S
                    if dead:
                        leftover.unlink()
                elif kind.startswith("evicted."):
                    shutil.rmtree(leftover, ignore_errors=True)
                    dead = True
                else:
                    dead = self._remove_if_writer_died(key, leftover)
            except (OSError, CacheFallbackError) as error:  # a read-only root, or a race
                logger.debug("temporary kept", extra={"fields": {"why": str(error)}})
                continue
            if dead:
                logger.info(
                    "removed a dead writer's temporary",
                    extra={"fields": {"key": key, "path": str(leftover)}},
                )

    def _remove_if_writer_died(self, key: str, leftover: Path) -> bool:
        descriptor = self._open_lock(f"{key}.build")
        try:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its writer is alive
            shutil.rmtree(leftover)
            return True
        finally:
            os.close(descriptor)

    def _make_room(self, key: str, nbytes: int) -> None:
        """Evict least recently used entries no process maps until ``nbytes`` more fit the
        size budget (the caller holds ``key``'s build lock and the budget lock)."""
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
        """A lock file's descriptor, never through a link; read-only where the root is."""
        path = self.locks / name
        flags = os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise CacheFallbackError(
                    "cache-error",
                    f"{path} is a symbolic link; the cache's lock files must be its own "
                    "(remove the link)",
                ) from None
            if error.errno in _READ_ONLY:
                try:
                    return os.open(path, os.O_RDONLY | flags)  # flock needs no write access
                except OSError:
                    pass
            raise _fallback_for(error, f"cannot open the lock {path}") from error

    def _sound(self, entry: Path, key: str) -> bool:
        if not entry.is_dir():
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
        try:
            os.rename(entry, target)
            fsync_directory(self.entries)
        except OSError as error:
            raise _fallback_for(error, f"cannot quarantine runtime-cache entry {key}") from error
        metrics.RUNTIME_CACHE_CORRUPT.labels(what="entry").inc()
        logger.warning(
            "runtime cache entry quarantined",
            extra={"fields": {"key": key, "why": why, "moved_to": str(target)}},
        )

    def _remove_temporaries(self, key: str) -> None:
        """A dead writer's leftovers of ``key`` (the caller holds its build lock)."""
        for leftover in self.tmp.glob(f"{key}.*"):
            if leftover.is_symlink():
                continue
            shutil.rmtree(leftover, ignore_errors=True)
            logger.info(
                "removed a dead writer's temporary",
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


def directory_bytes(directory: Path) -> int:
    """Bytes of the regular files directly in ``directory`` (links are not followed)."""
    total = 0
    for path in directory.iterdir():
        status = path.lstat()
        if stat.S_ISREG(status.st_mode):
            total += status.st_size
    return total


def processes_holding(lock: Path) -> int:
    """How many open descriptions hold a shared ``flock`` on ``lock`` (from /proc/locks)."""
    try:
        status = lock.lstat()
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


_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def _fallback_for(error: OSError, what: str) -> CacheFallbackError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheFallbackError(
            "cache-disk-full", f"{what}: the disk is full ({error.strerror}); free space"
        )
    if error.errno in _READ_ONLY:
        return CacheFallbackError(
            "cache-read-only",
            f"{what}: the cache root is read-only or not writable ({error.strerror})",
        )
    return CacheFallbackError("cache-error", f"{what}: {error}")
