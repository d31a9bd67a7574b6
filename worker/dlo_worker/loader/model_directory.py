"""Checks on a diffusers pipeline directory that run before torch is imported.

Loading is strictly offline (``local_files_only``): a worker must never reach a hub
at start-up, and a missing file is a clear error instead of a download.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dlo_worker.errors import UserFixableError

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


class ModelDirectoryError(ValueError, UserFixableError):
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


def quiet_diffusers_handlers() -> None:
    """Route diffusers' records through our structured root handler instead of its own."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_default_handler()
    diffusers_logging.enable_propagation()
