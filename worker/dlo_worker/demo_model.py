"""The embedded demo model: a small class-conditional DiT pipeline with seeded random weights.

It exists so the whole product (loading, DLO streaming, serving, the operator's
Pods) can run on a laptop CPU with no download. The structure is real diffusers
classes (``DiTPipeline`` = ``DiTTransformer2DModel`` + ``AutoencoderKL`` + a
scheduler), so every code path that handles a real DiT handles this one; only the
sizes are small. The same seed always writes the same bytes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

from dlo_worker.errors import UserFixableError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoModelShape:
    """Sizes of the demo pipeline; defaults give a 128x128 image in seconds on a CPU."""

    num_layers: int = 8
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    latent_size: int = 32
    latent_channels: int = 4
    patch_size: int = 2
    num_classes: int = 1000
    vae_block_out_channels: tuple[int, ...] = (32, 64, 64)


class DemoModelExistsError(FileExistsError, UserFixableError):
    """The target directory already holds files and overwriting was not asked for."""


def build_demo_pipeline(seed: int = 0, shape: DemoModelShape | None = None) -> DiTPipeline:
    """Construct the demo pipeline in memory, deterministically from ``seed``."""
    shape = shape or DemoModelShape()
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        transformer = DiTTransformer2DModel(
            num_attention_heads=shape.num_attention_heads,
            attention_head_dim=shape.attention_head_dim,
            in_channels=shape.latent_channels,
            out_channels=shape.latent_channels,
            num_layers=shape.num_layers,
            sample_size=shape.latent_size,
            patch_size=shape.patch_size,
            num_embeds_ada_norm=shape.num_classes,
            norm_num_groups=32,
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=shape.latent_channels,
            down_block_types=("DownEncoderBlock2D",) * len(shape.vae_block_out_channels),
            up_block_types=("UpDecoderBlock2D",) * len(shape.vae_block_out_channels),
            block_out_channels=shape.vae_block_out_channels,
            layers_per_block=1,
            norm_num_groups=32,
            sample_size=shape.latent_size * 2 ** (len(shape.vae_block_out_channels) - 1),
        )
    finally:
        torch.random.set_rng_state(generator_state)
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    return DiTPipeline(transformer=transformer.eval(), vae=vae.eval(), scheduler=scheduler)


def _make_readable(root: Path) -> None:
    """Give the written tree ordinary permissions (mkdtemp and savers create private modes).

    Worker containers often run as another user than the one who wrote the model.
    """
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def write_demo_model(
    target: Path, *, seed: int = 0, overwrite: bool = False, shape: DemoModelShape | None = None
) -> Path:
    """Write the demo pipeline to ``target`` as a diffusers directory (safetensors weights).

    The directory is assembled beside ``target`` and renamed into place, so an
    interrupted run never leaves a half-written model behind.
    """
    target = target.resolve()
    if target.exists() and not target.is_dir():
        raise DemoModelExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise DemoModelExistsError(
            f"{target} is not empty; pass --overwrite to replace it or choose another directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    pipeline = build_demo_pipeline(seed, shape)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        pipeline.save_pretrained(str(staging), safe_serialization=True)
        _make_readable(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("demo model written", extra={"fields": {"path": str(target), "seed": seed}})
    return target
