"""Parsing /proc smaps: totals and the mappings of given files."""

from __future__ import annotations

from pathlib import Path

from dlo_worker.observability.memory import (
    parse_smaps_for_files,
    parse_smaps_rollup,
    process_memory,
)

SMAPS = """\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                  64 kB
Private_Dirty:        64 kB
Anonymous:            64 kB
VmFlags: rd wr mr mw me ac sd
7f0000000000-7f0000100000 r--p 00000000 08:01 42                         /models/a b.safetensors
Size:               1024 kB
Rss:                1000 kB
Pss:                 500 kB
Shared_Clean:       1000 kB
Private_Clean:         0 kB
VmFlags: rd mr me sd
7f0000200000-7f0000300000 r--p 00000000 08:01 43                         /models/other.bin
Rss:                 900 kB
Private_Clean:       900 kB
7f0000400000-7f0000500000 r--p 00000000 08:01 42                         /models/a b.safetensors
Rss:                  24 kB
Private_Dirty:         8 kB
Private_Clean:        16 kB
"""


def test_only_the_named_files_mappings_are_summed() -> None:
    usage = parse_smaps_for_files(SMAPS, [Path("/models/a b.safetensors")])
    assert usage.rss == 1024 * 1024
    assert usage.shared_clean == 1000 * 1024
    assert usage.private == 24 * 1024
    assert usage.private_dirty == 8 * 1024
    assert usage.anonymous == 0


def test_rollup_totals() -> None:
    usage = parse_smaps_rollup("Rss: 10 kB\nPss: 6 kB\nPrivate_Dirty: 4 kB\nAnonymous: 3 kB\n")
    assert (usage.rss, usage.pss, usage.private, usage.anonymous) == (10240, 6144, 4096, 3072)


def test_this_process_has_private_memory() -> None:
    usage = process_memory()
    assert usage.private > 0
    assert usage.rss >= usage.private
