"""MappedCheckpoint: the one-way contract from the loader to the DLO backend.

The loader builds one only after preflight proved it; the backend consumes the
exact object (it never rescans files or repeats the decision). It holds the
backing kind, one binding per DiT tensor (checkpoint key plus bounded transform),
the source coverage, and the open read-only mappings. Views it hands out alias the
page cache, so processes mapping the same files share one physical copy.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dlo_worker.config import HostBacking
from dlo_worker.loader.preflight import Binding
from dlo_worker.offload.host_weights import HostWeightsError

__all__ = ["CheckpointMappings", "ComponentBindings", "HostWeightsError", "MappedCheckpoint"]

logger = logging.getLogger(__name__)


class CheckpointMappings:
    """Open safetensors mappings, one per file, handing out zero-copy views of bindings."""

    def __init__(self) -> None:
        self._handles: dict[Path, Any] | None = {}

    @property
    def closed(self) -> bool:
        return self._handles is None

    def view(self, binding: Binding) -> torch.Tensor:
        """The binding's tensor with its row range applied, aliasing the mapped file."""
        if self._handles is None:
            raise HostWeightsError("the checkpoint mappings are closed")
        file = binding.tensor.file
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(file), framework="pt")
        view = handle.get_tensor(binding.source.key)
        rows = binding.source.rows
        return view if rows is None else view[rows.start : rows.stop]

    def close(self) -> None:
        """Drop the handles; views already handed out keep their pages alive. Idempotent."""
        self._handles = None


@dataclass(frozen=True)
class ComponentBindings:
    """The bindings of one DiT component (``transformer``, ``transformer_2``)."""

    component: str
    bindings: dict[str, Binding]
    adapters: tuple[str, ...]


@dataclass(frozen=True)
class SourceCoverage:
    """Which files back the mapping and how much of them it uses."""

    files: tuple[Path, ...]
    tensors: int
    nbytes: int


class MappedCheckpoint:
    """Checkpoint-backed DiT weights; see the module docstring. The consumer closes it."""

    def __init__(self, backing: HostBacking, components: dict[str, ComponentBindings]) -> None:
        self.backing = backing
        self.components = components
        bindings = [b for bound in components.values() for b in bound.bindings.values()]
        self.coverage = SourceCoverage(
            files=tuple(sorted({b.tensor.file for b in bindings})),
            tensors=len(bindings),
            nbytes=sum(math.prod(b.spec.shape) * b.spec.dtype.itemsize for b in bindings),
        )
        self._mappings = CheckpointMappings()

    @property
    def closed(self) -> bool:
        return self._mappings.closed

    def binds(self, component: str, name: str) -> bool:
        bound = self.components.get(component)
        return bound is not None and name in bound.bindings

    @property
    def registrable(self) -> bool:
        """Only a mapping without adapters maps the final tensors byte for byte."""
        return not any(bound.adapters for bound in self.components.values())

    def tensor(self, component: str, name: str) -> torch.Tensor:
        """The immutable view of runtime tensor ``name`` (its transform applied; no copy).

        Never write to it: the storage is the mapped checkpoint file.
        """
        if not self.binds(component, name):
            raise HostWeightsError(f"the mapped checkpoint binds no tensor {component}.{name}")
        return self._mappings.view(self.components[component].bindings[name])

    def close(self) -> None:
        """Release the mappings (views already handed out keep their pages alive). Idempotent."""
        if not self._mappings.closed:
            self._mappings.close()
            logger.info("checkpoint mapping closed", extra={"fields": {"backing": self.backing}})
