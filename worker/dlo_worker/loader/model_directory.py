"""Checks on a diffusers pipeline directory that run before torch is imported.

Loading is strictly offline (``local_files_only``): a worker must never reach a hub
at start-up, and a missing file is a clear error instead of a download.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dlo_worker.errors import UserFixableError

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
    for component, (library, _) in listed_components(index).items():
        if library == "diffusers":
            check_diffusers_component(model_dir / component)
        else:
            check_other_component(model_dir / component)
    return class_name


def listed_components(index: dict) -> dict[str, tuple[str, str]]:
    """``name -> (library, class)`` of every component ``model_index.json`` lists (entries
    ``[null, null]`` are absent components)."""
    return {
        name: (entry[0], entry[1])
        for name, entry in index.items()
        if not name.startswith("_")
        and isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], str)
        and isinstance(entry[1], str)
    }


_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")
_TRANSFORMERS_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")
_OTHER_WEIGHTS = ("diffusion_pytorch_model.bin", "diffusion_pytorch_model.bin.index.json")


def dit_classes(model_dir: Path, components: tuple[str, ...]) -> dict[str, str]:
    """The diffusers class name of each of ``components`` that ``model_index.json`` lists
    as a diffusers model (the directory was checked with :func:`check_model_directory`)."""
    index = json.loads((model_dir / "model_index.json").read_text())
    return {
        component: entry[1]
        for component in components
        if isinstance(entry := index.get(component), list)
        and len(entry) == 2
        and entry[0] == "diffusers"
    }


def _check_present(directory: Path) -> None:
    if not directory.is_dir():
        raise ModelDirectoryError(
            f"{directory}: the component model_index.json names is missing; copy the complete "
            "pipeline directory again"
        )


def check_other_component(directory: Path) -> None:
    """A component of another library (transformers' text encoders and tokenizers): the
    directory exists, and a model's (it has a ``config.json``) weights are present and
    every safetensors file whole. Whether the class needs a ``config.json`` is known once
    the class is (:mod:`dlo_worker.loader.components`)."""
    _check_present(directory)
    if not (directory / "config.json").is_file():
        return
    read_json_object(directory / "config.json")
    found = any(any(directory.glob(pattern)) for pattern in _TRANSFORMERS_WEIGHTS)
    _check_weights(directory, found, "model.safetensors")


def check_diffusers_component(directory: Path) -> None:
    """One diffusers component of the pipeline: a scheduler's config, or a model's
    ``config.json`` and weights, every safetensors file whole. Reads headers only."""
    _check_present(directory)
    if (directory / "scheduler_config.json").is_file():
        read_json_object(directory / "scheduler_config.json")
        return
    read_json_object(directory / "config.json")
    found = any((directory / name).is_file() for name in (*_WEIGHTS, *_OTHER_WEIGHTS))
    _check_weights(directory, found, _WEIGHTS[0])


def _check_weights(directory: Path, found: bool, expected: str) -> None:
    """A model's weights are there (``found``), and every safetensors file is whole."""
    if not found:
        stem = expected.removesuffix(".safetensors")
        variants = sorted(path.name for path in directory.glob(f"{stem}.*.safetensors*"))
        if variants:
            # diffusers' variants ("fp16", "bf16") name files ``<name>.<variant>.safetensors``;
            # the worker loads the default files, as the loader and the runtime cache key them.
            raise ModelDirectoryError(
                f"{directory}: only variant weights ({', '.join(variants)}), no {expected}; "
                f"the worker loads the default files: download the model without a variant, "
                f"or rename {variants[0]} to {expected}"
            )
        raise ModelDirectoryError(
            f"{directory}: no weights ({expected} or a shard index); copy the complete "
            "pipeline directory again"
        )
    for weights in sorted(directory.glob("*.safetensors")):
        check_safetensors_file(weights)


def check_safetensors_file(path: Path) -> None:
    """The header parses and the tensors' byte ranges end exactly where the file does."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            if header_length <= 0 or 8 + header_length > size:
                raise ValueError("the header is longer than the file")
            header = json.loads(handle.read(header_length))
        ends = [
            tensor["data_offsets"][1] for name, tensor in header.items() if name != "__metadata__"
        ]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        raise ModelDirectoryError(
            f"{path}: not a readable safetensors file ({error}); copy it again"
        ) from None
    expected = 8 + header_length + max(ends, default=0)
    if size != expected:
        raise ModelDirectoryError(
            f"{path}: {size} bytes, but its header describes {expected}: the file is "
            f"{'truncated' if size < expected else 'padded'}; copy it again"
        )


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path``, or :class:`ModelDirectoryError` naming the file."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelDirectoryError(
            f"{path}: missing; every model component needs its config.json (copy the complete "
            "pipeline directory again)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelDirectoryError(f"{path}: not valid JSON ({error}); fix or replace it") from None
    if not isinstance(value, dict):
        raise ModelDirectoryError(f"{path}: must hold a JSON object")
    return value


class _UnusedImageProcessorFilter(logging.Filter):
    """Drops transformers' notice that its image processors fall back without torchvision:
    diffusion pipelines load text encoders and tokenizers only, so it never applies."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision" not in record.getMessage()


def quiet_diffusers_handlers() -> None:
    """Route diffusers' and transformers' records through our structured root handler
    instead of their own."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.disable_default_handler()
        library.enable_propagation()
    transformers_logger = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _UnusedImageProcessorFilter) for f in transformers_logger.filters):
        transformers_logger.addFilter(_UnusedImageProcessorFilter())
