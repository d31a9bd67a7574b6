"""The device memory planner (pure): FLUX.1-dev's component sizes against 80, 24, 12 and
2 GiB, the explicit choices, and the budget a refusal names."""

from __future__ import annotations

import pytest

from dlo_worker.loader.device_plan import (
    GIB,
    ComponentBytes,
    DeviceBudgetError,
    Placement,
    activation_reserve,
    budget_holding,
    plan_device_memory,
)

MIB = 2**20
DIT = ComponentBytes(
    "transformer",
    total=200 * MIB + 19 * 648 * MIB + 38 * 270 * MIB,
    blocks=(648 * MIB,) * 19 + (270 * MIB,) * 38,
)
T5 = ComponentBytes("text_encoder_2", total=250 * MIB + 24 * 368 * MIB, blocks=(368 * MIB,) * 24)
CLIP = ComponentBytes("text_encoder", total=235 * MIB)
VAE = ComponentBytes("vae", total=160 * MIB)
FLUX = [CLIP, T5, DIT, VAE]
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
