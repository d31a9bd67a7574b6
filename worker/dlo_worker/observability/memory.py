"""Where a process's host memory is: private, or shared through the page cache.

Linux reports it per mapping in ``/proc/<pid>/smaps`` and summed in
``/proc/<pid>/smaps_rollup``. Checkpoint-backed DLO should leave the DiT's pages
*shared clean* (mapped by every worker on the node, never copied), with private
memory near the staging slots plus the non-DiT weights. Parsing is pure; reading
``/proc`` is the only I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

_KIB = 1024


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes, as in smaps: private = mapped by this process only; shared = by several."""

    rss: int = 0
    pss: int = 0
    shared_clean: int = 0
    shared_dirty: int = 0
    private_clean: int = 0
    private_dirty: int = 0
    anonymous: int = 0

    @property
    def private(self) -> int:
        """Unique set size: what this process alone keeps resident."""
        return self.private_clean + self.private_dirty

    def __add__(self, other: MemoryUsage) -> MemoryUsage:
        return MemoryUsage(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


_FIELDS = {
    "Rss": "rss",
    "Pss": "pss",
    "Shared_Clean": "shared_clean",
    "Shared_Dirty": "shared_dirty",
    "Private_Clean": "private_clean",
    "Private_Dirty": "private_dirty",
    "Anonymous": "anonymous",
}


def _usage(lines: Iterable[str]) -> MemoryUsage:
    values: dict[str, int] = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in _FIELDS and rest.strip().endswith("kB"):
            values[_FIELDS[key]] = int(rest.split()[0]) * _KIB
    return MemoryUsage(**values)


def parse_smaps_rollup(text: str) -> MemoryUsage:
    """The totals of ``/proc/<pid>/smaps_rollup``."""
    return _usage(text.splitlines())


def parse_smaps_for_files(text: str, files: Iterable[Path]) -> MemoryUsage:
    """The summed usage of every mapping in ``/proc/<pid>/smaps`` backed by one of ``files``."""
    wanted = {str(Path(file).resolve()) for file in files}
    total = MemoryUsage()
    current: list[str] | None = None
    for line in text.splitlines():
        header = line.split()
        # A mapping header: "start-end perms offset dev inode [path]".
        if len(header) >= 5 and "-" in header[0] and ":" not in header[0]:
            if current is not None:
                total += _usage(current)
            path = " ".join(header[5:]) if len(header) > 5 else ""
            current = [] if path in wanted else None
        elif current is not None:
            current.append(line)
    if current is not None:
        total += _usage(current)
    return total


def process_memory(pid: int | str = "self") -> MemoryUsage:
    return parse_smaps_rollup(Path(f"/proc/{pid}/smaps_rollup").read_text())


def mapped_file_memory(files: Iterable[Path], pid: int | str = "self") -> MemoryUsage:
    return parse_smaps_for_files(Path(f"/proc/{pid}/smaps").read_text(), files)
