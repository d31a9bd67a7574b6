"""Reconcile passes over one deployment never overlap, and requests that arrive during a
pass fold into exactly one more pass (real threads)."""

from __future__ import annotations

import threading

import pytest

from dlo_operator.coalesce import Coalescer


def test_requests_during_a_pass_fold_into_one_more_pass() -> None:
    coalescer = Coalescer()
    inside, release = threading.Event(), threading.Event()
    passes: list[int] = []

    def work() -> int:
        passes.append(len(passes))
        if len(passes) == 1:
            inside.set()
            release.wait(10)
        return len(passes)

    first: list[int | None] = []
    runner = threading.Thread(target=lambda: first.append(coalescer.run("d", work)))
    runner.start()
    assert inside.wait(10)
    # Five events while the first pass runs: each returns at once.
    assert [coalescer.run("d", work) for _ in range(5)] == [None] * 5
    release.set()
    runner.join(10)
    assert passes == [0, 1]  # the first pass and exactly one repeat
    assert first == [2]  # the caller that ran them gets the last result
    # Another key is independent, and a later request runs its own pass.
    assert coalescer.run("other", lambda: "x") == "x"
    assert coalescer.run("d", work) == 3


def test_a_failed_pass_ends_the_run_and_the_next_request_runs_again() -> None:
    coalescer = Coalescer()

    def fail() -> None:
        raise RuntimeError("the API server is restarting")

    with pytest.raises(RuntimeError):
        coalescer.run("d", fail)
    assert coalescer.run("d", lambda: "ok") == "ok"
    coalescer.forget("d")
    assert coalescer.run("d", lambda: "fresh") == "fresh"
