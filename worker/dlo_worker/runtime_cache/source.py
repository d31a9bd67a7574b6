"""Where a DiT's weights come from, cheaply: the key of skip-load on a hit.

A cold start loads the checkpoint, hashes the final tensors and records
``source identity -> entry key``. A later start whose source identity is recorded binds
the DiT to that entry without reading a tensor byte of the checkpoint. The source
identity is what can be known from file metadata and headers alone: every checkpoint
file's name, size, modification time (nanoseconds) and the SHA-256 of its safetensors
header, the DiT's ``config.json``, its class, the dtype, the loader's adapters, the block
lists, the host-backing order the configuration implies, the edits written into the
loaded weights (``--fuse-lora``: each adapter file's digest and scale), the cache format
and the worker's version. Rewriting a shard (a new mtime), another dtype, another config or
another release of the worker all miss, and the start loads ordinarily.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path

from dlo_worker import __version__
from dlo_worker.runtime_cache.identity import FORMAT_VERSION


def file_fingerprint(path: Path) -> dict:
    """Name, size, mtime and header digest of one safetensors file (reads the header only)."""
    status = path.stat()
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = handle.read(min(length, 100 * 2**20))
    return {
        "name": path.name,
        "bytes": status.st_size,
        "mtime_ns": status.st_mtime_ns,
        "header_sha256": hashlib.sha256(header).hexdigest(),
    }


def component_source(
    *,
    files: Sequence[Path],
    config_json: str,
    dit_class: str,
    adapters: Sequence[str],
) -> dict:
    """The source of one DiT component (see the module docstring)."""
    return {
        "files": [file_fingerprint(path) for path in sorted(files)],
        "config": config_json,
        "class": dit_class,
        "adapters": list(adapters),
    }


def source_key(
    components: dict[str, dict],
    *,
    dtype: str,
    block_paths: Sequence[str] | None,
    backings: list,
    edits: Sequence[str] = (),
) -> str:
    """The key of a pipeline's DiT sources under one configuration and the edits written
    into the loaded weights (fused LoRA adapters' digests and scales)."""
    canonical = json.dumps(
        {
            "components": components,
            "dtype": dtype,
            "block_paths": list(block_paths) if block_paths else None,
            "host_backings": [str(backing) for backing in backings],
            "edits": list(edits),
            "format_version": FORMAT_VERSION,
            "writer": __version__,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:40]
