"""The seam between whoever loaded the weights and the backend (a leaf module).

The backend streams blocks whose parameters are ordinary tensors, or, when a loader
proved it safe, reads them from a :class:`HostWeights`: an object that binds every
tensor of some DiT components (``transformer``, ``transformer_2``) to a host view it
hands out, and that is closed once the backend no longer needs it. The loader's
``MappedCheckpoint`` (checkpoint mappings) is one, a node-local runtime-cache entry
another. The backend knows only this protocol, never the loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch


class HostWeightsError(RuntimeError):
    """Host weights were used after they were closed, asked for a tensor they do not
    bind, or could not be consumed (the DiT was never materialized: no fallback)."""


@runtime_checkable
class HostWeights(Protocol):
    """Host views of the tensors of some DiT components, handed to the backend once."""

    @property
    def backing(self) -> str:
        """What holds the weights (``checkpoint-mmap``), for stats and logs."""
        ...

    @property
    def components(self) -> Mapping[str, object]:
        """The DiT components it binds, by pipeline attribute."""
        ...

    @property
    def closed(self) -> bool: ...

    @property
    def registrable(self) -> bool:
        """Whether every view is final bytes of a file mapping (no adapter deferred), so
        registering the mapping for direct device copies is safe."""
        ...

    def tensor(self, component: str, name: str) -> torch.Tensor:
        """A host view of ``component``'s tensor ``name`` (state-dict name)."""
        ...

    def close(self) -> None:
        """Release the views' backing (idempotent)."""
        ...
