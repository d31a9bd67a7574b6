"""Runtime-cache identity: which differences make another entry (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from dlo_worker.runtime_cache.identity import (
    FORMAT_VERSION,
    CacheIdentity,
    IdentityGuards,
    canonical_config,
)

GUARDS = IdentityGuards(
    dit_class="FluxTransformer2DModel",
    dit_config=canonical_config({"num_layers": 19, "_diffusers_version": "0.42.1"}),
    dtype="bfloat16",
    adapters=(),
    block_paths=("transformer_blocks", "single_transformer_blocks"),
)


def key(guards: IdentityGuards = GUARDS, digest: str = "d" * 64) -> str:
    return CacheIdentity((("transformer", guards),), digest).key


def test_the_key_is_stable_and_names_a_directory() -> None:
    assert key() == key()
    assert len(key()) == 40
    assert key().isalnum()


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "float32"},
        {"tensor_parallel_size": 2},
        {"tensor_parallel_rank": 1},
        {"sequence_parallel_size": 2},
        {"dit_config": canonical_config({"num_layers": 18})},
        {"dit_class": "ChromaTransformer2DModel"},
        {"adapters": ("fused-qkv",)},
        {"edits": ("sha256:" + "a" * 64 + "*1.0",)},
        {"block_paths": ("transformer_blocks",)},
        {"format_version": FORMAT_VERSION + 1},
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_guard_that_changes_makes_another_entry(change: dict) -> None:
    assert key(dataclasses.replace(GUARDS, **change)) != key()


def test_other_content_makes_another_entry() -> None:
    assert key(digest="e" * 64) != key()


def test_data_parallel_and_sequence_parallel_ranks_are_not_part_of_the_identity() -> None:
    """Replicas (any DP size and rank) and equivalent SP ranks share one entry: the
    identity has no field for them, so no caller can split an entry by them."""
    fields = {field.name for field in dataclasses.fields(IdentityGuards)}
    assert not {"data_parallel_size", "data_parallel_rank", "sequence_parallel_rank"} & fields


def test_keys_diffusers_adds_when_saving_do_not_change_the_config() -> None:
    assert canonical_config({"a": 1, "_diffusers_version": "0.41.0"}) == canonical_config(
        {"a": 1, "_diffusers_version": "0.42.1", "_name_or_path": "/models/flux"}
    )
