"""``--lora``: LoRA adapters loaded into the pipeline at start and applied to every image.

Loaded with diffusers' own loader (``load_lora_weights``, which converts Kohya and other
community formats) after DLO is enabled: the adapters then live on the device beside the
streamed weights (:mod:`dlo_worker.offload.adapters`), so they add no host-to-device
bytes. Every adapter given is active, at its scale (``set_adapters``).

``--fuse-lora`` adapters are instead fused into the weights as they are loaded, before DLO
packs them (:func:`fusion`): into the DiT's private host copy, never a shared checkpoint
mapping, and into a runtime-cache entry only under an identity that holds them.

An adapter that would not do what it says is refused at start, naming the flag's value
and the reason: a missing, truncated or corrupt file, a pipeline without a LoRA loader,
an adapter none of whose layers the pipeline has (one for another model), and one some
of whose layers it lacks (diffusers only warns of these "unexpected keys" and would run
the rest of the adapter).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from dlo_worker.config import LoraAdapter
from dlo_worker.errors import UserFixableError
from dlo_worker.loader.diffusers_loader import HostWeightEdit
from dlo_worker.runtime_cache.digest import file_sha256

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


def check_ranks(adapters: Sequence[LoraAdapter], max_rank: int | None) -> None:
    """Before anything loads: no adapter's rank exceeds ``--max-lora-rank``."""
    for adapter in adapters:
        _check_rank(adapter, max_rank, f"--lora {adapter}")


def _check_rank(adapter: LoraAdapter, max_rank: int | None, label: str) -> None:
    if max_rank is None:
        return
    rank = _rank(adapter, label)
    if rank > max_rank:
        raise LoraSetupError(
            f"{label}: its rank is {rank}, above --max-lora-rank {max_rank}; give an adapter "
            "of a lower rank, or raise the limit"
        )


def _rank(adapter: LoraAdapter, label: str) -> int:
    """The adapter's largest rank, from its file's header: the rows of its down
    projections (``lora_A`` in diffusers' and PEFT's names, ``lora_down`` in Kohya's)."""
    path = _weights_file(adapter)
    try:
        with safe_open(str(path), framework="pt") as weights:
            ranks = [
                weights.get_slice(key).get_shape()[0]
                for key in weights.keys()  # noqa: SIM118 (a safe_open handle, not a dict)
                if ".lora_A." in key or ".lora_down." in key
            ]
    except Exception as error:  # a header that does not parse is this file's problem
        raise LoraSetupError(
            f"{label}: cannot load it ({type(error).__name__}: {error}); give a LoRA "
            "safetensors file"
        ) from error
    return max(ranks, default=0)


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


def fusion_identity(adapters: Sequence[LoraAdapter]) -> tuple[str, ...]:
    """What ``--fuse-lora`` adds to the weights, in fusing order: each adapter file's
    SHA-256 and its scale (not its name or path, which do not change a byte). The runtime
    cache keys entries built from fused weights by it."""
    return tuple(
        f"sha256:{file_sha256(_weights_file(adapter))}*{adapter.scale!r}" for adapter in adapters
    )


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
        layers = _adapter_layers(pipeline, adapter.name, skip_components)
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


def load_adapters(pipeline: object, adapters: Sequence[LoraAdapter]) -> None:
    """Load every adapter under its name and make them all active at their scales."""
    if not adapters:
        return
    loader = _loader(pipeline, "--lora")
    for adapter in adapters:
        _load_quietly(pipeline, loader, adapter)
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
    _check_rank(adapter, max_rank, label)
    loader = _loader(pipeline, label)
    selection(pipeline).forget()
    try:
        _load_quietly(pipeline, loader, adapter, label)
    except LoraSetupError:
        if adapter.name in _loaded_names(pipeline):
            pipeline.delete_adapters([adapter.name])  # type: ignore[attr-defined]
        raise


def unload_adapter(pipeline: object, name: str) -> None:
    """Remove a loaded adapter's layers and free its device memory (nothing to do when
    this process does not hold it)."""
    if name in _loaded_names(pipeline):
        selection(pipeline).forget()
        pipeline.delete_adapters([name])  # type: ignore[attr-defined]
        logger.info("lora adapter unloaded", extra={"fields": {"name": name}})


def _loaded_names(target: object) -> set[str]:
    """Every adapter name loaded in any component of a pipeline, or in a model."""
    if isinstance(target, nn.Module):
        return set(getattr(target, "peft_config", {}))
    listed = getattr(target, "get_list_adapters", None)
    if listed is None:
        return set()
    return {name for names in listed().values() for name in names}


def _load_quietly(
    pipeline: object, loader: Callable[..., object], adapter: LoraAdapter, label: str = ""
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
            _load(pipeline, loader, adapter, label or f"--lora {adapter}")
    finally:
        for source in sources:
            source.removeFilter(quiet)


def _load(
    pipeline: object, loader: Callable[..., object], adapter: LoraAdapter, label: str
) -> None:
    """Load one adapter with ``loader`` (the pipeline's ``load_lora_weights``); refusals
    start with ``label`` (the flag's value, or the request's field)."""
    pipeline_name = type(pipeline).__name__
    with _unexpected_keys() as unexpected:
        try:
            loader(str(adapter.path), adapter_name=adapter.name)
        except Exception as error:  # any loader failure is this file's problem
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise LoraSetupError(
                f"{label}: cannot load it ({type(error).__name__}: "
                f"{first_line[:300]}); give a LoRA safetensors file made for "
                f"{pipeline_name}"
            ) from error
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


SELECTION_ATTRIBUTE = "_dlo_lora_selection"
"""The pipeline attribute holding its :class:`AdapterSelection` (set by :func:`selection`)."""


class AdapterSelection:
    """Which adapters and scales the next run of a pipeline uses, switched per request.

    Eager, with diffusers' ``set_adapters`` (only the chosen adapters run; unchanged
    choices are not set again). Compiled (:meth:`for_compiled_blocks`), every loaded
    adapter stays active and its scale is a device tensor a request fills in (0 when not
    chosen): compiled graphs read the tensors, so switching adapters or scales compiles
    nothing, where a new active set or a new float scale would fail Dynamo's guards. Each
    loaded adapter then runs on every request.
    """

    def __init__(self) -> None:
        self._current: tuple[tuple[str, float], ...] | None = None
        self._scales: dict[tuple[str, float], torch.Tensor] | None = None
        """Compiled: one scale tensor per adapter and per-layer base scale (PEFT's alpha
        over rank), shared by the layers with that base."""

    def select(self, pipeline: object, choices: Sequence[tuple[str, float]]) -> None:
        chosen = tuple(choices)
        if self._scales is not None:
            weights = dict(chosen)
            for (name, base), tensor in self._scales.items():
                tensor.fill_(base * weights.get(name, 0.0))
            return
        if chosen == self._current:
            return
        if not chosen:
            if _loaded_names(pipeline):  # diffusers refuses to disable what was never loaded
                pipeline.disable_lora()  # type: ignore[attr-defined]
        else:
            pipeline.enable_lora()  # type: ignore[attr-defined]
            pipeline.set_adapters(  # type: ignore[attr-defined]
                [name for name, _ in chosen], [scale for _, scale in chosen]
            )
        self._current = chosen

    def forget(self) -> None:
        """Adapters were loaded or unloaded: the next request sets its choice again."""
        self._current = None

    def for_compiled_blocks(self, pipeline: object, device: torch.device) -> None:
        """Before the blocks compile: every loaded adapter active, its scales tensors (a
        pipeline, or a DiT with diffusers' PEFT methods)."""
        names = sorted(_loaded_names(pipeline))
        if not names:
            return
        pipeline.enable_lora()  # type: ignore[attr-defined]
        pipeline.set_adapters(names, [1.0] * len(names))  # type: ignore[attr-defined]
        scales: dict[tuple[str, float], torch.Tensor] = {}
        for name in names:
            for layer in _adapter_layers(pipeline, name):
                base = float(layer.scaling[name])
                tensor = scales.setdefault(
                    (name, base), torch.zeros((), dtype=torch.float32, device=device)
                )
                layer.scaling[name] = tensor
        self._scales = scales
        self._current = None


def selection(pipeline: object) -> AdapterSelection:
    """The pipeline's adapter selection (created on first use)."""
    found = getattr(pipeline, SELECTION_ATTRIBUTE, None)
    if found is None:
        found = AdapterSelection()
        setattr(pipeline, SELECTION_ATTRIBUTE, found)
    return found


def select_adapters(pipeline: object, choices: Sequence[tuple[str, float]]) -> None:
    """Make exactly ``choices`` (loaded adapters' names and scales) active for the next
    run; none disables LoRA. Adapters are resident, so switching moves no weights."""
    selection(pipeline).select(pipeline, choices)


def adapted_layers(pipeline: object, name: str) -> int:
    """How many layers of the pipeline's components carry adapter ``name``."""
    return len(_adapter_layers(pipeline, name))


def _adapter_layers(
    pipeline: object, name: str, skip_components: frozenset[str] = frozenset()
) -> list[Any]:
    """The PEFT tuner layers carrying adapter ``name`` in the pipeline's components but
    ``skip_components`` (or in a model given instead of a pipeline)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    components = (
        {"model": pipeline}
        if isinstance(pipeline, nn.Module)
        else getattr(pipeline, "components", {})
    )
    return [
        module
        for component_name, component in components.items()
        if isinstance(component, nn.Module) and component_name not in skip_components
        for module in component.modules()
        if isinstance(module, BaseTunerLayer) and name in getattr(module, "lora_A", {})
    ]


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
