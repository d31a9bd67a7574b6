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

import torch

from dlo_worker.errors import UserFixableError
from dlo_worker.output import check_output_path, new_file_mode
from dlo_worker.requests import GenerationRequest

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline
    from PIL import Image


class UnsupportedPipelineError(TypeError, UserFixableError):
    """The pipeline takes neither class labels nor a prompt."""


def pipeline_arguments(pipeline: DiffusionPipeline, request: GenerationRequest) -> dict[str, Any]:
    """The keyword arguments that run ``request`` on ``pipeline``.

    The noise generator lives on the CPU so a seed gives the same latents on any device.
    """
    accepted = inspect.signature(pipeline.__call__).parameters
    arguments: dict[str, Any] = {
        "num_inference_steps": request.steps,
        "guidance_scale": request.guidance_scale,
        "generator": torch.Generator(device="cpu").manual_seed(request.seed),
        "output_type": "pil",
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


@torch.inference_mode()
def generate_image(pipeline: DiffusionPipeline, request: GenerationRequest) -> Image.Image:
    """Run the denoising loop (diffusers shows a progress bar per step) and decode one image."""
    return pipeline(**pipeline_arguments(pipeline, request)).images[0]


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
