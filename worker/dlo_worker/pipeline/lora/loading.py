"""Loading, unloading and fusing adapters with diffusers' own loader
(``load_lora_weights``, which converts Kohya and other community formats).

Before the loader touches the model, the adapter is checked against the model's layers
and the rank limit (:mod:`.fit`). diffusers reports normal events as warnings while it
loads (a component with none of the adapter's keys, the other loaded adapters' weights as
"missing keys"): they are kept out of the worker's log. What it only warns about but is
not normal, weights for layers the model lacks ("unexpected keys"), refuses the adapter.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from dlo_worker.config import LoraAdapter
from dlo_worker.loader.diffusers_loader import HostWeightEdit
from dlo_worker.pipeline.lora.errors import LoraSetupError
from dlo_worker.pipeline.lora.files import fusion_identity
from dlo_worker.pipeline.lora.fit import cannot_load, check_fit
from dlo_worker.pipeline.lora.layers import adapted_layers, adapter_layers, loaded_names
from dlo_worker.pipeline.lora.selection import select_adapters, selection

logger = logging.getLogger(__name__)

DIFFUSERS_PEFT_LOGGER = "diffusers.utils.peft_utils"
"""Where diffusers reports an adapter's keys the model has no layer for."""
DIFFUSERS_LORA_LOGGER = "diffusers.loaders.lora_base"
"""Where diffusers says, as a warning, that a component has no keys in the adapter (an
adapter for the DiT alone): a normal event, kept out of the worker's log."""


class _NormalEvents(logging.Filter):
    """Keeps out of the log what diffusers reports as a warning while loading ``adapter``
    but is normal: a component with none of its keys, and the other loaded adapters'
    weights as "missing keys" of this one."""

    def __init__(self, adapter: str) -> None:
        super().__init__()
        self.adapter = adapter

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "This is safe to ignore" in message:
            return False
        marker = "missing keys in the model:"
        if marker in message and "unexpected keys" not in message:
            keys = message.split(marker, 1)[1]
            return f".{self.adapter}." in keys  # this adapter's own keys missing: report
        return True


def fusion(adapters: Sequence[LoraAdapter]) -> HostWeightEdit | None:
    """``--fuse-lora``: the edit the loader writes into the loaded weights
    (:func:`fuse_adapters`), keyed by :func:`fusion_identity`."""
    if not adapters:
        return None
    return HostWeightEdit(
        identity=fusion_identity(adapters),
        apply=lambda pipeline, skip: fuse_adapters(pipeline, adapters, skip),
    )


def fuse_adapters(
    pipeline: object,
    adapters: Sequence[LoraAdapter],
    skip_components: frozenset[str] = frozenset(),
) -> None:
    """Fuse each adapter, at its scale, into the weights of the pipeline's components but
    ``skip_components`` (DiTs bound to a runtime-cache entry built with them fused), then
    remove it: the weights then hold it, and nothing of it is left to choose.

    One adapter at a time, each alone in the pipeline (diffusers' fusing scales every
    active adapter of a layer). Every layer is merged on the CPU, as PEFT merges there
    (half-precision weights in float32), wherever the worker then runs it: the fused
    weights are the same bytes for a resident or a streamed DiT, on any device, and for
    ``dlo-worker cache warm`` on a node without a GPU.
    """
    loader = _loader(pipeline, "--fuse-lora")
    cpu = torch.device("cpu")
    for adapter in adapters:
        _load_quietly(pipeline, loader, adapter)
        layers = adapter_layers(pipeline, adapter.name, skip_components)
        for layer in layers:
            home = layer.get_base_layer().weight.device
            layer.to(cpu)
            if adapter.scale != 1.0:
                layer.scale_layer(adapter.scale)
            layer.merge(adapter_names=[adapter.name])
            layer.to(home)
        pipeline.unload_lora_weights()  # type: ignore[attr-defined]
        fields: dict[str, object] = {
            "name": adapter.name,
            "scale": adapter.scale,
            "layers": len(layers),
        }
        if skip_components:  # their runtime-cache entry was built with the adapter fused
            fields["fused_in_cache"] = ",".join(sorted(skip_components))
        logger.info("lora adapter fused", extra={"fields": fields})


def load_adapters(
    pipeline: object, adapters: Sequence[LoraAdapter], max_rank: int | None = None
) -> None:
    """Load every adapter under its name and make them all active at their scales; each
    within ``max_rank`` (``--max-lora-rank``; None: no limit)."""
    if not adapters:
        return
    loader = _loader(pipeline, "--lora")
    for adapter in adapters:
        _load_quietly(pipeline, loader, adapter, max_rank=max_rank)
    select_adapters(pipeline, [(adapter.name, adapter.scale) for adapter in adapters])


def _loader(pipeline: object, flag: str) -> Callable[..., object]:
    """The pipeline's ``load_lora_weights``, or refused naming ``flag``."""
    loader = getattr(pipeline, "load_lora_weights", None)
    if loader is None:
        raise LoraSetupError(
            f"{flag}: {type(pipeline).__name__} has no LoRA loader in diffusers; drop {flag}"
        )
    return loader


def load_adapter(
    pipeline: object, adapter: LoraAdapter, label: str, max_rank: int | None = None
) -> None:
    """Load one adapter at run time (not active until a request chooses it); refused
    naming ``label`` (the request's field), with nothing of it left loaded."""
    loader = _loader(pipeline, label)
    selection(pipeline).forget()
    try:
        _load_quietly(pipeline, loader, adapter, label, max_rank)
    except LoraSetupError:
        if adapter.name in loaded_names(pipeline):
            pipeline.delete_adapters([adapter.name])  # type: ignore[attr-defined]
        raise


def unload_adapter(pipeline: object, name: str) -> None:
    """Remove a loaded adapter's layers and free its device memory (nothing to do when
    this process does not hold it)."""
    if name in loaded_names(pipeline):
        selection(pipeline).forget()
        pipeline.delete_adapters([name])  # type: ignore[attr-defined]
        logger.info("lora adapter unloaded", extra={"fields": {"name": name}})


def _load_quietly(
    pipeline: object,
    loader: Callable[..., object],
    adapter: LoraAdapter,
    label: str = "",
    max_rank: int | None = None,
) -> None:
    """:func:`_load`, without the warnings of normal events (:class:`_NormalEvents`, and
    PEFT's that a model holding an adapter gets another)."""
    quiet = _NormalEvents(adapter.name)
    sources = [logging.getLogger(name) for name in (DIFFUSERS_LORA_LOGGER, DIFFUSERS_PEFT_LOGGER)]
    for source in sources:
        source.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            _load(pipeline, loader, adapter, label or f"--lora {adapter}", max_rank)
    finally:
        for source in sources:
            source.removeFilter(quiet)


def _load(
    pipeline: object,
    loader: Callable[..., object],
    adapter: LoraAdapter,
    label: str,
    max_rank: int | None,
) -> None:
    """Check one adapter against the model (:func:`~.fit.check_fit`), then load it with
    ``loader`` (the pipeline's ``load_lora_weights``); refusals start with ``label`` (the
    flag's value, or the request's field)."""
    pipeline_name = type(pipeline).__name__
    check_fit(pipeline, adapter, label, max_rank)
    with _unexpected_keys() as unexpected:
        try:
            loader(str(adapter.path), adapter_name=adapter.name)
        except Exception as error:  # any loader failure is this file's problem
            raise cannot_load(label, pipeline, error) from error
    layers = adapted_layers(pipeline, adapter.name)
    if unexpected:
        raise LoraSetupError(
            f"{label}: {pipeline_name} has no layer for {len(unexpected)} of "
            f"its weights (e.g. {unexpected[0]}); give an adapter made for this model"
        )
    if layers == 0:
        raise LoraSetupError(
            f"{label}: matches no layer of {pipeline_name}; give an adapter made for this model"
        )
    logger.info(
        "lora adapter loaded",
        extra={"fields": {"name": adapter.name, "scale": adapter.scale, "layers": layers}},
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
