"""The suite's time budget: pytest fails a run whose wall time exceeds it, naming the tests
that took longest, so a slow test is noticed the day it lands, not when CI runs out.

The test command sets ``DLO_PYTEST_BUDGET_S`` (1200 s: pytest within 20 minutes on a
two-core machine); pytest run by hand has no budget unless it is set. Times are summed per
test over its setup, call and teardown (a module's shared fixture counts towards the test
that first needs it), as the reports of every pytest-xdist worker reach the controller.
"""

from __future__ import annotations

import os
import time

import pytest

BUDGET_VARIABLE = "DLO_PYTEST_BUDGET_S"
SLOWEST_SHOWN = 10


def budget_from_environment() -> float | None:
    """The budget in seconds, or None when none is set."""
    text = os.environ.get(BUDGET_VARIABLE, "").strip()
    if not text:
        return None
    try:
        budget = float(text)
    except ValueError:
        raise pytest.UsageError(
            f"{BUDGET_VARIABLE}={text!r} is not a number of seconds; set it to e.g. 1200"
        ) from None
    if budget <= 0:
        raise pytest.UsageError(f"{BUDGET_VARIABLE}={text!r} must be positive")
    return budget


def over_budget_lines(
    wall_s: float, budget_s: float, durations: dict[str, float], shown: int = SLOWEST_SHOWN
) -> list[str]:
    """What the run prints when it is over budget (pure): the verdict and the slowest tests."""
    lines = [
        f"pytest took {wall_s:.0f} s, over its budget of {budget_s:.0f} s "
        f"({BUDGET_VARIABLE}); the {shown} slowest tests (setup + call + teardown):"
    ]
    slowest = sorted(durations.items(), key=lambda item: item[1], reverse=True)[:shown]
    lines += [f"  {seconds:7.1f} s  {nodeid}" for nodeid, seconds in slowest]
    return lines


def pytest_configure(config: pytest.Config) -> None:
    """Keep the budget in the process that reports: the pytest-xdist controller, not its
    workers (``tests/conftest.py`` takes this hook; ``-p tests.support.budget`` loads it
    into any other pytest run)."""
    budget_s = budget_from_environment()
    if budget_s is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteBudget(budget_s), "dlo-suite-budget")


class SuiteBudget:
    """The plugin :func:`pytest_configure` registers."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.started = time.monotonic()
        self.durations: dict[str, float] = {}
        self.verdict: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        wall_s = time.monotonic() - self.started
        if wall_s > self.budget_s:
            self.verdict = over_budget_lines(wall_s, self.budget_s, self.durations)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.verdict:
            terminalreporter.section("suite budget", sep="=", red=True, bold=True)
            for line in self.verdict:
                terminalreporter.write_line(line)
