"""The ordinary loading path: every component of a diffusers directory, materialized on a device.

Loading is strictly offline (``local_files_only``): a worker must never reach a hub
at start-up, and a missing file is a clear error instead of a download.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

logger = logging.getLogger(__name__)


class ModelDirectoryError(ValueError):
    """The ``--model`` directory is missing or is not a diffusers pipeline directory."""


def check_model_directory(model_dir: Path) -> str:
    """Verify ``model_dir`` looks like a diffusers pipeline before torch is imported.

    Returns the pipeline class name from ``model_index.json``.
    """
    if not model_dir.is_dir():
        raise ModelDirectoryError(
            f"--model {model_dir}: no such directory; create a demo model with "
            f"'dlo-worker demo-model {model_dir}' or point --model at a diffusers pipeline"
        )
    index_path = model_dir / "model_index.json"
    if not index_path.is_file():
        raise ModelDirectoryError(
            f"--model {model_dir}: not a diffusers pipeline directory (no model_index.json)"
        )
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelDirectoryError(
            f"--model {model_dir}: unreadable model_index.json ({error})"
        ) from None
    class_name = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(class_name, str):
        raise ModelDirectoryError(
            f"--model {model_dir}: model_index.json has no '_class_name' naming the pipeline"
        )
    return class_name


def load_pipeline(
    model_dir: Path, *, dtype: torch.dtype, device: torch.device
) -> DiffusionPipeline:
    """Load every component of ``model_dir`` in ``dtype`` and move the pipeline to ``device``.

    diffusers shows a progress bar per component while loading.
    """
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging

    # Route diffusers' records through our structured root handler instead of its own.
    diffusers_logging.disable_default_handler()
    diffusers_logging.enable_propagation()

    check_model_directory(model_dir)
    started = time.perf_counter()
    pipeline = DiffusionPipeline.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    pipeline.to(device)
    logger.info(
        "pipeline loaded",
        extra={
            "fields": {
                "model": str(model_dir),
                "pipeline": type(pipeline).__name__,
                "dtype": str(dtype).removeprefix("torch."),
                "device": str(device),
                "load_s": round(time.perf_counter() - started, 3),
            }
        },
    )
    return pipeline
