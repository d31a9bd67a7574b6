"""Checkpoint variants of a pipeline directory, written with the real safetensors library.

Each helper copies the demo pipeline and rewrites its ``transformer`` checkpoint in one
of the layouts the loader must handle: sharded with an index, attention q/k/v fused
into ``to_qkv`` (the adapter's layout), or mixed with a tensor that is not the DiT's.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dlo_worker.config import WorkerConfig, build_config, load_settings
from dlo_worker.loader.checkpoint import INDEX_NAME, WEIGHTS_NAME
from dlo_worker.loader.diffusers_loader import DiffusersPipelineLoader
from dlo_worker.offload import DistributedLayerwiseOffloadBackend, OffloadConfig, OffloadStats
from dlo_worker.process.worker import Worker
from tests.support.ports import free_port
from tests.support.ranks import spawn_ranks

FORWARDS = 3
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


def worker_config(
    path: Path,
    *,
    dlo: bool,
    allgather: bool = False,
    device: str = "cpu",
    model: dict | None = None,
    parallel: dict | None = None,
    **offload: object,
) -> WorkerConfig:
    """A worker configuration for ``path``: resident, or DLO rank-local / AllGather."""
    if dlo:
        offload |= {"enable_distributed_layerwise_offload": True, "dlo_use_allgather": allgather}
    return build_config(
        {
            "model": {"model": str(path), "device": device, **(model or {})},
            "parallel": parallel or {},
            "offload": offload,
        }
    )


def transformer_outputs(transformer: torch.nn.Module) -> list[torch.Tensor]:
    """Several forwards of the DiT on fixed inputs (class-conditional, CFG-sized batch)."""
    config = transformer.config
    placeholder = next(transformer.parameters())
    device, dtype = placeholder.device, placeholder.dtype
    generator = torch.Generator().manual_seed(7)
    latents = torch.randn(
        2, config.in_channels, config.sample_size, config.sample_size, generator=generator
    ).to(device, dtype)
    outputs = []
    with torch.inference_mode():
        for step in range(FORWARDS):
            timestep = torch.tensor([900 - 300 * step] * 2, device=device)
            labels = torch.tensor([207, 1000], device=device)
            sample = transformer(latents, timestep=timestep, class_labels=labels).sample
            outputs.append(sample.cpu())
    return outputs


def to_bfloat16(pipeline_dir: Path) -> Path:
    """Store the transformer checkpoint in bfloat16 (the CUDA runtime dtype)."""
    state = transformer_state(pipeline_dir)
    write_single(pipeline_dir, {key: value.to(torch.bfloat16) for key, value in state.items()})
    return pipeline_dir


def bfloat16_variants(pipeline_dir: Path, root: Path) -> dict[str, Path]:
    """The pipeline in bfloat16 (the CUDA runtime dtype) as single-file, sharded and
    fused-QKV checkpoints under ``root``."""
    single = to_bfloat16(copy_pipeline(pipeline_dir, root / "single"))
    return {
        "single": single,
        "sharded": shard(copy_pipeline(single, root / "sharded")),
        "fused": fuse_qkv(copy_pipeline(single, root / "fused")),
    }


def run_worker(config: WorkerConfig) -> tuple[list[torch.Tensor], Worker]:
    """The transformer's outputs through a real Worker; ``worker.stats`` holds the DLO
    backend's stats taken before shutdown (None without DLO)."""
    with Worker(config) as worker:
        outputs = transformer_outputs(worker.pipeline.transformer)
        worker.stats = worker.backend.stats() if worker.backend else None
    return outputs, worker


def run_staging_ring(
    path: Path, device: torch.device, dtype: torch.dtype, chunk_bytes: int
) -> tuple[list[torch.Tensor], OffloadStats, int]:
    """The transformer's outputs with the loader's checkpoint mapping streamed through the
    native staging ring; the backend's stats, and its smallest block's bytes."""
    config = worker_config(path, dlo=True, device=str(device))
    loader = DiffusersPipelineLoader(load_settings(config), dtype=dtype, device=device)
    pipeline = loader.load()
    backend = DistributedLayerwiseOffloadBackend(
        OffloadConfig(
            use_allgather=False,
            staging="ring",
            staging_ring_chunk_bytes=chunk_bytes,
            pack_threads=3,
        ),
        device,
        loader.take_host_weights(),
    )
    backend.enable(pipeline)
    try:
        outputs = transformer_outputs(pipeline.transformer)
        stats = backend.stats()
        smallest_block = min(layout.nbytes for layout in backend.block_layouts())
    finally:
        backend.disable()
    return outputs, stats, smallest_block


def spawn_against_resident(
    rank_main: Callable[[int, int, int, str, str], None],
    model: Path,
    resident: list[torch.Tensor],
    tmp_path: Path,
    world_size: int = 2,
) -> None:
    """Run ``rank_main(rank, world_size, port, model, expected)`` in ``world_size``
    processes, ``expected`` being the file the resident outputs were saved to."""
    expected = tmp_path / "resident.pt"
    torch.save(resident, expected)
    spawn_ranks(rank_main, (world_size, free_port(), str(model), str(expected)), world_size)
