"""What makes two processes' DiT weights the same cache entry (pure: no I/O, no torch).

Final tensor content is authoritative: the key hashes a digest of every tensor's name,
dtype, shape and bytes, so a loader or configuration change that changes any byte makes
a different entry instead of sharing silently. The guards add what content alone cannot
tell apart: the tensor-parallel coordinate (different TP ranks hold different shards that
could collide in content), the sequence-parallel world size, the dtype, the DiT class and
its config, the loader's adapters, the edits written into the loaded weights (fused LoRA
adapters), the block lists DLO streams (they decide the packed layout) and the entry
format. Data-parallel size and rank and the sequence-parallel rank
are deliberately absent: replicas and equivalent SP ranks share one entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Final

FORMAT_VERSION: Final = 4
"""Bumped whenever the files, the manifest or a digest change shape: old entries then miss
(3: the content digest hashes each tensor on its own, :mod:`~dlo_worker.runtime_cache.digest`;
4: the identity holds the edits written into the weights, fused LoRA adapters)."""


@dataclass(frozen=True)
class IdentityGuards:
    """Everything but the tensor content that an entry's key depends on."""

    dit_class: str
    dit_config: str
    """The DiT's ``config.json`` as canonical JSON."""
    dtype: str
    adapters: tuple[str, ...]
    block_paths: tuple[str, ...]
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    sequence_parallel_size: int = 1
    edits: tuple[str, ...] = ()
    """Written into the loaded weights before caching: each fused LoRA adapter's file
    digest and scale, in fusing order."""
    format_version: int = FORMAT_VERSION


@dataclass(frozen=True)
class CacheIdentity:
    """The guards of every DiT component of a pipeline plus the content digest."""

    components: tuple[tuple[str, IdentityGuards], ...]
    """``(pipeline attribute, guards)`` in pipeline order."""
    content_digest: str

    def as_json(self) -> dict:
        return {
            "components": {name: asdict(guards) for name, guards in self.components},
            "content_digest": self.content_digest,
        }

    @property
    def key(self) -> str:
        """The entry's directory name: a SHA-256 of the canonical identity."""
        return identity_key(self.as_json())


def identity_key(identity: dict) -> str:
    """The key of an identity in its JSON form (:meth:`CacheIdentity.as_json`), so a
    manifest's recorded identity can be checked against the key it is filed under."""
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:40]


def canonical_config(config: dict) -> str:
    """A DiT config as canonical JSON, without the keys diffusers adds when saving
    (``_diffusers_version``, ``_name_or_path``): they do not change the weights."""
    kept = {key: value for key, value in config.items() if key not in _VOLATILE_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)


_VOLATILE_CONFIG_KEYS = frozenset({"_diffusers_version", "_name_or_path", "_use_default_values"})
