"""``--lora``: LoRA adapters loaded into the pipeline at start and applied to every image.

Loaded with diffusers' own loader (``load_lora_weights``, which converts Kohya and other
community formats) after DLO is enabled: the adapters then live on the device beside the
streamed weights (:mod:`dlo_worker.offload.adapters`), so they add no host-to-device
bytes. Every adapter given is active, at its scale (``set_adapters``).

An adapter that would not do what it says is refused at start, naming the flag's value
and the reason: a missing, truncated or corrupt file, a pipeline without a LoRA loader,
an adapter none of whose layers the pipeline has (one for another model), and one some
of whose layers it lacks (diffusers only warns of these "unexpected keys" and would run
the rest of the adapter).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dlo_worker.config import LoraAdapter
from dlo_worker.errors import UserFixableError

logger = logging.getLogger(__name__)

DIFFUSERS_PEFT_LOGGER = "diffusers.utils.peft_utils"
"""Where diffusers reports an adapter's keys the model has no layer for."""
DIFFUSERS_LORA_LOGGER = "diffusers.loaders.lora_base"
"""Where diffusers says, as a warning, that a component has no keys in the adapter (an
adapter for the DiT alone): a normal event, kept out of the worker's log."""


class _NormalEvents(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "This is safe to ignore" not in record.getMessage()


class LoraSetupError(RuntimeError, UserFixableError):
    """A ``--lora`` adapter cannot be loaded as given."""


def check_files(adapters: Sequence[LoraAdapter]) -> None:
    """Before anything loads: every adapter's file or directory exists."""
    for adapter in adapters:
        if not adapter.path.exists():
            raise LoraSetupError(
                f"--lora {adapter}: {adapter.path} does not exist; give a LoRA safetensors "
                "file or a directory holding one"
            )


def device_bytes(adapters: Sequence[LoraAdapter], dtype: torch.dtype) -> int:
    """Device bytes the adapters take once loaded in ``dtype``: every tensor of their
    files, read from the headers (a text-encoder part included, so never less)."""
    total = 0
    for adapter in adapters:
        path = _weights_file(adapter)
        try:
            with safe_open(str(path), framework="pt") as weights:
                total += sum(
                    math.prod(weights.get_slice(key).get_shape())
                    for key in weights.keys()  # noqa: SIM118 (a safe_open handle, not a dict)
                )
        except Exception as error:  # a header that does not parse is this file's problem
            raise LoraSetupError(
                f"--lora {adapter}: cannot load it ({type(error).__name__}: {error}); give "
                "a LoRA safetensors file"
            ) from error
    return total * dtype.itemsize


def _weights_file(adapter: LoraAdapter) -> Path:
    """The adapter's safetensors file: the path itself, or the one its directory holds
    (diffusers' ``pytorch_lora_weights.safetensors`` first)."""
    if adapter.path.is_file():
        return adapter.path
    default = adapter.path / "pytorch_lora_weights.safetensors"
    candidates = [default] if default.is_file() else sorted(adapter.path.glob("*.safetensors"))
    if len(candidates) != 1:
        raise LoraSetupError(
            f"--lora {adapter}: {adapter.path} holds {len(candidates)} safetensors files; "
            "give the adapter's file itself"
        )
    return candidates[0]


def load_adapters(pipeline: object, adapters: Sequence[LoraAdapter]) -> None:
    """Load every adapter under its name and make them all active at their scales."""
    if not adapters:
        return
    pipeline_name = type(pipeline).__name__
    loader = getattr(pipeline, "load_lora_weights", None)
    if loader is None:
        raise LoraSetupError(
            f"--lora: {pipeline_name} has no LoRA loader in diffusers; drop --lora"
        )
    quiet = _NormalEvents()
    logging.getLogger(DIFFUSERS_LORA_LOGGER).addFilter(quiet)
    try:
        for adapter in adapters:
            _load(pipeline, loader, adapter)
    finally:
        logging.getLogger(DIFFUSERS_LORA_LOGGER).removeFilter(quiet)
    pipeline.set_adapters(  # type: ignore[attr-defined]
        [adapter.name for adapter in adapters], [adapter.scale for adapter in adapters]
    )


def _load(pipeline: object, loader: Callable[..., object], adapter: LoraAdapter) -> None:
    """Load one adapter with ``loader`` (the pipeline's ``load_lora_weights``)."""
    pipeline_name = type(pipeline).__name__
    with _unexpected_keys() as unexpected:
        try:
            loader(str(adapter.path), adapter_name=adapter.name)
        except Exception as error:  # any loader failure is this file's problem
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise LoraSetupError(
                f"--lora {adapter}: cannot load it ({type(error).__name__}: "
                f"{first_line[:300]}); give a LoRA safetensors file made for "
                f"{pipeline_name}"
            ) from error
    layers = adapted_layers(pipeline, adapter.name)
    if unexpected:
        raise LoraSetupError(
            f"--lora {adapter}: {pipeline_name} has no layer for {len(unexpected)} of "
            f"its weights (e.g. {unexpected[0]}); give an adapter made for this model"
        )
    if layers == 0:
        raise LoraSetupError(
            f"--lora {adapter}: matches no layer of {pipeline_name}; give an adapter "
            "made for this model"
        )
    logger.info(
        "lora adapter loaded",
        extra={"fields": {"name": adapter.name, "scale": adapter.scale, "layers": layers}},
    )


def select_adapters(pipeline: object, choices: Sequence[tuple[str, float]]) -> None:
    """Make exactly ``choices`` (loaded adapters' names and scales) active for the next
    run; none disables LoRA. Adapters are resident, so switching moves no weights."""
    if not choices:
        pipeline.disable_lora()  # type: ignore[attr-defined]
        return
    pipeline.enable_lora()  # type: ignore[attr-defined]
    pipeline.set_adapters(  # type: ignore[attr-defined]
        [name for name, _ in choices], [scale for _, scale in choices]
    )


def adapted_layers(pipeline: object, name: str) -> int:
    """How many layers of the pipeline's components carry adapter ``name``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    components = getattr(pipeline, "components", {})
    return sum(
        1
        for component in components.values()
        if isinstance(component, nn.Module)
        for module in component.modules()
        if isinstance(module, BaseTunerLayer) and name in getattr(module, "lora_A", {})
    )


@contextmanager
def _unexpected_keys() -> Iterator[list[str]]:
    """Collect the keys diffusers reports as having no layer in the model (a warning)."""
    found: list[str] = []
    marker = "unexpected keys found in the model:"

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if marker in message:
                # "...model: key, key, key. " (keys hold dots, never ". ")
                keys = message.split(marker, 1)[1].split(". ", 1)[0]
                found.extend(key.strip() for key in keys.split(",") if key.strip())

    handler = Collect(logging.WARNING)
    source = logging.getLogger(DIFFUSERS_PEFT_LOGGER)
    source.addHandler(handler)
    try:
        yield found
    finally:
        source.removeHandler(handler)
