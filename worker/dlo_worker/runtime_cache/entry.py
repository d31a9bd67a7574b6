"""One runtime-cache entry on disk: packed safetensors files plus a JSON manifest.

Every streamed block is stored, per dtype, as one flat tensor in exactly the layout of
DLO's device slot (:func:`dlo_worker.offload.layout.layout_of`: the block's parameters
in order, each at a 256-byte aligned offset), so streaming a block from the entry is one
copy per dtype. Every other tensor of the DiT's state dict (embedders, norms, buffers) is
stored as an ordinary named tensor. The files are standard safetensors: any reader opens
them. The manifest records the identity, the content digest, the layout, the SHA-256 and
size of every file, the writer and the creation time.

Writing happens in a directory the caller publishes atomically (see ``store``); reading
checks the manifest (:mod:`~dlo_worker.runtime_cache.manifest`) and each file's kind, size
and modification time, maps the files and hands out zero-copy views through the
``HostWeights`` protocol. :meth:`RuntimeCacheEntry.content_problem` re-derives the
content digest from those views.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from dlo_worker import __version__
from dlo_worker.offload.host_weights import HostWeightsError
from dlo_worker.offload.layout import BlockLayout, layout_of, streamed_parameters
from dlo_worker.offload.plan import discover
from dlo_worker.runtime_cache.digest import content_digest, file_sha256, files_sha256
from dlo_worker.runtime_cache.identity import FORMAT_VERSION, CacheIdentity
from dlo_worker.runtime_cache.manifest import (
    MANIFEST,
    STORED_DTYPES,
    Manifest,
    ManifestError,
    StoredBlock,
    StoredComponent,
    StoredDType,
    StoredFile,
    StoredTensor,
    parse_manifest,
)

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


def entry_nbytes(layouts: list[ComponentLayout]) -> int:
    """Bytes the entry's tensors take on disk (headers aside)."""
    packed = sum(block.layout.nbytes for layout in layouts for block in layout.blocks)
    others = sum(t.nbytes for layout in layouts for t in layout.others.values())
    return packed + others


def write_entry(directory: Path, identity: CacheIdentity, layouts: list[ComponentLayout]) -> None:
    """Write the files and the manifest into ``directory`` and fsync them (not the
    directory's parent: publishing is the store's). A failed write raises ``OSError``
    with its errno (``ENOSPC`` for a full disk), also where safetensors wrote."""
    files: dict[str, list[tuple[str, Callable[[], torch.Tensor]]]] = {}
    stored_components: dict[str, StoredComponent] = {}
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
                dtypes[_dtype_name(dtype)] = StoredDType(
                    tensor=tensor_name,
                    numel=dtype_layout.numel,
                    spans=[(s.name, s.offset, s.numel, list(s.shape)) for s in dtype_layout.spans],
                )
            file_bytes += block.layout.nbytes
            blocks.append(StoredBlock(name=block.name, file=file_name, dtypes=dtypes))
        others = {}
        for name, tensor in layout.others.items():
            tensor_name = f"{layout.component}/{name}"
            files.setdefault("others.safetensors", []).append(
                (tensor_name, partial(_contiguous_copy, tensor))
            )
            others[name] = StoredTensor(file="others.safetensors", tensor=tensor_name)
        stored_components[layout.component] = StoredComponent(blocks=blocks, others=others)

    recorded = {}
    total = sum(block.layout.nbytes for layout in layouts for block in layout.blocks)
    with tqdm(
        total=total, desc="runtime cache: writing", unit="B", unit_scale=True, disable=total < 2**30
    ) as progress:
        for file_name, tensors in files.items():
            path = directory / file_name
            _save({name: make() for name, make in tensors}, path)
            _fsync(path)
            status = path.stat()
            recorded[file_name] = StoredFile(
                bytes=status.st_size, mtime_ns=status.st_mtime_ns, sha256=file_sha256(path)
            )
            progress.update(status.st_size)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        key=identity.key,
        identity=identity.as_json(),
        components=stored_components,
        files=recorded,
        writer=f"dlo-worker {__version__}",
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    path = directory / MANIFEST
    path.write_text(manifest.model_dump_json(indent=1) + "\n")
    _fsync(path)


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _contiguous_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().clone()


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file``, its I/O failures as the ``OSError`` they are: safetensors reports a
    full disk as ``SafetensorError: ... No space left on device (os error 28)``."""
    try:
        save_file(tensors, str(path))
    except SafetensorError as error:
        found = _OS_ERROR.search(str(error))
        code = int(found[1]) if found else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (safetensors: {error})", str(path)) from error


def read_manifest(directory: Path, key: str) -> Manifest:
    """The manifest of entry ``key`` (:func:`~dlo_worker.runtime_cache.manifest.parse_manifest`),
    and each file it lists a regular file of the recorded size and modification time
    (cheap, every start: catches truncation, a file rewritten after publishing or a link;
    bit rot only the content digest or :func:`file_problems` does). Raises EntryError."""
    try:
        text = _read_regular(directory / MANIFEST)
        manifest = parse_manifest(text, key)
    except (OSError, UnicodeDecodeError) as error:
        raise EntryError(f"{directory / MANIFEST}: unreadable manifest ({error})") from error
    except ManifestError as error:
        raise EntryError(f"{directory / MANIFEST}: {error}") from error
    for file_name, recorded in manifest.files.items():
        path = directory / file_name
        try:
            status = path.lstat()
        except OSError as error:
            raise EntryError(f"{path}: missing ({error})") from error
        if stat.S_ISLNK(status.st_mode):
            raise EntryError(f"{path}: is a symbolic link (an entry holds regular files only)")
        if not stat.S_ISREG(status.st_mode):
            raise EntryError(f"{path}: not a regular file")
        if status.st_size != recorded.bytes:
            raise EntryError(f"{path}: {status.st_size} bytes on disk, {recorded.bytes} recorded")
        if status.st_mtime_ns != recorded.mtime_ns:
            raise EntryError(f"{path}: modified after it was published")
    return manifest


def file_problems(directory: Path, manifest: Manifest) -> list[str]:
    """Files whose SHA-256 differs from the manifest's, each as a message naming it."""
    names = list(manifest.files)
    digests = files_sha256([directory / name for name in names])
    return [
        f"{directory / name}: its SHA-256 differs from the manifest's"
        for name, digest in zip(names, digests, strict=True)
        if digest != manifest.files[name].sha256
    ]


class RuntimeCacheEntry:
    """A published entry, mapped read-only; a ``HostWeights`` for the DLO backend."""

    backing = "runtime-cache"
    registrable = True
    """An entry holds the final tensors in the slots' layout: safe to register."""

    def __init__(self, directory: Path, manifest: Manifest, on_close: Callable[[], None]) -> None:
        """Map the files; raises EntryError when a stored tensor is not what the manifest
        says (its dtype or element count)."""
        self.directory = directory
        self.manifest = manifest
        self._on_close = on_close
        self._views: dict[str, dict[str, torch.Tensor]] | None = {}
        handles = {
            name: safe_open(str(directory / name), framework="pt") for name in manifest.files
        }
        for component, stored in manifest.components.items():
            views = self._views.setdefault(component, {})
            for block in stored.blocks:
                handle = handles[block.file]
                for dtype_name, record in block.dtypes.items():
                    flat = _stored(handle, record.tensor, block.file)
                    if flat.dtype != STORED_DTYPES[dtype_name] or flat.shape != (record.numel,):
                        raise EntryError(
                            f"{directory / block.file}: {record.tensor} is {flat.dtype} "
                            f"{list(flat.shape)}, the manifest records {dtype_name} "
                            f"[{record.numel}]"
                        )
                    for param_name, offset, numel, shape in record.spans:
                        views[f"{block.name}.{param_name}"] = flat[offset : offset + numel].view(
                            shape
                        )
            for name, other in stored.others.items():
                views[name] = _stored(handles[other.file], other.tensor, other.file)

    @property
    def components(self) -> Mapping[str, object]:
        return self.manifest.components

    @property
    def closed(self) -> bool:
        return self._views is None

    def tensor(self, component: str, name: str) -> torch.Tensor:
        """The mapped view of ``component``'s tensor ``name``; never write to it."""
        if self._views is None:
            raise HostWeightsError("the runtime-cache entry is closed")
        try:
            return self._views[component][name]
        except KeyError:
            raise HostWeightsError(
                f"the runtime-cache entry holds no tensor {component}.{name}"
            ) from None

    def names(self, component: str) -> set[str]:
        """The state-dict names the entry holds for ``component``."""
        return set(self._views.get(component, {})) if self._views is not None else set()

    @property
    def mapped_bytes(self) -> int:
        """Bytes of every tensor the entry maps (what :meth:`content_problem` reads)."""
        views = self._views or {}
        return sum(view.nbytes for named in views.values() for view in named.values())

    def content_problem(self, progress: Callable[[int], None] | None = None) -> str | None:
        """Why the mapped views are not the tensors the key stands for (None if they are):
        their content digest, re-derived from the bytes the views show, against the one the
        identity (and so the key) records. Reads every mapped byte once."""
        if self._views is None:
            raise HostWeightsError("the runtime-cache entry is closed")
        named_views = [
            (f"{component}/{name}", view)
            for component, named in self._views.items()
            for name, view in named.items()
        ]
        if content_digest(named_views, progress) == self.manifest.content_digest:
            return None
        return (
            f"{self.directory}: the tensors its manifest describes do not have the content "
            "digest its key was made from"
        )

    def matches(self, components: list[tuple[str, nn.Module]]) -> str | None:
        """The first tensor whose mapped bytes differ from ``components``' own (None if all
        equal): a join compares every byte it will stream with what this process loaded."""
        for component, dit in components:
            state = dit.state_dict(keep_vars=True)
            extra = sorted(self.names(component) - set(state))
            if extra:
                return f"{component}.{extra[0]} (not a tensor of the loaded model)"
            for name, tensor in state.items():
                try:
                    mapped = self.tensor(component, name)
                except HostWeightsError:
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


def _stored(handle: object, tensor: str, file_name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(tensor)  # type: ignore[attr-defined]
    except SafetensorError as error:
        raise EntryError(f"{file_name} holds no readable tensor {tensor} ({error})") from error


def _read_regular(path: Path) -> str:
    """A regular file's text, never through a symbolic link (``ELOOP`` otherwise)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as handle:
        return handle.read().decode()


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
    "entry_nbytes",
    "file_problems",
    "read_manifest",
    "write_entry",
]
