"""Shared fixtures: the demo model is written once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dlo_worker.process.numerics import pin_cpu_blas_numerics
from tests.support.budget import pytest_configure  # noqa: F401  (the suite's time budget)

# In-process comparisons (tests/support/equivalence.py) run with the worker's CPU numerics.
pin_cpu_blas_numerics()


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo pipeline directory written by the product's own writer (read-only for tests)."""
    from dlo_worker.pipeline.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("models") / "demo", seed=0)


@pytest.fixture(scope="session")
def flux_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The text-to-image demo (a tiny FluxPipeline with CLIP and T5), written by the product."""
    from dlo_worker.pipeline.demo_model import DemoKind, write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("models") / "flux", kind=DemoKind.FLUX)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# tests/gpu runs on the accelerator machine (`pytest tests/gpu`); CI has no GPU.
collect_ignore = [] if _cuda_available() else ["gpu"]

_GPU_TESTS = Path(__file__).parent / "gpu"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/gpu carries the ``gpu`` marker, so `pytest -m gpu` runs the
    accelerator tier alone and `-m "not gpu"` leaves it out on a machine with a GPU."""
    for item in items:
        if item.path.is_relative_to(_GPU_TESTS):
            item.add_marker(pytest.mark.gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How `pytest -n N` (the test command) shares the tests among its workers. The
    control-plane tests of tests/cluster share one worker, and the real-node tier
    (tests/cluster/real_nodes) another: their clusters are per-process session fixtures, and
    two real-node clusters must never run at once (they share the nodes' containerd
    stores). Any other module is a unit of its own, so its module-scoped fixtures (a
    written model, a warm cache, a running server) are built once. (``xdist_group``
    markers would say the same, but pytest 9 ignores the node ids pytest-xdist 3.8
    rewrites for them.)"""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            for tier in ("tests/cluster/real_nodes/", "tests/cluster/"):
                if path.startswith(tier):
                    return tier
            return path

    return TierScheduling(config, log)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line saying how many tests of the real-node tier ran, so a log shows it ran
    (here, not in tests/cluster/conftest.py: under `pytest -n` only this file is loaded in
    the process that prints the summary; the ``real_nodes`` marker travels in the reports)."""
    outcomes: dict[str, int] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            # A collection error's report has no keywords (and is no real-node test).
            if "real_nodes" in getattr(report, "keywords", ()) and (
                report.when == "call" or outcome in ("error", "skipped")
            ):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    if outcomes:
        counts = ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items()))
        terminalreporter.write_line(f"real-node tier: {counts}")
