"""The image build's cache keys (pure parts): what goes into an image decides its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.images import IMAGES, image_key


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files the Dockerfiles copy, and the Dockerfiles."""
    for relative in ("pyproject.toml", "README.md", "worker/dlo_worker/a.py", "operator/b.py"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(relative)
    for dockerfile in IMAGES.values():
        (tmp_path / dockerfile).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / dockerfile).write_text("FROM ${BASE_IMAGE}\n")
    return tmp_path


def test_a_changed_source_or_dockerfile_changes_the_key(tree: Path) -> None:
    before = image_key("worker", tree)
    assert image_key("worker", tree) == before  # deterministic
    (tree / "worker/dlo_worker/a.py").write_text("changed")
    after_source = image_key("worker", tree)
    assert after_source != before
    (tree / IMAGES["worker"]).write_text("FROM ${BASE_IMAGE}\nRUN true\n")
    assert image_key("worker", tree) != after_source


def test_bytecode_build_leftovers_and_other_directories_do_not(tree: Path) -> None:
    before = image_key("operator", tree)
    for leftover in (
        "worker/dlo_worker/__pycache__/a.cpython-311.pyc",
        "worker/diffusion_dlo.egg-info/PKG-INFO",
        "tests/test_x.py",
        ".venv/lib/x.py",
    ):
        (tree / leftover).parent.mkdir(parents=True, exist_ok=True)
        (tree / leftover).write_text("x")
    assert image_key("operator", tree) == before
