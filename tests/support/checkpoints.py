"""Checkpoint variants of a pipeline directory, written with the real safetensors library.

Each helper copies the demo pipeline and rewrites its ``transformer`` checkpoint in one
of the layouts the loader must handle: sharded with an index, attention q/k/v fused
into ``to_qkv`` (the adapter's layout), or mixed with a tensor that is not the DiT's.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dlo_worker.loader.checkpoint import INDEX_NAME, WEIGHTS_NAME

QKV = re.compile(r"^(?P<attention>.+)\.to_q\.(?P<kind>weight|bias)$")


def copy_pipeline(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def transformer_state(pipeline_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(pipeline_dir / "transformer" / WEIGHTS_NAME)


def write_single(pipeline_dir: Path, state: dict[str, torch.Tensor]) -> None:
    save_file(state, pipeline_dir / "transformer" / WEIGHTS_NAME, metadata={"format": "pt"})


def shard(pipeline_dir: Path, shards: int = 4) -> Path:
    """Split the transformer checkpoint into ``shards`` files named by an index."""
    directory = pipeline_dir / "transformer"
    state = transformer_state(pipeline_dir)
    (directory / WEIGHTS_NAME).unlink()
    keys = sorted(state)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        name = f"diffusion_pytorch_model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: state[key] for key in keys[index::shards]}
        save_file(part, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (directory / INDEX_NAME).write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )
    return pipeline_dir


def fuse_qkv(pipeline_dir: Path) -> Path:
    """Store every attention's q, k, v projections as one ``to_qkv`` tensor (rows q|k|v)."""
    state = transformer_state(pipeline_dir)
    for key in [key for key in state if QKV.match(key)]:
        match = QKV.match(key)
        attention, kind = match["attention"], match["kind"]
        parts = [state.pop(f"{attention}.to_{part}.{kind}") for part in "qkv"]
        state[f"{attention}.to_qkv.{kind}"] = torch.cat(parts, dim=0).contiguous()
    write_single(pipeline_dir, state)
    return pipeline_dir


def add_foreign_tensor(pipeline_dir: Path) -> Path:
    """A checkpoint that also holds a tensor of another component (a mixed source)."""
    state = transformer_state(pipeline_dir)
    state["text_encoder.embeddings.weight"] = torch.zeros(4, 4)
    write_single(pipeline_dir, state)
    return pipeline_dir
