"""Run one request through a loaded pipeline and write the image.

Pipelines differ in how they are conditioned (a class id for DiT, a prompt for
text-to-image models); :func:`pipeline_arguments` maps one request onto the
arguments a pipeline's ``__call__`` accepts.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dlo_worker import metrics
from dlo_worker.errors import UserFixableError
from dlo_worker.output import check_output_path, new_file_mode
from dlo_worker.requests import GenerationRequest, RequestLimits

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline
    from PIL import Image


class UnsupportedPipelineError(TypeError, UserFixableError):
    """The pipeline takes neither class labels nor a prompt."""


class NonFiniteOutputError(RuntimeError):
    """The decoded image holds NaN or infinity: written as PNG it would be silently black."""


def pipeline_arguments(pipeline: DiffusionPipeline, request: GenerationRequest) -> dict[str, Any]:
    """The keyword arguments that run ``request`` on ``pipeline``.

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
    }
    if "class_labels" in accepted:
        arguments["class_labels"] = [request.class_label]
    elif "prompt" in accepted:
        arguments["prompt"] = request.prompt
    else:
        raise UnsupportedPipelineError(
            f"{type(pipeline).__name__} takes neither class_labels nor prompt; "
            "dlo-worker generate cannot condition it"
        )
    return {name: value for name, value in arguments.items() if name in accepted}


def request_limits(pipeline: DiffusionPipeline) -> RequestLimits:
    """What requests the loaded pipeline takes: its conditioning and, for class-conditional
    DiTs, the number of classes its label embedding holds."""
    accepted = inspect.signature(pipeline.__call__).parameters
    name = type(pipeline).__name__
    if "class_labels" in accepted:
        config = getattr(getattr(pipeline, "transformer", None), "config", {})
        classes = config.get("num_embeds_ada_norm") if hasattr(config, "get") else None
        return RequestLimits(name, "class", int(classes) if classes else None)
    return RequestLimits(name, "prompt")


@torch.inference_mode()
def generate_image(pipeline: DiffusionPipeline, request: GenerationRequest) -> Image.Image:
    """Run the denoising loop (diffusers shows a progress bar per step) and decode one image.

    Raises :class:`NonFiniteOutputError` (counted in ``dlo_nonfinite_outputs_total``) when
    the decoded image holds NaN or infinity, instead of returning a black image.
    """
    images = pipeline(**pipeline_arguments(pipeline, request)).images
    finite = np.isfinite(images)
    if not finite.all():
        metrics.NONFINITE_OUTPUTS.inc()
        bad = int(finite.size - finite.sum())
        raise NonFiniteOutputError(
            f"the decoded image holds {bad} of {finite.size} values that are NaN or infinite: "
            "the model's weights or this request overflow (e.g. a huge guidance_scale); no "
            "image was written"
        )
    return pipeline.numpy_to_pil(images)[0]


def write_png(image: Image.Image, path: Path, *, make_parents: bool = False) -> Path:
    """Write ``image`` as PNG atomically (a reader sees the old file or the whole new one),
    with the mode :func:`dlo_worker.output.new_file_mode` gives; the path was checked with
    :func:`dlo_worker.output.check_output_path` before the model loaded."""
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
