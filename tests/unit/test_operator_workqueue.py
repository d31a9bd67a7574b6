"""The operator's work queue: a key waits at most once, a key added while processed is
processed again, and workers never hold one key twice (real threads)."""

from __future__ import annotations

import threading
import time

from dlo_operator.workqueue import WorkQueue, start_workers


def test_a_burst_of_adds_for_one_waiting_key_is_one_item() -> None:
    queue = WorkQueue()
    for _ in range(5):
        queue.add("a")
    queue.add("b")
    assert len(queue) == 2
    assert queue.get(0) == "a"
    assert queue.get(0) == "b"
    assert queue.get(0.01) is None


def test_a_key_added_while_processed_is_queued_again_when_done() -> None:
    queue = WorkQueue()
    queue.add("a")
    assert queue.get(0) == "a"
    queue.add("a")  # changed while a worker holds it
    queue.add("a")
    assert len(queue) == 0  # not handed to a second worker meanwhile
    queue.done("a")
    assert queue.get(0) == "a"
    queue.done("a")
    assert queue.get(0.01) is None


def test_workers_process_each_key_alone_and_stop_on_shutdown() -> None:
    queue = WorkQueue()
    active: set[str] = set()
    overlaps: list[str] = []
    processed: list[str] = []
    guard = threading.Lock()

    def work(key: str) -> None:
        with guard:
            if key in active:
                overlaps.append(key)
            active.add(key)
        time.sleep(0.01)
        with guard:
            active.discard(key)
            processed.append(key)
        if key == "fail":
            raise RuntimeError("the API server is restarting")

    threads = start_workers(queue, work, 4, name="test")
    for _ in range(20):
        for key in ("a", "b", "c", "fail"):
            queue.add(key)
        time.sleep(0.002)
    deadline = time.monotonic() + 10
    while (len(queue) or active) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    queue.shut_down()
    for thread in threads:
        thread.join(5)
    assert not overlaps
    assert {"a", "b", "c", "fail"} <= set(processed)
    assert len(processed) < 80  # adds folded while the keys waited
    assert not any(thread.is_alive() for thread in threads)  # every worker stopped


def test_only_pod_events_that_change_what_a_pass_reads_queue_one() -> None:
    from dlo_operator.controller import event_needs_pass
    from dlo_operator.reconcile import ObservedPod

    def pod(phase: str = "Pending", ready: bool = False) -> ObservedPod:
        return ObservedPod("d-e0-n0", 0, 0, "hash", phase, ready, terminating=False)

    seen: dict = {}
    assert not event_needs_pass(seen, "ADDED", "u1", pod())  # our own creation
    assert not event_needs_pass(seen, "MODIFIED", "u1", pod())  # bound to a node
    assert event_needs_pass(seen, "MODIFIED", "u1", pod("Running"))
    assert event_needs_pass(seen, "MODIFIED", "u1", pod("Running", ready=True))
    assert not event_needs_pass(seen, "MODIFIED", "u1", pod("Running", ready=True))
    assert event_needs_pass(seen, "DELETED", "u1", pod("Running", ready=True))
    assert seen == {}
    assert not event_needs_pass(seen, None, "u2", pod("Running"))  # the initial list


def test_only_child_events_that_change_its_configuration_queue_a_pass() -> None:
    from dlo_operator.controller import event_needs_pass
    from dlo_operator.reconcile import ObservedChild

    budget = ObservedChild("PodDisruptionBudget", "d-e0", "hash")
    seen: dict = {}
    assert not event_needs_pass(seen, "ADDED", "u1", budget)  # our own creation
    # The disruption controller writes the budget's status: nothing a pass reads.
    assert not event_needs_pass(seen, "MODIFIED", "u1", budget)
    edited = ObservedChild("PodDisruptionBudget", "d-e0", "")
    assert event_needs_pass(seen, "MODIFIED", "u1", edited)  # someone changed it
    assert event_needs_pass(seen, "DELETED", "u1", edited)
    assert seen == {}
