"""Checkpoint adapters: loader-owned knowledge of checkpoint layouts that differ from runtime.

An adapter maps a runtime tensor name to the checkpoint key that holds it and a
*bounded transform*: a contiguous range of leading-dimension rows of that key. Rows of
a contiguous tensor are contiguous, so the transform is a zero-copy view of the mapped
file, and both the ordinary loader and the streaming path apply the same one.

Only layouts an adapter declares are accepted; anything else keeps the plain rule
"runtime name == checkpoint key" or fails preflight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch

from dlo_worker.loader.checkpoint import CheckpointIndex


@dataclass(frozen=True)
class TensorSpec:
    """What the runtime model expects for one parameter or persistent buffer."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of the leading dimension of a checkpoint tensor."""

    start: int
    stop: int


@dataclass(frozen=True)
class Source:
    """Where a runtime tensor comes from: a checkpoint key, optionally a row range of it."""

    key: str
    rows: RowRange | None = None
    adapter: str | None = None


class CheckpointAdapter(Protocol):
    """Resolves runtime names the plain rule cannot; see the module docstring."""

    name: str

    def resolve(
        self, name: str, runtime: dict[str, TensorSpec], checkpoint: CheckpointIndex
    ) -> Source | None:
        """The source of runtime tensor ``name``, or None when this adapter does not apply."""


class FusedQKVAdapter:
    """Attention projections stored fused as ``<attn>.to_qkv`` (rows: q, then k, then v).

    Original DiT and Flux checkpoints keep q, k and v as one projection; diffusers'
    attention modules have ``to_q``, ``to_k`` and ``to_v``. Row sizes come from the
    runtime shapes, so grouped-query layouts with smaller k and v split correctly.
    """

    name = "fused-qkv"
    _PATTERN = re.compile(r"^(?P<attention>.+)\.to_(?P<part>[qkv])\.(?P<kind>weight|bias)$")
    _ORDER = ("q", "k", "v")

    def resolve(
        self, name: str, runtime: dict[str, TensorSpec], checkpoint: CheckpointIndex
    ) -> Source | None:
        match = self._PATTERN.match(name)
        if match is None:
            return None
        attention, part, kind = match["attention"], match["part"], match["kind"]
        fused_key = f"{attention}.to_qkv.{kind}"
        fused = checkpoint.tensors.get(fused_key)
        parts = [f"{attention}.to_{other}.{kind}" for other in self._ORDER]
        if fused is None or not all(other in runtime for other in parts):
            return None
        rows = [runtime[other].shape[0] for other in parts]
        trailing = {runtime[other].shape[1:] for other in parts}
        if len(trailing) != 1 or fused.shape != (sum(rows), *trailing.pop()):
            return None
        start = sum(rows[: self._ORDER.index(part)])
        return Source(
            fused_key,
            RowRange(start, start + rows[self._ORDER.index(part)]),
            adapter=self.name,
        )


ADAPTERS: tuple[CheckpointAdapter, ...] = (FusedQKVAdapter(),)
"""Every adapter the loader knows, tried in order after the plain rule."""
