"""Reading safetensors checkpoints from disk: single files, shard indexes, and corrupt input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dlo_worker.loader.checkpoint import (
    INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    read_checkpoint_index,
)

SHARD_1 = "diffusion_pytorch_model-00001-of-00002.safetensors"
SHARD_2 = "diffusion_pytorch_model-00002-of-00002.safetensors"


def write_sharded(directory: Path, weight_map: dict[str, str] | None = None) -> Path:
    save_file({"a": torch.zeros(4), "b": torch.ones(2, 3)}, directory / SHARD_1)
    save_file({"c": torch.zeros(5, dtype=torch.bfloat16)}, directory / SHARD_2)
    weight_map = weight_map or {"a": SHARD_1, "b": SHARD_1, "c": SHARD_2}
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    return directory


def test_single_file_is_described_from_its_header(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(3, 2, dtype=torch.float16)}, tmp_path / WEIGHTS_NAME)
    index = read_checkpoint_index(tmp_path)
    assert index.files == (tmp_path / WEIGHTS_NAME,)
    (tensor,) = index.tensors.values()
    assert (tensor.key, tensor.dtype, tensor.shape, tensor.nbytes) == (
        "w",
        torch.float16,
        (3, 2),
        12,
    )


def test_sharded_checkpoint_follows_its_index(tmp_path: Path) -> None:
    index = read_checkpoint_index(write_sharded(tmp_path))
    assert [file.name for file in index.files] == [SHARD_1, SHARD_2]
    assert index.tensors["c"].file.name == SHARD_2
    assert index.tensors["c"].dtype == torch.bfloat16
    assert index.nbytes == 4 * 4 + 6 * 4 + 5 * 2


def test_a_directory_without_safetensors_has_no_index(tmp_path: Path) -> None:
    assert read_checkpoint_index(tmp_path) is None


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / WEIGHTS_NAME
    save_file({"w": torch.zeros(64)}, path)
    path.write_bytes(path.read_bytes()[:-32])
    with pytest.raises(CheckpointError, match="truncated or damaged, copy it again") as error:
        read_checkpoint_index(tmp_path)
    assert str(path) in str(error.value)


def test_a_damaged_header_is_named(tmp_path: Path) -> None:
    path = tmp_path / WEIGHTS_NAME
    save_file({"w": torch.zeros(64)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_checkpoint_index(tmp_path)


def test_a_shard_named_in_the_index_must_exist(tmp_path: Path) -> None:
    write_sharded(tmp_path)
    (tmp_path / SHARD_2).unlink()
    with pytest.raises(CheckpointError, match=f"shard {SHARD_2} named in the index is missing"):
        read_checkpoint_index(tmp_path)


def test_a_key_stored_twice_is_refused(tmp_path: Path) -> None:
    write_sharded(tmp_path)
    save_file({"c": torch.zeros(5), "a": torch.zeros(4)}, tmp_path / SHARD_2)
    with pytest.raises(CheckpointError, match="'a' is stored twice"):
        read_checkpoint_index(tmp_path)


def test_the_index_must_match_the_shards(tmp_path: Path) -> None:
    write_sharded(tmp_path, {"a": SHARD_2, "b": SHARD_1, "c": SHARD_2})
    with pytest.raises(CheckpointError, match=r"puts 'a' in .* but it is in"):
        read_checkpoint_index(tmp_path)


def test_keys_missing_from_the_index_are_refused(tmp_path: Path) -> None:
    write_sharded(tmp_path, {"a": SHARD_1, "c": SHARD_2})
    with pytest.raises(CheckpointError, match="missing from the index"):
        read_checkpoint_index(tmp_path)


@pytest.mark.parametrize("text", ["{", '{"weight_map": 3}', '{"weight_map": {"a": "../x"}}'])
def test_an_unreadable_index_is_named(tmp_path: Path, text: str) -> None:
    (tmp_path / INDEX_NAME).write_text(text)
    with pytest.raises(CheckpointError, match=INDEX_NAME):
        read_checkpoint_index(tmp_path)
