"""One runtime-cache entry on disk: packed safetensors files plus a JSON manifest.

Every streamed block is stored, per dtype, as one flat tensor in exactly the layout of
DLO's device slot (:func:`dlo_worker.offload.layout.layout_of`: the block's parameters
in order, each at a 256-byte aligned offset), so streaming a block from the entry is one
copy per dtype. Every other tensor of the DiT's state dict (embedders, norms, buffers) is
stored as an ordinary named tensor. The files are standard safetensors: any reader opens
them. The manifest records the identity, the content digest, the layout, the SHA-256 and
size of every file, the writer and the creation time.

Writing happens in a directory the caller publishes atomically (see ``store``); reading
maps the files and hands out zero-copy views through the ``HostWeightSource`` protocol.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from dlo_worker import __version__
from dlo_worker.offload.host_source import HostWeightPlanError
from dlo_worker.offload.layout import BlockLayout, layout_of, streamed_parameters
from dlo_worker.offload.plan import discover
from dlo_worker.runtime_cache.identity import FORMAT_VERSION, CacheIdentity

MANIFEST = "manifest.json"
FILE_BYTES = 2 * 2**30
"""Blocks are grouped into files of about this size (bounds the writer's extra memory)."""


class EntryError(RuntimeError):
    """The entry on disk is incomplete, corrupt or of another identity."""


@dataclass(frozen=True)
class PackedBlock:
    """One streamed block of a DiT and its packed layout."""

    name: str
    """Qualified inside the DiT: ``transformer_blocks.3``."""
    parameters: list[tuple[str, nn.Parameter]]
    layout: BlockLayout


@dataclass(frozen=True)
class ComponentLayout:
    """What an entry stores for one DiT: packed blocks, and every other state-dict tensor."""

    component: str
    blocks: list[PackedBlock]
    others: dict[str, torch.Tensor]


def component_layout(
    component: str, dit: nn.Module, block_paths: Iterable[str] | None
) -> ComponentLayout:
    """Split a loaded DiT into packed blocks (DLO's discovery and layout) and the rest."""
    (plan,) = discover(dit, tuple(block_paths) if block_paths else None).dits
    resident = {id(p) for module in plan.resident_modules for p in module.parameters()}
    blocks = []
    packed: set[str] = set()
    for name, block in plan.blocks:
        parameters = streamed_parameters(block, resident)
        blocks.append(PackedBlock(name, parameters, layout_of(parameters)))
        packed.update(f"{name}.{param_name}" for param_name, _ in parameters)
    others = {
        name: tensor
        for name, tensor in dit.state_dict(keep_vars=True).items()
        if name not in packed
    }
    return ComponentLayout(component, blocks, others)


def content_digest(
    components: list[tuple[str, nn.Module]], progress: Callable[[int], None] | None = None
) -> str:
    """SHA-256 over every state-dict tensor's name, dtype, shape and bytes (sorted names)."""
    digest = hashlib.sha256()
    for component, dit in components:
        state = dit.state_dict(keep_vars=True)
        for name in sorted(state):
            tensor = state[name].detach()
            header = f"{component}/{name}|{tensor.dtype}|{tuple(tensor.shape)}|"
            digest.update(header.encode())
            digest.update(_bytes_of(tensor))
            if progress is not None:
                progress(tensor.nbytes)
    return digest.hexdigest()


def entry_nbytes(layouts: list[ComponentLayout]) -> int:
    """Bytes the entry's tensors take on disk (headers aside)."""
    packed = sum(block.layout.nbytes for layout in layouts for block in layout.blocks)
    others = sum(t.nbytes for layout in layouts for t in layout.others.values())
    return packed + others


def write_entry(directory: Path, identity: CacheIdentity, layouts: list[ComponentLayout]) -> None:
    """Write the files and the manifest into ``directory`` and fsync them (not the
    directory's parent: publishing is the store's)."""
    files: dict[str, list[tuple[str, Callable[[], torch.Tensor]]]] = {}
    manifest_components: dict[str, dict] = {}
    file_index, file_bytes = 0, 0
    for layout in layouts:
        blocks = []
        for block in layout.blocks:
            if file_bytes and file_bytes + block.layout.nbytes > FILE_BYTES:
                file_index, file_bytes = file_index + 1, 0
            file_name = f"blocks-{file_index:05d}.safetensors"
            dtypes = {}
            for dtype, dtype_layout in block.layout.by_dtype.items():
                tensor_name = f"{layout.component}/{block.name}/{_dtype_name(dtype)}"
                files.setdefault(file_name, []).append(
                    (tensor_name, _packer(block, dtype, dtype_layout.numel))
                )
                dtypes[_dtype_name(dtype)] = {
                    "tensor": tensor_name,
                    "numel": dtype_layout.numel,
                    "spans": [
                        [s.name, s.offset, s.numel, list(s.shape)] for s in dtype_layout.spans
                    ],
                }
            file_bytes += block.layout.nbytes
            blocks.append({"name": block.name, "file": file_name, "dtypes": dtypes})
        others = {}
        for name, tensor in layout.others.items():
            tensor_name = f"{layout.component}/{name}"
            files.setdefault("others.safetensors", []).append(
                (tensor_name, lambda tensor=tensor: tensor.detach().contiguous().clone())
            )
            others[name] = {"file": "others.safetensors", "tensor": tensor_name}
        manifest_components[layout.component] = {"blocks": blocks, "others": others}

    recorded = {}
    total = sum(block.layout.nbytes for layout in layouts for block in layout.blocks)
    with tqdm(
        total=total, desc="runtime cache: writing", unit="B", unit_scale=True, disable=total < 2**30
    ) as progress:
        for file_name, tensors in files.items():
            path = directory / file_name
            save_file({name: make() for name, make in tensors}, str(path))
            _fsync(path)
            status = path.stat()
            recorded[file_name] = {
                "bytes": status.st_size,
                "mtime_ns": status.st_mtime_ns,
                "sha256": file_sha256(path),
            }
            progress.update(path.stat().st_size)
    manifest = {
        "format_version": FORMAT_VERSION,
        "key": identity.key,
        "identity": identity.as_json(),
        "content_digest": identity.content_digest,
        "components": manifest_components,
        "files": recorded,
        "writer": f"dlo-worker {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _fsync(path)


def read_manifest(directory: Path, key: str) -> dict:
    """The manifest, checked against ``key`` and each file's size and modification time
    (cheap: every start; a file rewritten after publishing is caught here, bit rot only by
    :func:`verify_files`)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise EntryError(f"{directory}: unreadable manifest ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise EntryError(f"{directory}: not a format {FORMAT_VERSION} manifest")
    if manifest.get("key") != key:
        raise EntryError(f"{directory}: the manifest is for key {manifest.get('key')}, not {key}")
    for file_name, recorded in manifest.get("files", {}).items():
        try:
            status = (directory / file_name).stat()
        except OSError as error:
            raise EntryError(f"{directory / file_name}: missing ({error})") from error
        if status.st_size != recorded.get("bytes"):
            raise EntryError(
                f"{directory / file_name}: {status.st_size} bytes on disk, "
                f"{recorded.get('bytes')} recorded"
            )
        if status.st_mtime_ns != recorded.get("mtime_ns"):
            raise EntryError(f"{directory / file_name}: modified after it was published")
    return manifest


def verify_files(directory: Path, manifest: dict) -> list[str]:
    """Files whose SHA-256 differs from the manifest's. Reads every byte, one thread per
    file (hashlib releases the GIL), so a large entry verifies at several GB/s."""
    names = list(manifest["files"])
    workers = max(1, min(len(names), os.cpu_count() or 1, 16))
    with ThreadPoolExecutor(workers, thread_name_prefix="dlo-verify") as pool:
        digests = pool.map(lambda name: file_sha256(directory / name), names)
        return [
            name
            for name, digest in zip(names, digests, strict=True)
            if digest != manifest["files"][name]["sha256"]
        ]


class RuntimeCacheEntry:
    """A published entry, mapped read-only; a ``HostWeightSource`` for the DLO backend."""

    backing = "runtime-cache"
    registrable = True
    """An entry holds the final tensors in the slots' layout: safe to register."""

    def __init__(self, directory: Path, manifest: dict, on_close: Callable[[], None]) -> None:
        self.directory = directory
        self.manifest = manifest
        self._on_close = on_close
        self._views: dict[str, dict[str, torch.Tensor]] | None = {}
        handles = {
            name: safe_open(str(directory / name), framework="pt") for name in manifest["files"]
        }
        for component, stored in manifest["components"].items():
            views = self._views.setdefault(component, {})
            for block in stored["blocks"]:
                handle = handles[block["file"]]
                for record in block["dtypes"].values():
                    flat = handle.get_tensor(record["tensor"])
                    for param_name, offset, numel, shape in record["spans"]:
                        views[f"{block['name']}.{param_name}"] = flat[offset : offset + numel].view(
                            shape
                        )
            for name, record in stored["others"].items():
                views[name] = handles[record["file"]].get_tensor(record["tensor"])

    @property
    def components(self) -> Mapping[str, object]:
        return self.manifest["components"]

    @property
    def closed(self) -> bool:
        return self._views is None

    def tensor(self, component: str, name: str) -> torch.Tensor:
        """The mapped view of ``component``'s tensor ``name``; never write to it."""
        if self._views is None:
            raise HostWeightPlanError("the runtime-cache entry is closed")
        try:
            return self._views[component][name]
        except KeyError:
            raise HostWeightPlanError(
                f"the runtime-cache entry holds no tensor {component}.{name}"
            ) from None

    def matches(self, components: list[tuple[str, nn.Module]]) -> str | None:
        """The first tensor whose mapped bytes differ from ``components``' own (None if all
        equal): a join compares every byte it will stream with what this process loaded."""
        for component, dit in components:
            for name, tensor in dit.state_dict(keep_vars=True).items():
                try:
                    mapped = self.tensor(component, name)
                except HostWeightPlanError:
                    return f"{component}.{name} (missing)"
                if mapped.shape != tensor.shape or mapped.dtype != tensor.dtype:
                    return f"{component}.{name} (shape or dtype)"
                if not torch.equal(mapped, tensor.detach()):
                    return f"{component}.{name}"
        return None

    def close(self) -> None:
        """Drop the views (views handed out keep their pages) and the reader's lock."""
        if self._views is not None:
            self._views = None
            self._on_close()


def file_sha256(path: Path, chunk: int = 16 * 2**20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _packer(block: PackedBlock, dtype: torch.dtype, numel: int) -> Callable[[], torch.Tensor]:
    def pack() -> torch.Tensor:
        flat = torch.zeros(numel, dtype=dtype)
        spans = {span.name: span for span in block.layout.by_dtype[dtype].spans}
        for name, parameter in block.parameters:
            if parameter.dtype == dtype:
                span = spans[name]
                flat[span.offset : span.offset + span.numel].copy_(parameter.detach().reshape(-1))
        return flat

    return pack


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_directory(path: Path) -> None:
    _fsync(path)


__all__ = [
    "ComponentLayout",
    "EntryError",
    "RuntimeCacheEntry",
    "component_layout",
    "content_digest",
    "entry_nbytes",
    "read_manifest",
    "verify_files",
    "write_entry",
]
