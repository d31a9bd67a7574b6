"""The device memory planner (pure): FLUX.1-dev's component sizes against 80, 24, 12 and
2 GiB, the explicit choices, the budget a refusal names, and when measured copy waits
advise streaming a resident text encoder."""

from __future__ import annotations

import pytest

from dlo_worker.loader.device_plan import (
    GIB,
    DeviceBudgetError,
    Placement,
    activation_reserve,
    budget_holding,
    plan_device_memory,
    streaming_advice,
)
from tests.support.flux_sizes import CLIP, DIT, FLUX, MIB, T5, T5_COPY_SECONDS, VAE

DITS = ("transformer", "transformer_2")
ENCODERS = ("text_encoder", "text_encoder_2")


def plan(budget_gib: float, **choices: object):  # type: ignore[no-untyped-def]
    return plan_device_memory(
        FLUX,
        int(budget_gib * GIB),
        dits=DITS,
        text_encoders=ENCODERS,
        **choices,  # type: ignore[arg-type]
    )


def test_a_pipeline_that_fits_runs_resident_with_nothing_streamed() -> None:
    placed = plan(80)
    assert set(placed.placements.values()) == {Placement.RESIDENT}
    assert placed.streamed_weights_budget is None
    assert not placed.streams


def test_at_24_gib_the_dit_streams_and_keeps_what_fits_while_t5_stays() -> None:
    placed = plan(24)
    assert placed.streamed(DITS) == ("transformer",)
    assert placed.streamed(ENCODERS) == ()
    resident = CLIP.total + T5.total + VAE.total
    assert placed.streamed_weights_budget == 24 * GIB - activation_reserve(24 * GIB) - resident
    # Room for resident DiT blocks beyond its non-block weights and two slots.
    assert placed.streamed_weights_budget > DIT.non_block + 2 * max(DIT.blocks) + 8 * GIB


def test_at_12_gib_t5_streams_too_through_the_same_slots() -> None:
    placed = plan(12)
    assert placed.streamed(DITS) == ("transformer",)
    assert placed.streamed(ENCODERS) == ("text_encoder_2",)
    assert placed.placements["text_encoder"] == Placement.RESIDENT
    assert placed.minimum == CLIP.total + VAE.total + DIT.non_block + T5.non_block + 2 * max(
        DIT.blocks
    )
    assert placed.streamed_weights_budget == 12 * GIB - activation_reserve(12 * GIB) - (
        CLIP.total + VAE.total
    )


def test_a_budget_nothing_fits_is_refused_naming_the_budget_that_would() -> None:
    with pytest.raises(DeviceBudgetError) as refused:
        plan(2)
    message = str(refused.value)
    assert "--max-gpu-memory-gib 2:" in message
    assert "transformer, text_encoder_2 streamed" in message
    needed = float(message.rsplit("at least ", 1)[1].split(maxsplit=1)[0])
    assert plan(needed).streamed(ENCODERS) == ("text_encoder_2",)
    with pytest.raises(DeviceBudgetError):
        plan(needed - 0.01)


def test_a_pipeline_without_a_dit_is_refused_when_it_does_not_fit() -> None:
    with pytest.raises(DeviceBudgetError, match="no DiT DLO can stream"):
        plan_device_memory([CLIP, VAE], 100 * MIB, dits=DITS, text_encoders=ENCODERS)


def test_explicit_choices_stream_even_where_everything_fits() -> None:
    assert plan(80, stream_dits=True).streamed(DITS + ENCODERS) == ("transformer",)
    forced = plan(80, stream_dits=True, streamed_text_encoders=("text_encoder_2",))
    assert forced.streamed(DITS + ENCODERS) == ("transformer", "text_encoder_2")


@pytest.mark.parametrize("weights", [1, 7 * MIB, 3 * GIB, 16 * GIB, 16 * GIB + 1, 70 * GIB])
def test_budget_holding_is_the_smallest_budget_whose_usable_share_holds_the_weights(
    weights: int,
) -> None:
    budget = budget_holding(weights)
    assert budget - activation_reserve(budget) >= weights
    assert (budget - 1) - activation_reserve(budget - 1) < weights


def test_copy_waits_longer_than_t5s_copy_advise_streaming_it() -> None:
    advice = streaming_advice(plan(24), ENCODERS, T5_COPY_SECONDS + 0.01, 55e9)
    assert advice is not None
    assert advice.component == "text_encoder_2"
    assert advice.stream_seconds == pytest.approx(T5_COPY_SECONDS)
    assert advice.host_bytes == sum(T5.blocks)
    fields = advice.log_fields()
    assert fields["fix"] == (
        "--dlo-stream-text-encoders text_encoder_2 (DiffusionDeployment offload.streamTextEncoders)"
    )


@pytest.mark.parametrize("wait", [0.0, T5_COPY_SECONDS * 0.99])
def test_a_step_that_hides_its_copies_keeps_t5_resident(wait: float) -> None:
    assert streaming_advice(plan(24), ENCODERS, wait, 55e9) is None


def test_a_slower_copy_raises_the_bar() -> None:
    """At 25 GB/s (PCIe 4) T5's copy takes 0.37 s: 0.3 s of waits no longer pay for it."""
    assert streaming_advice(plan(24), ENCODERS, 0.3, 55e9) is not None
    assert streaming_advice(plan(24), ENCODERS, 0.3, 25e9) is None


def test_nothing_is_advised_where_t5_streams_or_nothing_does() -> None:
    assert streaming_advice(plan(12), ENCODERS, 100.0, 55e9) is None  # T5 streams already
    assert streaming_advice(plan(80), ENCODERS, 100.0, 55e9) is None  # all resident
    # CLIP has no blocks DLO streams; no rate measured yet.
    assert streaming_advice(plan(24), ("text_encoder",), 100.0, 55e9) is None
    assert streaming_advice(plan(24), ENCODERS, 100.0, 0.0) is None
