"""Where each pipeline component lives under a device memory budget (pure; no torch, no I/O).

``--max-gpu-memory-gib`` gives the whole pipeline a size; this module decides, from the
bytes each component will take on the device, what runs resident and what DLO streams:

1. everything resident when the pipeline fits beside the activation reserve: no
   streaming cost at all;
2. else the DiTs stream (their non-block weights and the two slots stay), every other
   component resident, and the DiTs' blocks that still fit stay resident too;
3. else, while it does not fit, the streamable text encoders (T5-XXL: 9.5 GB in bf16,
   streamed once per prompt through the same slots), largest first;
4. else refused, naming the budget the minimum placement needs.

Text encoders stream only when they must: a prompt is encoded once per request, so its
blocks' copies cannot hide behind compute (T5-XXL through 55 GB/s costs about 0.17 s),
whereas a DiT's copies hide behind each denoising step's compute. Where they do not (the
DiT's step is copy-bound under the budget), a resident encoder's share of the budget is
worth more as resident DiT blocks; that needs the step's copy waits, which only a request
measures, so the plan stays and :func:`streaming_advice` says so after one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from dlo_worker.errors import UserFixableError

GIB = 2**30

ACTIVATION_RESERVE_SHARE = 0.2
"""Share of the budget kept for activations, the VAE decode and allocator slack..."""
ACTIVATION_RESERVE_CAP = 4 * GIB
"""...at most this much (a 1024x1024 Flux request peaks about 3 GiB above its weights)."""


class DeviceBudgetError(ValueError, UserFixableError):
    """The pipeline cannot run within ``--max-gpu-memory-gib``."""


class Placement(StrEnum):
    RESIDENT = "resident"
    """Every weight on the device for the worker's lifetime."""
    STREAMED = "streamed"
    """DLO streams its blocks (some may stay resident); the rest of it stays."""


@dataclass(frozen=True)
class ComponentBytes:
    """What one pipeline component takes on the device."""

    name: str
    total: int
    """Every weight and buffer, resident."""
    blocks: tuple[int, ...] = ()
    """Bytes of each block DLO could stream, in execution order (empty: it cannot)."""

    @property
    def non_block(self) -> int:
        """What stays on the device while the blocks stream."""
        return self.total - sum(self.blocks)


@dataclass(frozen=True)
class DevicePlan:
    """The placement of every component within one budget."""

    budget: int
    reserve: int
    """Kept for activations (:func:`activation_reserve`)."""
    placements: dict[str, Placement]
    streamed_weights_budget: int | None
    """Device bytes for the streamed components' weights (non-block weights, the two
    slots, resident blocks): the budget less the reserve and every resident component;
    ``None`` when nothing streams."""
    minimum: int
    """Device bytes of this placement's weights with no streamed block resident."""
    components: tuple[ComponentBytes, ...] = ()
    """What the plan placed."""

    def resident_streamable(self, among: Sequence[str]) -> list[ComponentBytes]:
        """The components of ``among`` with blocks DLO could stream that this plan keeps
        resident, largest first."""
        return sorted(
            (
                component
                for component in self.components
                if component.name in among
                and component.blocks
                and self.placements.get(component.name) == Placement.RESIDENT
            ),
            key=lambda component: -sum(component.blocks),
        )

    def streamed(self, among: tuple[str, ...]) -> tuple[str, ...]:
        """The components of ``among`` this plan streams."""
        return tuple(name for name in among if self.placements.get(name) == Placement.STREAMED)

    @property
    def streams(self) -> bool:
        return self.streamed_weights_budget is not None

    def log_fields(self) -> dict[str, object]:
        return {
            "budget_gib": _gib(self.budget),
            "activation_reserve_gib": _gib(self.reserve),
            "minimum_gib": _gib(self.minimum),
            "streamed_weights_gib": None
            if self.streamed_weights_budget is None
            else _gib(self.streamed_weights_budget),
            **{f"placement.{name}": str(where) for name, where in self.placements.items()},
        }


def activation_reserve(budget: int) -> int:
    return min(ACTIVATION_RESERVE_CAP, int(budget * ACTIVATION_RESERVE_SHARE))


def budget_holding(weights: int) -> int:
    """The smallest budget whose share left after :func:`activation_reserve` holds
    ``weights`` bytes."""
    candidate = min(
        math.ceil(weights / (1 - ACTIVATION_RESERVE_SHARE)), weights + ACTIVATION_RESERVE_CAP
    )
    # What is left after the reserve never shrinks as the budget grows; the estimate is
    # off by integer rounding only.
    while candidate - activation_reserve(candidate) < weights:
        candidate += 1
    while candidate > 1 and (candidate - 1) - activation_reserve(candidate - 1) >= weights:
        candidate -= 1
    return candidate


def plan_device_memory(
    components: list[ComponentBytes],
    budget: int,
    *,
    dits: tuple[str, ...],
    text_encoders: tuple[str, ...],
    stream_dits: bool = False,
    streamed_text_encoders: tuple[str, ...] = (),
) -> DevicePlan:
    """Place ``components`` within ``budget`` bytes (see the module docstring).

    ``dits`` and ``text_encoders`` name the components DLO may stream (a component without
    blocks never streams); ``stream_dits`` streams the DiTs even where everything fits
    (DLO asked for explicitly), and ``streamed_text_encoders`` (asked for explicitly)
    stream whenever the DiTs do.
    """
    reserve = activation_reserve(budget)
    usable = budget - reserve
    by_name = {component.name: component for component in components}
    total = sum(component.total for component in components)
    if not (stream_dits or streamed_text_encoders) and total <= usable:
        return DevicePlan(
            budget,
            reserve,
            dict.fromkeys(by_name, Placement.RESIDENT),
            None,
            total,
            tuple(components),
        )
    streamed = [name for name in dits if by_name.get(name) and by_name[name].blocks]
    if not streamed:
        raise DeviceBudgetError(
            f"--max-gpu-memory-gib {budget / GIB:g}: the pipeline's {_gib(total)} GiB of "
            f"weights do not fit beside the {_gib(reserve)} GiB activation reserve, and it has "
            "no DiT DLO can stream; raise it to at least "
            f"{_gib_at_least(budget_holding(total))} GiB"
        )
    streamed += [name for name in streamed_text_encoders if name in by_name]
    encoders = sorted(
        (
            name
            for name in text_encoders
            if name not in streamed and by_name.get(name) and by_name[name].blocks
        ),
        key=lambda name: -by_name[name].total,
    )
    minimum = 0
    for extra in range(len(encoders) + 1):
        chosen = streamed + encoders[:extra]
        minimum = _streaming_minimum(by_name, chosen)
        if minimum <= usable:
            placements = {
                name: Placement.STREAMED if name in chosen else Placement.RESIDENT
                for name in by_name
            }
            resident = sum(c.total for c in components if c.name not in chosen)
            return DevicePlan(
                budget, reserve, placements, usable - resident, minimum, tuple(components)
            )
    raise DeviceBudgetError(
        f"--max-gpu-memory-gib {budget / GIB:g}: even with {', '.join(streamed + encoders)} "
        f"streamed the pipeline needs {_gib(minimum)} GiB of weights and slots beside the "
        f"activation reserve; raise it to at least {_gib_at_least(budget_holding(minimum))} GiB"
    )


@dataclass(frozen=True)
class StreamingAdvice:
    """A resident text encoder that measured copy waits say to stream."""

    component: str
    copy_wait_seconds: float
    """What compute waited for streamed blocks' copies in one request."""
    stream_seconds: float
    """The encoder's blocks at the measured copy rate: what streaming it adds per request."""
    host_bytes: int
    """Host memory its blocks would take while streamed."""

    def log_fields(self) -> dict[str, object]:
        return {
            "component": self.component,
            "copy_wait_seconds": float(f"{self.copy_wait_seconds:.3g}"),
            "stream_seconds": float(f"{self.stream_seconds:.3g}"),
            "host_gib": _gib(self.host_bytes),
            "fix": f"--dlo-stream-text-encoders {self.component} "
            "(DiffusionDeployment offload.streamTextEncoders)",
        }


def streaming_advice(
    plan: DevicePlan,
    text_encoders: Sequence[str],
    copy_wait_seconds: float,
    copy_bytes_per_second: float,
) -> StreamingAdvice | None:
    """The largest resident text encoder of ``plan`` worth streaming, given one request's
    copy waits of the streamed components and the rate their copies ran at (pure).

    Streaming an encoder adds its blocks' copy, once per request. Its device bytes go to
    the DiT's resident blocks, which take as many bytes off each denoising step's copies:
    with two or more steps that saves more than it adds whenever the request waited longer
    for copies than the encoder's copy takes. Where the step is compute-bound (no waits)
    it would only add its copy, so none is advised.
    """
    if not plan.streams or copy_bytes_per_second <= 0:
        return None
    for component in plan.resident_streamable(text_encoders):
        block_bytes = sum(component.blocks)
        stream_seconds = block_bytes / copy_bytes_per_second
        if copy_wait_seconds > stream_seconds:
            return StreamingAdvice(component.name, copy_wait_seconds, stream_seconds, block_bytes)
    return None


def _streaming_minimum(by_name: dict[str, ComponentBytes], streamed: list[str]) -> int:
    """Device bytes with ``streamed`` streaming every block: their non-block weights, two
    slots of their largest block (the slots are shared), every other component whole."""
    largest_block = max(block for name in streamed for block in by_name[name].blocks)
    return (
        sum(c.total for name, c in by_name.items() if name not in streamed)
        + sum(by_name[name].non_block for name in streamed)
        + 2 * largest_block
    )


def _gib(value: int) -> float:
    """GiB to 2 decimals, or 3 significant digits below 1 GiB."""
    return float(f"{value / GIB:.2f}") if value >= GIB else float(f"{value / GIB:.3g}")


def _gib_at_least(value: int) -> float:
    """GiB rounded up at :func:`_gib`'s precision: a budget that holds ``value``."""
    gib = value / GIB
    digits = 2 if gib >= 1 else 2 - math.floor(math.log10(gib))
    return math.ceil(gib * 10**digits) / 10**digits
