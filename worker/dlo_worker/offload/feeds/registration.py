"""Registering mapped host weights with the device driver, all or nothing.

A rank-local block read from a mapping (a runtime-cache entry, or a checkpoint that
matches the model exactly) is normally packed into pinned staging before its copy. If
the mapping itself is registered with the driver (page-locked, read-only), the copy
engine reads it directly: no pack, no staging, and the pages stay the ones every
process of the node shares through the page cache (docs/host-storage.md).

This module owns the platform-neutral part: which address ranges to register (the
views grouped by the file mapping holding them, page-aligned, coalesced; pure and
unit-tested), the
budget check before any platform call, and the lifecycle: register every range or
none (a failure rolls back what was registered and says why, so the caller keeps
staging), verify every view is seen as pinned, unregister before the mappings close.
A rollback that fails cannot be made safe (unmapping a still-registered range is
undefined), so it raises :class:`RegistrationRollbackError` and keeps the views alive
until the process ends. The platform is a :class:`HostRegistrar`;
:mod:`dlo_worker.offload.feeds.cuda_registrar` is the CUDA one.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
_RETAINED: list[object] = []
"""Views whose ranges could not be unregistered: kept mapped until the process ends."""


@dataclass(frozen=True, order=True)
class HostRange:
    """A page-aligned address range ``[start, stop)`` inside one mapping."""

    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ViewExtent:
    """Where a view's bytes lie, and the bounds of the mapping (storage) holding them."""

    mapping_start: int
    mapping_stop: int
    start: int
    stop: int


@dataclass(frozen=True, order=True)
class Mapping:
    """One mapped region of this process (a line of ``/proc/self/maps``)."""

    start: int
    stop: int
    path: str
    offset: int = 0
    """Where in the file the region starts."""
    shared: bool = False
    """``MAP_SHARED`` (perms ``...s``) rather than a private copy-on-write mapping."""


def read_mappings(maps: Path = Path("/proc/self/maps")) -> list[Mapping]:
    """This process's mapped regions, by address (Linux)."""
    mappings = []
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        path = fields[5] if len(fields) == 6 else ""
        mappings.append(Mapping(low, high, path, int(fields[2], 16), fields[1][3] == "s"))
    return sorted(mappings)


def mapping_of(view: torch.Tensor, mappings: Sequence[Mapping]) -> Mapping:
    """The file mapping holding all of ``view``. Raises :class:`RegistrationRefusedError`
    for a view that is not entirely inside one file mapping (e.g. private memory)."""
    start, stop = view.data_ptr(), view.data_ptr() + view.nbytes
    index = bisect.bisect_right([mapping.start for mapping in mappings], start) - 1
    if index < 0 or stop > mappings[index].stop or not mappings[index].path.startswith("/"):
        raise RegistrationRefusedError(
            "not-mapped", f"a view at {start:#x} ({view.nbytes} bytes) is not inside a file mapping"
        )
    return mappings[index]


def extent_of(view: torch.Tensor, mappings: Sequence[Mapping]) -> ViewExtent:
    """Where ``view`` lies and the file mapping holding it. Tensors read from one file are
    separate storages inside one mapping, so the mapping (not the storage) is what groups
    and bounds their ranges."""
    mapping = mapping_of(view, mappings)
    return ViewExtent(mapping.start, mapping.stop, view.data_ptr(), view.data_ptr() + view.nbytes)


class SharedFileViews:
    """The same bytes as a view, read through a read-only ``MAP_SHARED`` mapping of its file.

    safetensors maps files privately (copy-on-write). Linux makes a long-term read-only pin
    of a private mapping unshare every page first (copy it into anonymous memory), so
    registering one is both slow (measured: 1 GiB did not register in 100 s on an H200
    host, against 0.02 s for the same file mapped shared) and a private copy per process.
    A shared mapping of the same file maps the page-cache pages themselves.
    """

    def __init__(self) -> None:
        self._files: dict[str, torch.Tensor] = {}
        """Each shared mapping as one byte tensor (the tensor keeps the mapping alive): the
        views of a file share its storage, so copies of neighbouring tensors coalesce."""

    def view_of(self, view: torch.Tensor, mapping: Mapping) -> torch.Tensor:
        if mapping.shared:
            return view
        file = self._files.get(mapping.path)
        if file is None:
            try:
                with open(mapping.path, "rb") as handle:
                    shared = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as error:
                raise RegistrationRefusedError(
                    "not-mapped", f"cannot map {mapping.path} shared: {error.strerror}"
                ) from None
            with warnings.catch_warnings():  # read-only by design: nothing writes these views
                warnings.simplefilter("ignore", UserWarning)
                file = self._files[mapping.path] = torch.frombuffer(shared, dtype=torch.uint8)
        offset = mapping.offset + view.data_ptr() - mapping.start
        return file[offset : offset + view.nbytes].view(view.dtype).view(view.shape)


def page_ranges(extents: Iterable[ViewExtent], page: int = PAGE_BYTES) -> list[HostRange]:
    """The ranges to register for ``extents`` (pure): each view widened to whole pages,
    clamped to its mapping's pages, then overlapping or adjacent ranges of one mapping
    merged. Ranges of different mappings are never merged: each is one registration."""
    by_mapping: dict[tuple[int, int], list[HostRange]] = {}
    for extent in extents:
        if extent.stop <= extent.start:
            continue
        low = max(extent.start // page * page, extent.mapping_start // page * page)
        high = min(-(-extent.stop // page) * page, -(-extent.mapping_stop // page) * page)
        by_mapping.setdefault((extent.mapping_start, extent.mapping_stop), []).append(
            HostRange(low, high)
        )
    merged: list[HostRange] = []
    for ranges in by_mapping.values():
        mapping_merged: list[HostRange] = []
        for current in sorted(ranges):
            if mapping_merged and current.start <= mapping_merged[-1].stop:
                last = mapping_merged[-1]
                mapping_merged[-1] = HostRange(last.start, max(last.stop, current.stop))
            else:
                mapping_merged.append(current)
        merged += mapping_merged
    return sorted(merged)


class PlatformRegistrationError(RuntimeError):
    """The platform refused one registration call (the message names its error)."""


class HostRegistrar(Protocol):
    """A platform's host-registration calls (CUDA: ``cudaHostRegister``)."""

    name: str

    def unsupported_reason(self) -> str | None:
        """Why read-only registration of file-backed mappings is impossible here, or None."""
        ...

    def register(self, start: int, nbytes: int) -> None:
        """Register one range read-only; raises :class:`PlatformRegistrationError` after
        clearing the platform's error state."""
        ...

    def unregister(self, start: int) -> None:
        """Unregister the range registered at ``start``; raises on failure."""
        ...

    def is_pinned(self, view: torch.Tensor) -> bool:
        """Whether the platform sees the view as page-locked."""
        ...


class RegistrationRefusedError(RuntimeError):
    """Registration did not happen (nothing stays registered); ``reason`` is a short
    metric label (``budget``, ``unsupported``, ``not-mapped``, ``failed``, ``timeout``,
    ``not-pinned``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RegistrationRollbackError(RuntimeError):
    """Registered ranges could not be unregistered: start-up must abort (the views are
    kept mapped until the process ends, since unmapping them would be unsafe)."""


class RegisteredRanges:
    """Host ranges registered with a platform, unregistered together by :meth:`release`."""

    def __init__(
        self,
        registrar: HostRegistrar,
        ranges: Sequence[HostRange],
        views: Sequence[torch.Tensor],
    ) -> None:
        self.registrar = registrar
        self.ranges = list(ranges)
        self._views = list(views)
        """Kept so a range that cannot be unregistered also cannot be unmapped."""

    @property
    def nbytes(self) -> int:
        return sum(host_range.nbytes for host_range in self.ranges)

    @property
    def views(self) -> list[torch.Tensor]:
        """The registered views, in the order given to :meth:`register`: the same bytes,
        read through shared mappings (copy from these, not from the originals)."""
        return list(self._views)

    @classmethod
    def register(
        cls,
        views: Sequence[torch.Tensor],
        registrar: HostRegistrar,
        *,
        budget_bytes: int,
        timeout_s: float,
    ) -> RegisteredRanges:
        """Register every range of ``views`` (read through shared mappings of their files,
        see :class:`SharedFileViews`; :attr:`views` holds them) or none. Raises
        :class:`RegistrationRefusedError` (nothing registered; the caller stages) or
        :class:`RegistrationRollbackError` (fatal)."""
        private = read_mappings()
        translator = SharedFileViews()
        views = [translator.view_of(view, mapping_of(view, private)) for view in views]
        mappings = read_mappings()
        ranges = page_ranges(extent_of(view, mappings) for view in views)
        total = sum(host_range.nbytes for host_range in ranges)
        if total > budget_bytes:
            raise RegistrationRefusedError(
                "budget",
                f"registering the mapped weights needs {total / 2**30:.2f} GiB, over the "
                f"{budget_bytes / 2**30:.2f} GiB budget (--dlo-runtime-cache-pin-limit-gib)",
            )
        if (reason := registrar.unsupported_reason()) is not None:
            raise RegistrationRefusedError("unsupported", reason)
        registered = cls(registrar, [], views)
        started = time.monotonic()
        with (
            _Watchdog(total, started),
            tqdm(
                total=total, unit="B", unit_scale=True, desc="DLO host registration", leave=False
            ) as progress,
        ):
            for host_range in ranges:
                try:
                    registrar.register(host_range.start, host_range.nbytes)
                except PlatformRegistrationError as error:
                    registered._roll_back()
                    raise RegistrationRefusedError(
                        "failed",
                        f"{registrar.name} refused {host_range.nbytes / 2**20:.1f} MiB at "
                        f"{host_range.start:#x}: {error}",
                    ) from None
                registered.ranges.append(host_range)
                progress.update(host_range.nbytes)
                if time.monotonic() - started > timeout_s:
                    registered._roll_back()
                    raise RegistrationRefusedError(
                        "timeout",
                        f"registering {total / 2**30:.2f} GiB took over {timeout_s:g} s",
                    )
        unpinned = [view for view in views if not registrar.is_pinned(view)]
        if unpinned:
            registered._roll_back()
            raise RegistrationRefusedError(
                "not-pinned",
                f"{len(unpinned)} of {len(views)} mapped tensors are not seen as pinned "
                "after registration",
            )
        logger.info(
            "host ranges registered",
            extra={
                "fields": {
                    "platform": registrar.name,
                    "ranges": len(ranges),
                    "gib": round(total / 2**30, 3),
                    "seconds": round(time.monotonic() - started, 3),
                }
            },
        )
        return registered

    def release(self) -> None:
        """Unregister every range (the caller synchronized the copies that read them, and
        closes the mappings only afterwards). Idempotent."""
        if self.ranges:
            self._roll_back()
            logger.info("host ranges unregistered", extra={"fields": {}})
        self._views.clear()

    def _roll_back(self) -> None:
        failed = []
        for host_range in reversed(self.ranges):
            try:
                self.registrar.unregister(host_range.start)
            except PlatformRegistrationError as error:
                failed.append(f"{host_range.start:#x}: {error}")
        self.ranges.clear()
        if failed:
            _RETAINED.append(list(self._views))
            raise RegistrationRollbackError(
                f"could not unregister {len(failed)} host range(s) ({'; '.join(failed)}); "
                "the process must exit before their mappings can be released"
            )


class _Watchdog:
    """Logs a warning every minute while a registration runs (a hung driver call cannot be
    interrupted, but it can be seen)."""

    INTERVAL_S = 60.0

    def __init__(self, total_bytes: int, started: float) -> None:
        self._total = total_bytes
        self._started = started
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dlo-register-watch", daemon=True)

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(self.INTERVAL_S):
            logger.warning(
                "host registration still running",
                extra={
                    "fields": {
                        "gib": round(self._total / 2**30, 3),
                        "seconds": round(time.monotonic() - self._started),
                    }
                },
            )
