"""Every component of a pipeline directory, checked before a weight is read.

:func:`~dlo_worker.loader.model_directory.check_model_directory` (torch-free) proved the
files are there and whole. With the libraries imported, :func:`inspect_pipeline` checks
what only the classes can tell, at no weight cost:

- the pipeline class and every component class ``model_index.json`` names exist;
- the scheduler builds from its config and sets timesteps;
- each tokenizer loads, has a vocabulary, and produces no id beyond the embedding of the
  text encoder it feeds (``tokenizer_2`` feeds ``text_encoder_2``);
- each model (DiT, VAE, text encoders) builds a meta skeleton from its ``config.json``, and
  every checkpoint tensor that names one of the skeleton's tensors has its shape and a
  dtype it can run (:func:`~dlo_worker.loader.checkpoint.dtype_problem`); a ``.weight`` or
  ``.bias`` it cannot match (a library renames legacy keys while loading) is still
  refused in a dtype no model runs.

Each failure is a :class:`~dlo_worker.loader.model_directory.ModelDirectoryError` or a
:class:`~dlo_worker.loader.checkpoint.CheckpointError` naming the file and the fix (exit 2).
The tokenizers and schedulers are handed to diffusers as loaded, so each is read once;
the skeletons make a meta pipeline whose request limits ``generate`` checks before
loading (:attr:`PipelineInspection.meta_pipeline`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dlo_worker.loader.checkpoint import (
    TRANSFORMERS_WEIGHTS_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    dtype_problem,
    read_checkpoint_index,
)
from dlo_worker.loader.model_directory import (
    ModelDirectoryError,
    listed_components,
    read_json_object,
)

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineInspection:
    """What inspecting a pipeline directory built, for loading it."""

    loaded: dict[str, object]
    """Tokenizers and schedulers, loaded and checked: handed to diffusers as they are."""
    skeletons: dict[str, nn.Module]
    """Every model component with meta tensors (no weight memory)."""
    meta_pipeline: DiffusionPipeline | None
    """The pipeline built from :attr:`loaded` and :attr:`skeletons`, for its request
    limits before loading; None where the pipeline class cannot be built so."""


def inspect_pipeline(model_dir: Path, dtype: torch.dtype) -> PipelineInspection:
    """Check every component of ``model_dir`` (see the module docstring)."""
    import diffusers
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    index_path = model_dir / "model_index.json"
    index = read_json_object(index_path)
    pipeline_class = _pipeline_class(index_path, index["_class_name"])
    loaded: dict[str, object] = {}
    skeletons: dict[str, nn.Module] = {}
    for name, (library, class_name) in listed_components(index).items():
        component_class = _component_class(index_path, name, library, class_name)
        directory = model_dir / name
        if issubclass(component_class, diffusers.SchedulerMixin):
            loaded[name] = _scheduler(directory, component_class)
        elif issubclass(component_class, PreTrainedTokenizerBase):
            loaded[name] = _tokenizer(directory, component_class)
        elif issubclass(component_class, diffusers.ModelMixin):
            skeletons[name] = _built(
                directory, partial(diffusers_skeleton, component_class, directory, dtype)
            )
            _check_checkpoint(directory, skeletons[name], WEIGHTS_NAME)
        elif issubclass(component_class, PreTrainedModel):
            skeletons[name] = _built(
                directory, partial(transformers_skeleton, component_class, directory)
            )
            _check_checkpoint(directory, skeletons[name], TRANSFORMERS_WEIGHTS_NAME)
    for name, tokenizer in loaded.items():
        if isinstance(tokenizer, PreTrainedTokenizerBase):
            _check_vocabulary(model_dir / name, tokenizer, _encoder_of(name, skeletons))
    meta = _meta_pipeline(pipeline_class, index, loaded, skeletons)
    return PipelineInspection(loaded, skeletons, meta)


def diffusers_skeleton(
    model_class: type[Any], component_dir: Path, dtype: torch.dtype
) -> nn.Module:
    """A diffusers model with meta parameters, cast as ``from_pretrained`` would cast it;
    buffers keep their init values."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = model_class.from_config(model_class.load_config(str(component_dir)))
    _cast_state_like_from_pretrained(model, dtype)
    return model.eval()


def transformers_skeleton(model_class: type[Any], component_dir: Path) -> nn.Module:
    """A transformers model with meta parameters (its dtypes do not matter here: it is
    checked against its checkpoint and gives the meta pipeline its shape)."""
    from accelerate import init_empty_weights

    config = model_class.config_class.from_pretrained(str(component_dir))
    with init_empty_weights():
        return model_class(config).eval()


def _cast_state_like_from_pretrained(model: nn.Module, dtype: torch.dtype) -> None:
    """Give floating parameters and persistent buffers ``dtype``, as diffusers' loader does
    while loading the state dict; non-persistent buffers keep their constructed dtype."""
    persistent = set(model.state_dict(keep_vars=True))
    cast: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, parameter in module._parameters.items():
            if parameter is not None and parameter.is_floating_point():
                if id(parameter) not in cast:
                    cast[id(parameter)] = nn.Parameter(
                        parameter.to(dtype), requires_grad=parameter.requires_grad
                    )
                module._parameters[name] = cast[id(parameter)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point() and prefix + name in persistent:
                module._buffers[name] = buffer.to(dtype)


def _pipeline_class(index_path: Path, class_name: str) -> type:
    import diffusers

    found = getattr(diffusers, class_name, None)
    if not (isinstance(found, type) and issubclass(found, diffusers.DiffusionPipeline)):
        raise ModelDirectoryError(
            f"{index_path}: names the pipeline class {class_name!r}, which diffusers "
            f"{diffusers.__version__} does not have; fix '_class_name' or use the diffusers "
            "release the model was written for"
        )
    return found


def _component_class(index_path: Path, name: str, library: str, class_name: str) -> type:
    try:
        module = importlib.import_module(library)
    except ImportError:
        raise ModelDirectoryError(
            f"{index_path}: component {name!r} needs the library {library!r}, which is not "
            "installed"
        ) from None
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        version = getattr(module, "__version__", "")
        raise ModelDirectoryError(
            f"{index_path}: component {name!r} is a {library}.{class_name}, which {library} "
            f"{version} does not have; fix model_index.json or use the release the model was "
            "written for"
        )
    return found


def _built(directory: Path, build: Callable[[], nn.Module]) -> nn.Module:
    """A model's meta skeleton; its ``config.json`` missing or unusable is named."""
    config = directory / "config.json"
    read_json_object(config)
    try:
        return build()
    except Exception as error:  # the libraries raise anything for a bad config value
        raise ModelDirectoryError(
            f"{config}: the model cannot be built from it ({_summary(error)}); fix or replace it"
        ) from None


def _scheduler(directory: Path, scheduler_class: type[Any]) -> object:
    """The scheduler from its config, after a trial ``set_timesteps`` on a second copy."""
    path = directory / "scheduler_config.json"
    read_json_object(path)
    try:
        config = scheduler_class.load_config(str(directory))
        _try_timesteps(scheduler_class.from_config(config))
        return scheduler_class.from_config(config)
    except Exception as error:  # the libraries raise anything for a bad config value
        raise ModelDirectoryError(
            f"{path}: {scheduler_class.__name__} cannot run with it ({_summary(error)}); fix "
            "or replace it"
        ) from None


def _try_timesteps(scheduler: object) -> None:
    """Two timesteps, as a pipeline sets them (``mu`` for dynamic shifting); skipped for a
    scheduler whose ``set_timesteps`` needs more than this knows to give."""
    parameters = inspect.signature(scheduler.set_timesteps).parameters  # type: ignore[attr-defined]
    given: dict[str, object] = {}
    if "mu" in parameters and scheduler.config.get("use_dynamic_shifting"):  # type: ignore[attr-defined]
        given["mu"] = 1.0
    required = [
        name
        for name, parameter in parameters.items()
        if name not in ("num_inference_steps", *given)
        and parameter.default is parameter.empty
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]
    if not required:
        scheduler.set_timesteps(2, **given)  # type: ignore[attr-defined]


def _tokenizer(directory: Path, tokenizer_class: type[Any]) -> object:
    try:
        tokenizer = tokenizer_class.from_pretrained(str(directory), local_files_only=True)
    except Exception as error:  # the libraries raise anything for a damaged file
        raise ModelDirectoryError(
            f"{directory}: cannot load {tokenizer_class.__name__} ({_summary(error)}); a "
            "tokenizer file is damaged: copy the complete pipeline directory again"
        ) from None
    specials = set(tokenizer.all_special_tokens)
    if len(tokenizer) <= len(specials):
        holds = ", ".join(sorted(path.name for path in directory.iterdir())) or "nothing"
        raise ModelDirectoryError(
            f"{directory}: {tokenizer_class.__name__} loaded no vocabulary (only its "
            f"{len(tokenizer)} special token(s); the directory holds {holds}): its vocabulary "
            "file (tokenizer.json, or the files its class reads) is missing or empty; copy "
            "the complete pipeline directory again"
        )
    return tokenizer


def _encoder_of(tokenizer_name: str, skeletons: dict[str, nn.Module]) -> tuple[str, int] | None:
    """The text encoder a tokenizer feeds and its embedding's row count, if known."""
    if not tokenizer_name.startswith("tokenizer"):
        return None
    encoder = "text_encoder" + tokenizer_name.removeprefix("tokenizer")
    embeddings = getattr(skeletons.get(encoder), "get_input_embeddings", None)
    table = embeddings() if callable(embeddings) else None
    return (encoder, table.num_embeddings) if isinstance(table, nn.Embedding) else None


def _check_vocabulary(directory: Path, tokenizer: object, encoder: tuple[str, int] | None) -> None:
    if encoder is None:
        return
    name, rows = encoder
    largest = max(tokenizer.get_vocab().values())  # type: ignore[attr-defined]
    if largest >= rows:
        raise ModelDirectoryError(
            f"{directory}: the tokenizer produces ids up to {largest}, but {name} embeds "
            f"{rows} tokens: it belongs to another model; copy the pipeline's own tokenizer"
        )


def _check_checkpoint(directory: Path, skeleton: nn.Module, weights_name: str) -> None:
    """Shapes and dtypes of the checkpoint's tensors against the skeleton's (a quantized
    checkpoint, with a ``quantization_config``, stores other dtypes by design)."""
    if "quantization_config" in read_json_object(directory / "config.json"):
        return
    checkpoint = read_checkpoint_index(directory, weights_name)
    if checkpoint is None:
        return  # another format (.bin): the library reads and checks it
    state = skeleton.state_dict(keep_vars=True)
    for key, stored in checkpoint.tensors.items():
        runtime = state.get(key, state.get(key.split(".", 1)[-1]))
        if runtime is None:
            looks_like_a_weight = key.endswith((".weight", ".bias"))
            problem = dtype_problem(stored.dtype, torch.float32) if looks_like_a_weight else None
        else:
            problem = dtype_problem(stored.dtype, runtime.dtype)
            if problem is None and stored.shape != tuple(runtime.shape):
                problem = (
                    f"has shape {list(stored.shape)} but {directory / 'config.json'} needs "
                    f"{list(runtime.shape)}; the weights and the config come from different models"
                )
        if problem is not None:
            raise CheckpointError(f"{stored.file}: {key!r} {problem}")


def _meta_pipeline(
    pipeline_class: type,
    index: dict,
    loaded: dict[str, object],
    skeletons: dict[str, nn.Module],
) -> DiffusionPipeline | None:
    components = {
        name: loaded.get(name, skeletons.get(name))
        for name, entry in index.items()
        if not name.startswith("_") and isinstance(entry, list)
    }
    try:
        return pipeline_class(**components)
    except Exception as error:  # a pipeline whose __init__ needs real weights
        logger.debug(
            "no meta pipeline; requests are checked after loading",
            extra={"fields": {"pipeline": pipeline_class.__name__, "why": _summary(error)}},
        )
        return None


def _summary(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
