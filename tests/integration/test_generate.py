"""``dlo-worker generate``: resident generation on the CPU, deterministic to the byte."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from PIL import Image


def generate(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "dlo_worker",
        "generate",
        "--model",
        str(model),
        "--steps",
        "4",
        "--seed",
        "7",
        "--out",
        str(out),
        "--device",
        "cpu",
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_arguments_write_identical_png_bytes(demo_model_dir: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "first.png", tmp_path / "second.png"
    for out in (first, second):
        result = generate(demo_model_dir, out)
        assert result.returncode == 0, result.stderr
        assert f"image written to {out}" in result.stdout
    assert digest(first) == digest(second)
    with Image.open(first) as image:
        assert image.format == "PNG"
        assert image.size == (128, 128)


def test_another_seed_gives_another_image(demo_model_dir: Path, tmp_path: Path) -> None:
    base, other = tmp_path / "base.png", tmp_path / "other.png"
    assert generate(demo_model_dir, base).returncode == 0
    assert generate(demo_model_dir, other, "--seed", "8").returncode == 0
    assert digest(base) != digest(other)


def test_shows_progress_for_loading_and_steps(demo_model_dir: Path, tmp_path: Path) -> None:
    result = generate(demo_model_dir, tmp_path / "image.png")
    assert result.returncode == 0
    assert "Loading pipeline components" in result.stderr
    assert "4/4" in result.stderr


def test_offload_policies_not_in_this_build_exit_2_before_loading(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "never.png"
    result = generate(demo_model_dir, out, "--enable-cpu-offload")
    assert result.returncode == 2
    assert "Loading pipeline components" not in result.stderr
    assert not out.exists()
