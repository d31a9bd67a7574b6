"""Where one pipeline call's time goes: text encoding, denoising, VAE decode.

Users choose a placement on seconds per image, so each call is split into the stages a
budget moves time between (a streamed T5 lengthens text encoding, a streamed DiT
denoising). Forward hooks on the components mark each stage's first start and last end;
a stage runs from the one to the other, the scheduler's work between DiT forwards
included. On a CUDA device the marks are events recorded on the running stream, read
after the call (whose output was copied to the host, so they are complete): no hook
waits for the device, so DLO's copies keep overlapping compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dlo_worker.observability import metrics

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

STAGE_OF_COMPONENT = {
    "text_encoder": "text_encoding",
    "text_encoder_2": "text_encoding",
    "text_encoder_3": "text_encoding",
    "transformer": "denoising",
    "transformer_2": "denoising",
    "vae": "decode",
}
"""The stage each pipeline component's forwards belong to (the VAE: its decoder)."""


@dataclass
class _Mark:
    """A point in time on the host or, for work on a CUDA device, on its stream."""

    host: float
    event: torch.cuda.Event | None = None

    @classmethod
    def now(cls, device: torch.device | None) -> _Mark:
        if device is None or device.type != "cuda":
            return cls(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return cls(time.perf_counter(), event)

    def seconds_until(self, end: _Mark) -> float:
        if self.event is not None and end.event is not None:
            end.event.synchronize()
            return self.event.elapsed_time(end.event) / 1e3
        return end.host - self.host


@dataclass
class _Span:
    start: _Mark | None = None
    end: _Mark | None = None
    device: torch.device | None = None


@contextmanager
def timed_stages(pipeline: DiffusionPipeline) -> Iterator[dict[str, float]]:
    """Time the stages of the pipeline calls made inside the block; the yielded dict is
    filled with each stage's seconds when the block ends (stages that did not run are
    left out)."""
    spans: dict[str, _Span] = {}
    handles = []
    for name, stage in STAGE_OF_COMPONENT.items():
        module = getattr(pipeline, name, None)
        if name == "vae":
            module = getattr(module, "decoder", None)
        if not isinstance(module, nn.Module):
            continue
        span = spans.setdefault(stage, _Span())
        handles.append(module.register_forward_pre_hook(_starts(span), with_kwargs=True))
        handles.append(module.register_forward_hook(_ends(span)))
    seconds: dict[str, float] = {}
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()
    for stage, span in spans.items():
        if span.start is not None and span.end is not None:
            seconds[stage] = span.start.seconds_until(span.end)


def record_device_peak() -> None:
    """Publish the CUDA allocator's peaks (``dlo_device_memory_peak_bytes``) where this
    process uses a CUDA device."""
    if torch.cuda.is_initialized():
        metrics.DEVICE_PEAK_BYTES.labels(kind="allocated").set(torch.cuda.max_memory_allocated())
        metrics.DEVICE_PEAK_BYTES.labels(kind="reserved").set(torch.cuda.max_memory_reserved())


def stage_fields(stage_seconds: dict[str, float]) -> dict[str, float]:
    """Stage seconds as log fields (``denoising_s``), in milliseconds' precision."""
    return {f"{stage}_s": round(seconds, 3) for stage, seconds in stage_seconds.items()}


def _starts(span: _Span) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    def pre_forward(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if span.start is None:
            span.device = _device_of(args, kwargs)
            span.start = _Mark.now(span.device)

    return pre_forward


def _ends(span: _Span) -> Callable[[nn.Module, tuple[Any, ...], object], None]:
    def post_forward(_module: nn.Module, _args: tuple[Any, ...], _output: object) -> None:
        span.end = _Mark.now(span.device)

    return post_forward


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """Where the forward runs: the device of its first tensor input."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None
