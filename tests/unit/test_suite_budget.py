"""The suite's budget (tests/support/budget.py): a run over it fails and names its slowest
tests; one within it passes. Each case runs a real pytest session in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.budget import BUDGET_VARIABLE, over_budget_lines

SLOW_SUITE = """
import time

def test_slow():
    time.sleep(1.2)

def test_fast():
    pass
"""

CONFTEST = """
from tests.conftest import pytest_configure  # the suite's own registration
"""


PYTEST = (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.support.budget")


def run_suite(directory: Path, budget: str) -> subprocess.CompletedProcess[str]:
    (directory / "test_suite.py").write_text(SLOW_SUITE)
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [*PYTEST, "-q", str(directory)],
        cwd=directory,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), BUDGET_VARIABLE: budget},
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_run_over_its_budget_fails_and_names_the_slowest_tests(tmp_path: Path) -> None:
    result = run_suite(tmp_path, "1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 passed" in result.stdout
    assert "over its budget of 1 s (DLO_PYTEST_BUDGET_S)" in result.stdout
    slowest = result.stdout.split("slowest tests")[1].splitlines()[1:3]
    assert "test_suite.py::test_slow" in slowest[0]
    assert "test_suite.py::test_fast" in slowest[1]


def test_a_run_within_its_budget_passes(tmp_path: Path) -> None:
    result = run_suite(tmp_path, "600")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "budget" not in result.stdout


def test_a_budget_that_is_no_number_is_refused_naming_the_variable(tmp_path: Path) -> None:
    result = run_suite(tmp_path, "twenty minutes")
    assert result.returncode == 4  # pytest's usage error
    assert "DLO_PYTEST_BUDGET_S='twenty minutes' is not a number of seconds" in result.stderr


@pytest.mark.parametrize("shown", [1, 3])
def test_the_verdict_lists_the_slowest_tests_first(shown: int) -> None:
    lines = over_budget_lines(1300.4, 1200, {"a": 1.0, "b": 30.0, "c": 2.5}, shown=shown)
    assert lines[0].startswith("pytest took 1300 s, over its budget of 1200 s")
    assert [line.split()[-1] for line in lines[1:]] == ["b", "c", "a"][:shown]
