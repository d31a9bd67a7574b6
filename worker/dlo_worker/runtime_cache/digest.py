"""Digests of tensors and files: what an entry's key stands for, computed in parallel.

The content digest is a SHA-256 over one line per tensor, sorted by qualified name:
``<component>/<name>|<dtype>|<shape>|<SHA-256 of its bytes>``. Hashing each tensor on
its own lets a thread pool hash many at once (hashlib releases the GIL), so a builder
hashing its loaded tensors and a skip-load start re-hashing an entry's mapped views both
run at several GB/s; and the same function over either gives the same digest, so a
start can prove that the views a manifest describes are the tensors the key names.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

MAX_THREADS = 16


def hashing_threads(tasks: int) -> int:
    """Threads for ``tasks`` independent hashes on this machine."""
    return max(1, min(tasks, os.cpu_count() or 1, MAX_THREADS))


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in row-major order."""
    flat = tensor.detach().contiguous().reshape(-1)
    digest = hashlib.sha256()
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def state_tensors(components: list[tuple[str, nn.Module]]) -> list[tuple[str, torch.Tensor]]:
    """Every state-dict tensor of the DiTs, named ``<component>/<state-dict name>``."""
    return [
        (f"{component}/{name}", tensor)
        for component, dit in components
        for name, tensor in dit.state_dict(keep_vars=True).items()
    ]


def content_digest(
    tensors: Iterable[tuple[str, torch.Tensor]],
    progress: Callable[[int], None] | None = None,
) -> str:
    """The content digest of ``(qualified name, tensor)`` pairs (see the module docstring)."""
    named = sorted(tensors, key=lambda item: item[0])

    def hashed(item: tuple[str, torch.Tensor]) -> str:
        digest = tensor_sha256(item[1])
        if progress is not None:
            progress(item[1].nbytes)
        return digest

    with ThreadPoolExecutor(hashing_threads(len(named)), thread_name_prefix="dlo-hash") as pool:
        digests = list(pool.map(hashed, named))
    top = hashlib.sha256()
    for (name, tensor), digest in zip(named, digests, strict=True):
        dtype = str(tensor.dtype).removeprefix("torch.")
        top.update(f"{name}|{dtype}|{list(tensor.shape)}|{digest}\n".encode())
    return top.hexdigest()


def file_sha256(path: Path, chunk: int = 16 * 2**20) -> str:
    """SHA-256 of a regular file, never through a symbolic link."""
    digest = hashlib.sha256()
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def files_sha256(paths: list[Path]) -> list[str]:
    """:func:`file_sha256` of each path, one thread per file."""
    with ThreadPoolExecutor(hashing_threads(len(paths)), thread_name_prefix="dlo-hash") as pool:
        return list(pool.map(file_sha256, paths))
