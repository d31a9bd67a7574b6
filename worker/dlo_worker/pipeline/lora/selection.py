"""Which adapters and scales a pipeline's next run uses: switched per request, eager or
under ``--compile`` (see :class:`AdapterSelection`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dlo_worker.pipeline.lora.layers import adapter_layers, loaded_names

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
            if loaded_names(pipeline):  # diffusers refuses to disable what was never loaded
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
        names = sorted(loaded_names(pipeline))
        if not names:
            return
        pipeline.enable_lora()  # type: ignore[attr-defined]
        pipeline.set_adapters(names, [1.0] * len(names))  # type: ignore[attr-defined]
        scales: dict[tuple[str, float], torch.Tensor] = {}
        for name in names:
            for layer in adapter_layers(pipeline, name):
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
