"""Fixtures of the integration tests that several modules share."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.checkpoints import add_foreign_tensor, copy_pipeline
from tests.support.generate import ENV, digest, generate_argv
from tests.support.runtime_cache import SEED, cache_warm


@pytest.fixture(scope="session")
def mixed_model(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo with a foreign tensor in its DiT checkpoint: checkpoint mmap is refused
    ("mixed"), so the ordinary tensors go through the runtime cache (read-only for tests)."""
    return add_foreign_tensor(copy_pipeline(demo_model_dir, tmp_path_factory.mktemp("m") / "m"))


@pytest.fixture(scope="session")
def resident_digest(mixed_model: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest of the resident image of :data:`SEED` on ``mixed_model``."""
    out = tmp_path_factory.mktemp("resident") / "resident.png"
    result = subprocess.run(
        generate_argv(mixed_model, out, SEED), env=ENV, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return digest(out)


@pytest.fixture(scope="session")
def warm_root(mixed_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A cache root holding one entry built by ``cache warm`` (copy it before changing it)."""
    root = tmp_path_factory.mktemp("warm") / "cache"
    warm = cache_warm(mixed_model, root)
    assert warm.returncode == 0, warm.stderr
    return root, json.loads(warm.stdout)["key"]


@pytest.fixture
def cache_root(warm_root: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """A private copy of :func:`warm_root` (modification times kept, as the manifest
    records them)."""
    root, key = warm_root
    copy = tmp_path / "cache"
    shutil.copytree(root, copy, symlinks=True)
    return copy, key
