"""Shared fixtures: the demo model is written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlo_worker.process.numerics import pin_cpu_blas_numerics

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


_CLUSTER_TESTS = Path(__file__).parent / "cluster"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/gpu carries the ``gpu`` marker, so `pytest -m gpu` runs the
    accelerator tier alone and `-m "not gpu"` leaves it out on a machine with a GPU.

    Each test also carries the ``xdist_group`` that `pytest -n N --dist loadgroup` (the
    test command) keeps on one worker: the whole cluster tier is one group, since its
    control planes and real nodes are per-process session fixtures and two real-node
    clusters must never run at once (they share the nodes' containerd stores); any other
    module is a group of its own, so its module-scoped fixtures (a written model, a warm
    cache, a running server) are built once."""
    for item in items:
        if item.path.is_relative_to(_GPU_TESTS):
            item.add_marker(pytest.mark.gpu)
        group = "cluster" if item.path.is_relative_to(_CLUSTER_TESTS) else item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))
