"""Wave planning and the leader's request queue (pure scheduling, no model)."""

from __future__ import annotations

import pytest

from dlo_worker.engine.request import GenerationRequest
from dlo_worker.engine.waves import (
    IntakeClosedError,
    QueueFullError,
    RequestQueue,
    Wave,
    choose_wave,
)


def request(seed: int, steps: int = 4, guidance: float = 4.0) -> GenerationRequest:
    return GenerationRequest(seed=seed, steps=steps, guidance_scale=guidance)


def test_lockstep_wave_takes_only_requests_with_the_heads_step_count() -> None:
    pending = [request(0), request(1, steps=8), request(2), request(3)]
    chosen, wave = choose_wave(pending, width=2, lockstep=True)
    assert chosen == [0, 2]
    assert [lane.seed for lane in wave.lanes] == [0, 2]
    assert wave.discarded == frozenset()


def test_lockstep_wave_fills_idle_ranks_with_a_discarded_copy_of_the_head() -> None:
    pending = [request(0), request(1, steps=8)]
    chosen, wave = choose_wave(pending, width=4, lockstep=True)
    assert chosen == [0]
    assert wave.lanes == (pending[0],) * 4
    assert wave.discarded == frozenset({1, 2, 3})
    assert not wave.empty


def test_lockstep_wave_separates_guidance_scales() -> None:
    chosen, _ = choose_wave([request(0), request(1, guidance=1.0)], width=2, lockstep=True)
    assert chosen == [0]


def test_lockstep_wave_mixes_sizes_and_image_counts_but_not_extra_guidance_passes() -> None:
    """Size and num_images change activations only, so they share a wave (the integration
    test checks such a wave bitwise); a negative prompt with true CFG adds a transformer
    pass per step, so it runs in its own wave."""
    head = GenerationRequest(seed=0, steps=4, prompt="a", width=64, height=64)
    pending = [
        head,
        GenerationRequest(seed=1, steps=4, prompt="b", width=96, height=32, num_images=2),
        GenerationRequest(seed=2, steps=4, negative_prompt="c", true_cfg_scale=3.0),
        GenerationRequest(seed=3, steps=4, prompt="d"),
    ]
    chosen, wave = choose_wave(pending, width=3, lockstep=True)
    assert chosen == [0, 1, 3]
    assert [lane.seed for lane in wave.lanes] == [0, 1, 3]
    chosen, _ = choose_wave(pending[2:], width=2, lockstep=True)
    assert chosen == [0]


def test_independent_wave_mixes_keys_and_leaves_idle_ranks_idle() -> None:
    pending = [request(0), request(1, steps=8)]
    chosen, wave = choose_wave(pending, width=3, lockstep=False)
    assert chosen == [0, 1]
    assert wave.lanes == (pending[0], pending[1], None)
    assert wave.discarded == frozenset()


def test_no_pending_requests_make_an_empty_heartbeat_wave() -> None:
    chosen, wave = choose_wave([], width=2, lockstep=True)
    assert chosen == []
    assert wave.empty
    assert not wave.stop
    assert Wave(stop=True).empty


def test_queue_refuses_requests_until_opened_and_after_closing() -> None:
    queue = RequestQueue(max_pending=4)
    with pytest.raises(IntakeClosedError, match="not accepting"):
        queue.submit(request(0))
    queue.open()
    queue.submit(request(0))
    queue.close()
    with pytest.raises(IntakeClosedError):
        queue.submit(request(1))
    taken, _ = queue.take_wave(width=2, lockstep=False, timeout=0)
    assert [submission.request.seed for submission in taken] == [0]


def test_queue_bounds_waiting_requests_and_keeps_fifo_order() -> None:
    queue = RequestQueue(max_pending=2)
    queue.open()
    queue.submit(request(0, steps=8))
    queue.submit(request(1))
    with pytest.raises(QueueFullError, match="--max-queued-requests"):
        queue.submit(request(2))
    taken, wave = queue.take_wave(width=2, lockstep=True, timeout=0)
    assert [submission.request.seed for submission in taken] == [0]
    assert wave.discarded == frozenset({1})
    assert len(queue) == 1
    taken, _ = queue.take_wave(width=2, lockstep=True, timeout=0)
    assert [submission.request.seed for submission in taken] == [1]
    assert len(queue) == 0


def test_an_idle_queue_waits_for_the_heartbeat_timeout() -> None:
    queue = RequestQueue(max_pending=1)
    queue.open()
    taken, wave = queue.take_wave(width=1, lockstep=False, timeout=0.05)
    assert taken == []
    assert wave.empty
