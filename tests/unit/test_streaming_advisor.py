"""The worker's check of its device plan after each request (``StreamingAdvisor``): the
stats of a real DLO backend, as successive requests would leave them. The first request
(blocks loaded on demand while DLO learns their order) never counts; a steady request
whose copy waits exceed T5-XXL's copy advises it streamed, once, with a log line and the
``dlo_streaming_advised`` gauge. On the CPU a block's copy runs before the measured wait,
so the requests' waits here are an H100's at a 24 GiB budget (about 3.4 s per image);
tests/gpu serves the full-size pipeline and checks the advice end to end."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from dlo_worker.loader.device_plan import GIB, DevicePlan, plan_device_memory
from dlo_worker.observability import metrics
from dlo_worker.offload import DistributedLayerwiseOffloadBackend, OffloadConfig
from dlo_worker.offload.stats import OffloadStats
from dlo_worker.process.device_budget import (
    TEXT_ENCODER_COMPONENTS,
    StreamingAdvisor,
    may_advise,
)
from tests.support.flux_sizes import FLUX, T5_COPY_SECONDS


@pytest.fixture
def stats() -> OffloadStats:
    """A real backend's stats at start (nothing streamed yet)."""
    backend = DistributedLayerwiseOffloadBackend(
        OffloadConfig(use_allgather=False), torch.device("cpu")
    )
    return backend.stats()


def after(stats: OffloadStats, *, waited: float, on_demand: int = 0) -> OffloadStats:
    """``stats`` after one more request that waited ``waited`` s for copies at 55 GB/s."""
    return dataclasses.replace(
        stats,
        exposed_wait_seconds=stats.exposed_wait_seconds + waited,
        on_demand_loads=stats.on_demand_loads + on_demand,
        h2d_gbps=55.0,
    )


def plan_at(budget_gib: int) -> DevicePlan:
    return plan_device_memory(
        FLUX,
        budget_gib * GIB,
        dits=("transformer",),
        text_encoders=TEXT_ENCODER_COMPONENTS,
    )


def advisor_at(budget_gib: int) -> StreamingAdvisor:
    return StreamingAdvisor(plan_at(budget_gib))


def advised() -> float:
    return metrics.STREAMING_ADVISED.labels(component="text_encoder_2")._value.get()


def test_a_copy_bound_steady_request_advises_streaming_t5_once(
    stats: OffloadStats, caplog: pytest.LogCaptureFixture
) -> None:
    metrics.STREAMING_ADVISED.labels(component="text_encoder_2").set(0)
    caplog.set_level(logging.INFO, logger="dlo_worker")
    advisor = advisor_at(24)
    advisor.after_request(stats)  # the worker's first reading: a baseline
    first = after(stats, waited=30.0, on_demand=57)
    advisor.after_request(first)
    assert advisor.advice is None, "the first request loads blocks on demand: not counted"
    assert advised() == 0
    second = after(first, waited=3.4)
    advisor.after_request(second)
    advice = advisor.advice
    assert advice is not None
    assert advice.component == "text_encoder_2"
    assert advice.copy_wait_seconds == pytest.approx(3.4)
    assert advice.stream_seconds == pytest.approx(T5_COPY_SECONDS)
    assert advised() == 1
    advisor.after_request(after(second, waited=3.4))
    lines = [r for r in caplog.records if r.getMessage().startswith("placement advice")]
    assert len(lines) == 1, "said once"
    assert lines[0].fields["fix"].startswith("--dlo-stream-text-encoders text_encoder_2")


def test_a_step_that_hides_its_copies_advises_nothing(stats: OffloadStats) -> None:
    advisor = advisor_at(24)
    advisor.after_request(stats)
    advisor.after_request(after(stats, waited=0.05))
    assert advisor.advice is None


def test_where_t5_streams_already_nothing_is_advised(stats: OffloadStats) -> None:
    advisor = advisor_at(12)
    advisor.after_request(stats)
    advisor.after_request(after(stats, waited=30.0))
    assert advisor.advice is None


def test_the_worker_keeps_an_advisor_only_where_one_could_advise() -> None:
    assert may_advise(plan_at(24))  # DiT streamed, T5 resident
    assert not may_advise(plan_at(12))  # T5 streamed already
    assert not may_advise(plan_at(80))  # nothing streams
