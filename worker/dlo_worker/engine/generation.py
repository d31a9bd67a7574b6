"""Run one request through a loaded pipeline and write the image.

Pipelines differ in how they are conditioned (a class id for DiT, a prompt for
text-to-image models); :func:`pipeline_arguments` maps one request onto the
arguments a pipeline's ``__call__`` accepts.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dlo_worker.config import LoraAdapter
from dlo_worker.engine.images import check_output_path, new_file_mode
from dlo_worker.engine.request import AdapterChange, GenerationRequest, Guidance, RequestLimits
from dlo_worker.engine.stages import timed_stages
from dlo_worker.errors import UserFixableError
from dlo_worker.observability import metrics
from dlo_worker.pipeline import lora

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline
    from PIL import Image


class UnsupportedPipelineError(TypeError, UserFixableError):
    """The pipeline takes neither class labels nor a prompt."""


class NonFiniteOutputError(RuntimeError):
    """The decoded image holds NaN or infinity: written as PNG it would be silently black."""


def pipeline_arguments(pipeline: DiffusionPipeline, request: GenerationRequest) -> dict[str, Any]:
    """The keyword arguments that run ``request`` on ``pipeline``; the request was checked
    with :func:`dlo_worker.engine.request.request_problems`, so every field given is used.

    The noise generator lives on the CPU so a seed gives the same latents on any device.
    """
    accepted = inspect.signature(pipeline.__call__).parameters
    arguments: dict[str, Any] = {
        "num_inference_steps": request.steps,
        "guidance_scale": request.guidance_scale,
        "generator": torch.Generator(device="cpu").manual_seed(request.seed),
        # Floats, checked for NaN and infinity before they become PIL pixels (the same
        # conversion diffusers applies for "pil", so images are byte-identical).
        "output_type": "np",
        "width": request.width,
        "height": request.height,
        "negative_prompt": request.negative_prompt,
        "true_cfg_scale": request.true_cfg_scale,
    }
    if "class_labels" in accepted:
        arguments["class_labels"] = [request.class_label] * request.num_images
    elif "prompt" in accepted:
        arguments["prompt"] = request.prompt
        arguments["num_images_per_prompt"] = request.num_images
    else:
        raise UnsupportedPipelineError(
            f"{type(pipeline).__name__} takes neither class_labels nor prompt; "
            "dlo-worker cannot condition it"
        )
    return {
        name: value for name, value in arguments.items() if name in accepted and value is not None
    }


def request_limits(
    pipeline: DiffusionPipeline,
    sequence_parallel_size: int = 1,
    adapters: tuple[str, ...] = (),
    fused_adapters: tuple[str, ...] = (),
) -> RequestLimits:
    """What requests the loaded pipeline takes, read from its call signature and its
    components' configs: conditioning, guidance, size rules and, for class-conditional
    DiTs, the number of classes its label embedding holds. With sequence parallelism the
    image's patches must split evenly over the SP ranks. ``adapters`` are the names of the
    LoRA adapters requests choose from, ``fused_adapters`` those fused into the weights."""
    accepted = inspect.signature(pipeline.__call__).parameters
    name = type(pipeline).__name__
    transformer_config = _config_of(getattr(pipeline, "transformer", None))
    vae_config = _config_of(getattr(pipeline, "vae", None))
    vae_scale = int(
        getattr(pipeline, "vae_scale_factor", 0)
        or 2 ** (len(vae_config.get("block_out_channels", (0,))) - 1)
    )
    latent_side = getattr(pipeline, "default_sample_size", None) or transformer_config.get(
        "sample_size"
    )
    side = int(latent_side) * vae_scale if isinstance(latent_side, int) else None
    # Latents are patchified (Flux packs 2x2), so a side must divide into whole patches.
    multiple = vae_scale * max(int(transformer_config.get("patch_size") or 1), 2)
    if "class_labels" in accepted:
        classes = transformer_config.get("num_embeds_ada_norm")
        return RequestLimits(
            name,
            "class",
            int(classes) if classes else None,
            takes_num_images=True,
            default_size=(side, side) if side else None,
            adapters=adapters,
            fused_adapters=fused_adapters,
        )
    takes_true_cfg = "true_cfg_scale" in accepted
    if "guidance_scale" not in accepted:
        guidance = Guidance.UNUSED
    elif takes_true_cfg:
        embeds = transformer_config.get("guidance_embeds")
        guidance = Guidance.EMBEDDED if embeds else Guidance.UNUSED
    else:
        guidance = Guidance.CLASSIFIER_FREE
    return RequestLimits(
        name,
        "prompt",
        guidance=guidance,
        takes_negative_prompt="negative_prompt" in accepted,
        takes_true_cfg_scale=takes_true_cfg,
        takes_size="width" in accepted and "height" in accepted,
        takes_num_images="num_images_per_prompt" in accepted,
        default_size=(side, side) if side else None,
        size_multiple=multiple,
        max_side=2 * side if side else 2048,
        token_split=sequence_parallel_size,
        adapters=adapters,
        fused_adapters=fused_adapters,
    )


def _config_of(component: object) -> dict[str, Any]:
    config = getattr(component, "config", None)
    return dict(config) if config is not None else {}


def change_adapters(pipeline: DiffusionPipeline, change: AdapterChange) -> None:
    """Load or unload one adapter (raises ``LoraSetupError`` naming ``lora_path`` when the
    file cannot apply; nothing of it is then left loaded)."""
    if change.path is None:
        lora.unload_adapter(pipeline, change.name)
    else:
        adapter = LoraAdapter(change.name, change.path)
        lora.load_adapter(pipeline, adapter, f"lora_path {change.path}", change.max_rank)


@dataclass(frozen=True)
class Generated:
    """One pipeline call's images and where its time went."""

    images: list[Image.Image]
    stage_seconds: dict[str, float]
    """Seconds of each stage that ran (:mod:`dlo_worker.engine.stages`), also observed in
    ``dlo_request_stage_seconds``."""


@torch.inference_mode()
def generate_images(pipeline: DiffusionPipeline, request: GenerationRequest) -> Generated:
    """Run the denoising loop and decode ``request.num_images`` images.

    Raises :class:`NonFiniteOutputError` (counted in ``dlo_nonfinite_outputs_total``) when
    a decoded image holds NaN or infinity, instead of returning a black image.
    """
    if request.loras is not None:
        lora.select_adapters(pipeline, [(choice.name, choice.scale) for choice in request.loras])
    with timed_stages(pipeline) as stage_seconds:
        images = pipeline(**pipeline_arguments(pipeline, request)).images
    for stage, seconds in stage_seconds.items():
        metrics.REQUEST_STAGE_SECONDS.labels(stage=stage).observe(seconds)
    finite = np.isfinite(images)
    if not finite.all():
        metrics.NONFINITE_OUTPUTS.inc()
        bad = int(finite.size - finite.sum())
        raise NonFiniteOutputError(
            f"the decoded image holds {bad} of {finite.size} values that are NaN or infinite: "
            "the model's weights or this request overflow (e.g. a huge guidance_scale); no "
            "image was written"
        )
    return Generated(pipeline.numpy_to_pil(images), stage_seconds)


def write_png(image: Image.Image, path: Path, *, make_parents: bool = False) -> Path:
    """Write ``image`` as PNG atomically (a reader sees the old file or the whole new one),
    with the mode :func:`dlo_worker.engine.images.new_file_mode` gives; the path was checked with
    :func:`dlo_worker.engine.images.check_output_path` before the model loaded."""
    path = path.resolve()
    check_output_path(path, make_parents=make_parents)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    mode = new_file_mode(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            image.save(stream, format="PNG")
            stream.flush()
            os.fchmod(stream.fileno(), mode)
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
