"""The embedded demo models: small pipelines with seeded random weights, built offline.

They exist so the whole product (loading, DLO streaming, serving, the operator's
Pods) can run on a laptop CPU with no download. Two kinds, both real diffusers
classes with small sizes, so every code path that handles the real model handles them:

- ``dit``: class-conditional ``DiTPipeline`` (``DiTTransformer2DModel`` + ``AutoencoderKL``).
- ``flux``: text-to-image ``FluxPipeline`` (``FluxTransformer2DModel`` with double- and
  single-stream blocks, CLIP and T5 text encoders, and their tokenizers), which is what
  users deploy. The tokenizers are built here from a byte-level (CLIP) and a character
  (T5) vocabulary, so no tokenizer file is downloaded.

The same kind and seed always write the same bytes.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import string
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DiffusionPipeline,
    DiTPipeline,
    DiTTransformer2DModel,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from safetensors.torch import load_file

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


class DemoKind(enum.StrEnum):
    DIT = "dit"
    FLUX = "flux"


class DemoSize(enum.StrEnum):
    TINY = "tiny"
    """Seconds on a laptop CPU."""
    FULL = "full"
    """The real model's sizes (``flux``: :data:`FLUX_DEV_SHAPE`), built on a GPU where
    there is one, in bfloat16, sharded like the published checkpoints."""


FULL_SHARD_SIZE = "5GB"
"""Shards of a full-size directory: the DiT in five files, T5 in two, each with its index,
as the published FLUX.1-dev checkpoint is split."""


class DemoSizeError(ValueError, UserFixableError):
    """A demo kind has no such size."""


class DemoWeights(enum.StrEnum):
    RANDOM = "random"
    """Drawn from the seed: what the bitwise tests use (any seed, shape or size)."""
    TRAINED = "trained"
    """The tiny demos trained to draw :mod:`dlo_worker.pipeline.drawings`' pictures (the
    default shapes, seed 0): the DiT one per class label, the Flux one per description."""


class DemoWeightsError(ValueError, UserFixableError):
    """Trained weights asked for a demo they were not trained for."""


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's global generator for module construction, then restore it."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        yield
    finally:
        torch.random.set_rng_state(generator_state)


TRAINED_WEIGHTS = Path(__file__).parent / "demo_weights"
"""The trained demos' weights (``scripts/train_demo_weights.py``), float16: ``decoder`` (the
VAE decoder both demos share), ``dit`` (the DiT's transformer) and ``flux`` (the tiny Flux's
transformer and CLIP text encoder; its T5 stays the seed-0 random one)."""
LATENT_CELL = 4
"""Pixels per latent cell along each side in the demos' VAEs (three levels)."""


def latent_of(pictures: torch.Tensor) -> torch.Tensor:
    """The trained DiT demo's latent of ``pictures`` (N, 3, H, W in [0, 1]): each 4x4 cell's
    mean colour scaled to [-1, 1], and a fourth channel of zeros (fixed, not learnt; see
    ``scripts/train_demo_weights.py``)."""
    means = torch.nn.functional.avg_pool2d(pictures * 2 - 1, LATENT_CELL)
    return torch.cat([means, torch.zeros_like(means[:, :1])], dim=1)


def _demo_vae(
    latent_channels: int,
    block_out_channels: tuple[int, ...],
    layers_per_block: int = 1,
    **options: object,
) -> AutoencoderKL:
    """An AutoencoderKL with ``layers_per_block`` layers per level (the demos: one)."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * len(block_out_channels),
        up_block_types=("UpDecoderBlock2D",) * len(block_out_channels),
        block_out_channels=block_out_channels,
        layers_per_block=layers_per_block,
        norm_num_groups=32,
        **options,
    )


def build_demo_pipeline(seed: int = 0, shape: DemoModelShape | None = None) -> DiTPipeline:
    """Construct the class-conditional demo pipeline in memory, deterministically from
    ``seed``."""
    shape = shape or DemoModelShape()
    with _seeded(seed):
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
        vae = _demo_vae(
            shape.latent_channels,
            shape.vae_block_out_channels,
            sample_size=shape.latent_size * 2 ** (len(shape.vae_block_out_channels) - 1),
        )
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    return DiTPipeline(transformer=transformer.eval(), vae=vae.eval(), scheduler=scheduler)


@dataclass(frozen=True)
class DemoFluxShape:
    """Sizes of the text-to-image pipeline; the defaults are the demo (256x256 images in
    about a second on a CPU), :data:`FLUX_DEV_SHAPE` is FLUX.1-dev's.

    The layout is Flux's: double-stream blocks, then single-stream blocks (DLO streams
    both lists), CLIP and T5 text encoders, a VAE (8-pixel size multiple) and guidance
    embedding as in FLUX.1-dev, so ``guidance_scale`` takes effect.
    """

    num_double_blocks: int = 2
    num_single_blocks: int = 4
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    clip_vocab_size: int | None = None
    """Rows of CLIP's token embedding (``None``: the local tokenizer's vocabulary)."""
    clip_hidden_size: int = 32
    clip_intermediate_size: int = 64
    clip_layers: int = 2
    clip_heads: int = 4
    t5_vocab_size: int | None = None
    """Rows of T5's token embedding (``None``: the local tokenizer's vocabulary)."""
    t5_hidden_size: int = 32
    t5_ff_size: int = 64
    t5_head_dim: int = 8
    t5_layers: int = 2
    t5_heads: int = 4
    t5_relative_buckets: int = 8
    t5_feed_forward: str = "relu"
    latent_channels: int = 4
    vae_block_out_channels: tuple[int, ...] = (32, 64, 64)
    vae_layers_per_block: int = 1
    vae_shift_factor: float = 0.0609
    vae_scaling_factor: float = 1.5035


FLUX_DEV_SHAPE = DemoFluxShape(
    num_double_blocks=19,
    num_single_blocks=38,
    num_attention_heads=24,
    attention_head_dim=128,
    axes_dims_rope=(16, 56, 56),
    clip_vocab_size=49408,
    clip_hidden_size=768,
    clip_intermediate_size=3072,
    clip_layers=12,
    clip_heads=12,
    t5_vocab_size=32128,
    t5_hidden_size=4096,
    t5_ff_size=10240,
    t5_head_dim=64,
    t5_layers=24,
    t5_heads=64,
    t5_relative_buckets=32,
    t5_feed_forward="gated-gelu",
    latent_channels=16,
    vae_block_out_channels=(128, 256, 512, 512),
    vae_layers_per_block=2,
    vae_shift_factor=0.1159,
    vae_scaling_factor=0.3611,
)
"""FLUX.1-dev's sizes (transformer 11.9 B parameters, CLIP-L, T5-XXL encoder 4.8 B, the
16-channel VAE), as its configs give them: every memory and timing number of the full
model holds for a directory written with it. Its tokenizers are the demo's local ones
(their ids fit the real embeddings' rows): prompts tokenize differently from FLUX.1-dev's,
at the same lengths (77 and 512 tokens)."""


def _byte_level_vocabulary() -> dict[str, int]:
    """CLIP's byte-level alphabet, each symbol alone and as a word end, with no merges:
    every text tokenizes (one token per byte), offline and deterministically."""
    from tokenizers import pre_tokenizers

    vocabulary = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    for suffix in ("", "</w>"):
        for symbol in alphabet:
            vocabulary[symbol + suffix] = len(vocabulary)
    return vocabulary


def _character_vocabulary() -> list[tuple[str, float]]:
    """A unigram vocabulary of single characters for the T5 tokenizer (SentencePiece's
    word-start marker ``\u2581`` included); anything else maps to ``<unk>``."""
    marker = "\u2581"
    vocabulary = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (marker, -2.0)]
    characters = string.ascii_lowercase + string.ascii_uppercase + string.digits
    vocabulary += [(marker + character, -2.5) for character in characters]
    vocabulary += [(character, -3.0) for character in characters + string.punctuation]
    return vocabulary


def build_demo_flux_pipeline(seed: int = 0, shape: DemoFluxShape | None = None) -> FluxPipeline:
    """Construct the text-to-image demo pipeline in memory, deterministically from ``seed``."""
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
        T5TokenizerFast,
    )

    shape = shape or DemoFluxShape()
    clip_vocabulary = _byte_level_vocabulary()
    t5_vocabulary = _character_vocabulary()
    with _seeded(seed):
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=shape.clip_vocab_size or len(clip_vocabulary),
                hidden_size=shape.clip_hidden_size,
                intermediate_size=shape.clip_intermediate_size,
                num_hidden_layers=shape.clip_layers,
                num_attention_heads=shape.clip_heads,
                max_position_embeddings=77,
                projection_dim=shape.clip_hidden_size,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        )
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=shape.t5_vocab_size or len(t5_vocabulary),
                d_model=shape.t5_hidden_size,
                d_ff=shape.t5_ff_size,
                d_kv=shape.t5_head_dim,
                num_layers=shape.t5_layers,
                num_heads=shape.t5_heads,
                relative_attention_num_buckets=shape.t5_relative_buckets,
                feed_forward_proj=shape.t5_feed_forward,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
            )
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * shape.latent_channels,  # 2x2 latent patches, packed
            num_layers=shape.num_double_blocks,
            num_single_layers=shape.num_single_blocks,
            attention_head_dim=shape.attention_head_dim,
            num_attention_heads=shape.num_attention_heads,
            joint_attention_dim=shape.t5_hidden_size,
            pooled_projection_dim=shape.clip_hidden_size,
            guidance_embeds=True,
            axes_dims_rope=shape.axes_dims_rope,
        )
        # Flux's VAE has no quant convs and shifts and scales its latents.
        vae = _demo_vae(
            shape.latent_channels,
            shape.vae_block_out_channels,
            layers_per_block=shape.vae_layers_per_block,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=shape.vae_shift_factor,
            scaling_factor=shape.vae_scaling_factor,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae.eval(),
        text_encoder=clip.eval(),
        tokenizer=CLIPTokenizer(vocab=clip_vocabulary, merges=[], model_max_length=77),
        text_encoder_2=t5.eval(),
        tokenizer_2=T5TokenizerFast(vocab=t5_vocabulary, extra_ids=0, model_max_length=512),
        transformer=transformer.eval(),
    )


DEMO_BUILDERS: dict[DemoKind, Callable[..., DiffusionPipeline]] = {
    DemoKind.DIT: build_demo_pipeline,
    DemoKind.FLUX: build_demo_flux_pipeline,
}


def _make_readable(root: Path) -> None:
    """Give the written tree ordinary permissions (mkdtemp and savers create private modes).

    Worker containers often run as another user than the one who wrote the model.
    """
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def has_trained_weights(
    size: DemoSize,
    seed: int,
    shape: DemoModelShape | DemoFluxShape | None = None,
) -> bool:
    """Whether :data:`TRAINED_WEIGHTS` fit this demo: either tiny demo with its default
    shape and seed 0 (the seed names random weights otherwise)."""
    return size == DemoSize.TINY and shape is None and seed == 0


def write_demo_model(
    target: Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    kind: DemoKind = DemoKind.DIT,
    shape: DemoModelShape | DemoFluxShape | None = None,
    size: DemoSize = DemoSize.TINY,
    max_shard_size: str | None = None,
    weights: DemoWeights = DemoWeights.RANDOM,
) -> Path:
    """Write a demo pipeline of ``kind`` to ``target`` as a diffusers directory
    (safetensors weights, tokenizer files for text-to-image); ``shape`` is the kind's
    shape class (:class:`DemoModelShape` or :class:`DemoFluxShape`), default sizes if None.
    ``size`` full writes the real model's sizes (flux only) in bfloat16, its random weights
    drawn on the GPU where there is one; ``max_shard_size`` (e.g. ``"5GB"``) splits each
    checkpoint into shards with an index, as published checkpoints are. ``weights`` trained
    loads the tiny demo's trained weights (:data:`TRAINED_WEIGHTS`).

    The directory is assembled beside ``target`` and renamed into place, so an
    interrupted run never leaves a half-written model behind.
    """
    if size == DemoSize.FULL:
        if kind != DemoKind.FLUX:
            raise DemoSizeError(
                f"--size full exists for --kind flux (FLUX.1-dev's sizes); --kind {kind} is "
                "tiny only"
            )
        shape = shape or FLUX_DEV_SHAPE
        max_shard_size = max_shard_size or FULL_SHARD_SIZE
    if weights == DemoWeights.TRAINED and not has_trained_weights(size, seed, shape):
        raise DemoWeightsError(
            "--weights trained exists for the tiny demos with their default shapes and "
            "seed 0; add --weights random"
        )
    target = target.resolve()
    if target.exists() and not target.is_dir():
        raise DemoModelExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise DemoModelExistsError(
            f"{target} is not empty; pass --overwrite to replace it or choose another directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with _building(size):
        pipeline = DEMO_BUILDERS[kind](seed, shape)
    if weights == DemoWeights.TRAINED:
        _LOAD_TRAINED[kind](pipeline)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        pipeline.save_pretrained(
            str(staging), safe_serialization=True, max_shard_size=max_shard_size
        )
        del pipeline
        _make_readable(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(
        "demo model written",
        extra={
            "fields": {
                "path": str(target),
                "kind": kind.value,
                "size": size.value,
                "seed": seed,
                "weights": weights.value,
                "write_s": round(time.perf_counter() - started, 1),
            }
        },
    )
    return target


def _trained(name: str) -> dict[str, torch.Tensor]:
    """One file of :data:`TRAINED_WEIGHTS`, in float32 as the demos are built."""
    path = TRAINED_WEIGHTS / f"{name}.safetensors"
    return {key: value.float() for key, value in load_file(path).items()}


def _load_trained_decoder(vae: AutoencoderKL) -> None:
    """The trained decoder into a demo VAE. Its latent is fixed (:func:`latent_of`), so the
    VAE decodes it unscaled and unshifted; the encoder stays random (the demos never
    encode)."""
    vae.load_state_dict({**vae.state_dict(), **_trained("decoder")})
    vae.register_to_config(scaling_factor=1.0)
    if vae.config.shift_factor is not None:  # Flux's VAE shifts its latents
        vae.register_to_config(shift_factor=0.0)


def _load_trained_dit(pipeline: DiffusionPipeline) -> None:
    """Put the trained weights into the seed-0 tiny DiT ``pipeline``, whose VAE decodes
    without its post-quant convolution (set to the identity).

    The transformer predicts the clean latent, not the noise: one fixed picture per class
    label is what it learns best. DPM-Solver++ steps from that prediction clipped to the
    latent's range ([-1, 1]), so classifier-free guidance at the default scale cannot push
    colours off the palette; DDIM clips it too, but then steps with the noise of the
    unclipped prediction, and a guided trajectory runs away."""
    dit = cast(DiTPipeline, pipeline)
    _load_trained_decoder(dit.vae)
    with torch.no_grad():
        convolution = dit.vae.post_quant_conv
        convolution.weight.copy_(torch.eye(convolution.in_channels).view_as(convolution.weight))
        convolution.bias.zero_()
    dit.transformer.load_state_dict(_trained("dit"))
    dit.scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000,
        beta_schedule="linear",
        prediction_type="sample",
        thresholding=True,
        sample_max_value=1.0,  # a threshold of at most 1: plain clipping to [-1, 1]
    )


def _load_trained_flux(pipeline: DiffusionPipeline) -> None:
    """Put the trained weights into the seed-0 tiny Flux ``pipeline``: its CLIP text
    encoder, trained to tell the drawings' descriptions apart, and its transformer, trained
    on them for the pipeline's own sampler (flow matching's velocity); T5 stays as the seed
    built it. The VAE decodes the fixed latent unshifted and unscaled."""
    flux = cast(FluxPipeline, pipeline)
    _load_trained_decoder(flux.vae)
    weights = _trained("flux")
    for part in ("transformer", "text_encoder"):
        prefix = f"{part}."
        getattr(flux, part).load_state_dict(
            {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
        )


_LOAD_TRAINED: dict[DemoKind, Callable[[DiffusionPipeline], None]] = {
    DemoKind.DIT: _load_trained_dit,
    DemoKind.FLUX: _load_trained_flux,
}


@contextmanager
def _building(size: DemoSize) -> Iterator[None]:
    """Where and in which dtype modules are constructed: the tiny demos in float32 on the
    CPU (the same bytes everywhere); the full size in bfloat16 on the GPU where there is
    one (drawing 17 B random weights on two CPU cores takes many minutes)."""
    if size == DemoSize.TINY:
        yield
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(dtype)
