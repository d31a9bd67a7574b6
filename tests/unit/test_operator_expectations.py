"""Pod expectations: what a pass sees of Pods it is creating or deleting before the watch
shows them (the index a pass reads lags its own actions)."""

from __future__ import annotations

import dataclasses

from dlo_operator.expectations import PodExpectations
from dlo_operator.reconcile import ObservedPod

KEY = ("team", "flux")


def _pod(name: str, *, phase: str = "Pending", terminating: bool = False) -> ObservedPod:
    return ObservedPod(
        name=name,
        engine=0,
        node_rank=int(name[-1]),
        spec_hash="h",
        phase=phase,
        ready=False,
        terminating=terminating,
    )


def test_a_pod_being_created_is_seen_until_its_watch_event_arrives() -> None:
    expectations = PodExpectations()
    running = _pod("flux-0-0", phase="Running")
    expectations.creating(KEY, _pod("flux-0-1"), now=0.0)
    # The index shows rank 0 only: without the expectation this reads as a lost rank.
    assert expectations.overlay(KEY, [running], now=1.0) == [running, _pod("flux-0-1")]
    expectations.observed(KEY, "ADDED", _pod("flux-0-1"))
    assert expectations.overlay(KEY, [running], now=1.0) == [running]


def test_an_event_that_arrives_before_the_create_call_returns_still_ends_it() -> None:
    """Recorded before the call: the event cannot slip in before the record."""
    expectations = PodExpectations()
    expectations.creating(KEY, _pod("flux-0-0"), now=0.0)
    expectations.observed(KEY, "ADDED", _pod("flux-0-0"))
    # Later the Pod is deleted and the index drops it: no phantom Pod remains.
    expectations.observed(KEY, "DELETED", _pod("flux-0-0", terminating=True))
    assert expectations.overlay(KEY, [], now=1.0) == []


def test_a_refused_creation_or_deletion_leaves_no_expectation() -> None:
    expectations = PodExpectations()
    live = _pod("flux-0-1", phase="Running")
    expectations.creating(KEY, _pod("flux-0-0"), now=0.0)
    expectations.deleting(KEY, "flux-0-1", now=0.0)
    expectations.failed(KEY, "flux-0-0")
    expectations.failed(KEY, "flux-0-1")
    assert expectations.overlay(KEY, [live], now=1.0) == [live]


def test_a_pod_being_deleted_reads_as_terminating_until_the_watch_says_so() -> None:
    expectations = PodExpectations()
    live = _pod("flux-0-0", phase="Running")
    expectations.deleting(KEY, "flux-0-0", now=0.0)
    assert expectations.overlay(KEY, [live], now=1.0) == [
        dataclasses.replace(live, terminating=True)
    ]
    # A status event from before the deletion keeps the expectation.
    expectations.observed(KEY, "MODIFIED", live)
    assert expectations.overlay(KEY, [live], now=1.0)[0].terminating
    expectations.observed(KEY, "MODIFIED", dataclasses.replace(live, terminating=True))
    assert expectations.overlay(KEY, [live], now=1.0) == [live]


def test_creating_a_name_again_ends_the_old_pods_deletion() -> None:
    """The old Pod's DELETED event may have come before its deletion was recorded."""
    expectations = PodExpectations()
    expectations.deleting(KEY, "flux-0-0", now=0.0)
    expectations.creating(KEY, _pod("flux-0-0"), now=1.0)
    expectations.observed(KEY, "ADDED", _pod("flux-0-0"))
    assert expectations.overlay(KEY, [_pod("flux-0-0")], now=2.0) == [_pod("flux-0-0")]


def test_expectations_lapse_after_the_timeout_and_are_per_deployment() -> None:
    expectations = PodExpectations(timeout_s=60.0)
    expectations.creating(KEY, _pod("flux-0-0"), now=0.0)
    expectations.deleting(KEY, "flux-0-1", now=0.0)
    other = ("team", "wan")
    assert expectations.overlay(other, [], now=1.0) == []
    assert expectations.overlay(KEY, [_pod("flux-0-1")], now=59.0) == [
        _pod("flux-0-1", terminating=True),
        _pod("flux-0-0"),
    ]
    assert expectations.overlay(KEY, [_pod("flux-0-1")], now=60.0) == [_pod("flux-0-1")]
    expectations.creating(KEY, _pod("flux-0-0"), now=100.0)
    expectations.forget(KEY)
    assert expectations.overlay(KEY, [], now=101.0) == []


def test_a_lapsed_expectation_is_reported_until_a_pass_drops_it() -> None:
    """No event ends it, so the timer must run the pass it held back."""
    expectations = PodExpectations(timeout_s=60.0)
    expectations.deleting(KEY, "flux-0-1", now=0.0)
    expectations.creating(KEY, _pod("flux-0-0"), now=30.0)
    assert not expectations.lapsed(KEY, now=59.0)
    assert expectations.lapsed(KEY, now=60.0)
    assert not expectations.lapsed(("team", "wan"), now=60.0)
    expectations.overlay(KEY, [], now=60.0)  # the pass
    assert not expectations.lapsed(KEY, now=60.0)
    assert expectations.lapsed(KEY, now=90.0)
