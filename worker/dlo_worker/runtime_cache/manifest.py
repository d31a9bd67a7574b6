"""An entry's manifest, parsed strictly and checked against its key (pure: no I/O).

A manifest on disk is untrusted input: bit rot, a half-finished edit or a hostile writer
can change any byte. :func:`parse_manifest` accepts one only if

- its schema holds exactly (strict types, no extra fields, file names that stay inside
  the entry's directory);
- its recorded identity hashes to the key it is filed under (so the identity, its guards
  and its content digest are the ones the key was made from);
- its layout is the one DLO's packing rule gives for the shapes it records (every offset,
  element count and span re-derived with :func:`~dlo_worker.offload.layout.build_block_layout`),
  and every tensor it names is named as the writer names them.

What the manifest cannot prove about itself, the bytes behind it, is proven by the
content digest of the mapped views (:mod:`~dlo_worker.runtime_cache.digest`), or by a
join's comparison with the loaded tensors.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from dlo_worker.offload.layout import build_block_layout
from dlo_worker.runtime_cache.identity import FORMAT_VERSION, identity_key

MANIFEST = "manifest.json"

FileName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")]
"""A plain name inside the entry's directory (no separator, no ``..``, no hidden file)."""
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]

STORED_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class ManifestError(ValueError):
    """The manifest is malformed or does not belong to its key (the message says where)."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StoredDType(_Strict):
    """One dtype of a packed block: its flat tensor and each parameter's span in it."""

    tensor: str
    numel: int = Field(ge=0)
    spans: list[tuple[str, int, int, list[int]]]
    """``[parameter name, offset, element count, shape]`` in packing order."""


class StoredBlock(_Strict):
    name: str
    file: FileName
    dtypes: dict[str, StoredDType]


class StoredTensor(_Strict):
    file: FileName
    tensor: str


class StoredComponent(_Strict):
    blocks: list[StoredBlock]
    others: dict[str, StoredTensor]


class StoredFile(_Strict):
    bytes: int = Field(ge=0)
    mtime_ns: int
    sha256: Digest


class Manifest(_Strict):
    format_version: Literal[4]
    key: str
    identity: dict
    """:meth:`~dlo_worker.runtime_cache.identity.CacheIdentity.as_json` of the entry."""
    components: dict[str, StoredComponent]
    files: dict[FileName, StoredFile]
    writer: str
    created: str

    @property
    def content_digest(self) -> str:
        return self.identity["content_digest"]


def parse_manifest(text: str | bytes, key: str) -> Manifest:
    """The manifest of entry ``key``, checked as the module docstring says."""
    try:
        manifest = Manifest.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "manifest"
        raise ManifestError(
            f"not a format {FORMAT_VERSION} manifest ({error.error_count()} problem(s), first: "
            f"{where}: {first['msg']})"
        ) from None
    if manifest.key != key:
        raise ManifestError(f"the manifest is for key {manifest.key}, not {key}")
    if identity_key(manifest.identity) != key:
        raise ManifestError(
            "its recorded identity does not hash to the key it is filed under: the manifest "
            "was changed after it was written"
        )
    digest = manifest.identity.get("content_digest")
    if not isinstance(digest, str) or len(digest) != 64:
        raise ManifestError("its identity records no content digest")
    if set(manifest.identity.get("components") or {}) != set(manifest.components):
        raise ManifestError("its identity and its layout name different DiT components")
    for component, stored in manifest.components.items():
        _check_component(component, stored, manifest.files)
    return manifest


def _check_component(component: str, stored: StoredComponent, files: dict) -> None:
    names: set[str] = set()
    for block in stored.blocks:
        _check_file(f"{component}.{block.name}", block.file, files)
        for dtype_name, record in block.dtypes.items():
            where = f"{component}.{block.name} ({dtype_name})"
            dtype = STORED_DTYPES.get(dtype_name)
            if dtype is None:
                raise ManifestError(f"{where}: unknown dtype {dtype_name!r}")
            if record.tensor != f"{component}/{block.name}/{dtype_name}":
                raise ManifestError(f"{where}: stored as {record.tensor!r}, not under its name")
            _check_spans(where, dtype, record)
            for param_name, *_ in record.spans:
                names.add(_unique(f"{block.name}.{param_name}", names, component))
    for name, other in stored.others.items():
        _check_file(f"{component}.{name}", other.file, files)
        if other.tensor != f"{component}/{name}":
            raise ManifestError(f"{component}.{name}: stored as {other.tensor!r}")
        names.add(_unique(name, names, component))


def _check_spans(where: str, dtype: torch.dtype, record: StoredDType) -> None:
    """The recorded spans are exactly DLO's packing of the recorded shapes."""
    if not record.spans:
        raise ManifestError(f"{where}: a packed tensor without parameters")
    if any(size < 0 for *_, shape in record.spans for size in shape):
        raise ManifestError(f"{where}: a negative dimension")
    layout = build_block_layout((name, tuple(shape), dtype) for name, _, _, shape in record.spans)
    derived = layout.by_dtype[dtype]
    for (name, offset, numel, _), span in zip(record.spans, derived.spans, strict=True):
        if (offset, numel) != (span.offset, span.numel):
            raise ManifestError(
                f"{where}: {name} is recorded at offset {offset} with {numel} elements; its "
                f"shape packs at offset {span.offset} with {span.numel}"
            )
    if record.numel != derived.numel:
        raise ManifestError(
            f"{where}: {record.numel} elements recorded, the spans pack into {derived.numel}"
        )


def _check_file(where: str, file_name: str, files: dict) -> None:
    if file_name not in files:
        raise ManifestError(f"{where}: stored in {file_name}, which the manifest does not list")


def _unique(name: str, seen: set[str], component: str) -> str:
    if name in seen:
        raise ManifestError(f"{component}.{name} is stored twice")
    return name
