"""``dlo-worker generate``: resident generation on the CPU, deterministic to the byte."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.support.in_process import CliRun, run_dlo_worker


def _generate_command(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "generate",
        "--model",
        str(model),
        "--steps",
        "4",
        "--seed",
        "7",
        "--out",
        str(out) if str(out) != "." else "",
        "--device",
        "cpu",
        *extra,
    ]


def _generate_argv(model: Path, out: Path, *extra: str) -> list[str]:
    """The command line of a process of its own (its umask, its mount namespace)."""
    return [sys.executable, "-m", "dlo_worker", *_generate_command(model, out, *extra)]


def generate(model: Path, out: Path, *extra: str) -> CliRun:
    return run_dlo_worker(_generate_command(model, out, *extra))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def default_run(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[CliRun, Path]:
    """One ``generate`` with the default arguments (several tests read its image and log)."""
    out = tmp_path_factory.mktemp("default") / "image.png"
    return generate(demo_model_dir, out), out


def test_same_arguments_write_identical_png_bytes(
    demo_model_dir: Path, default_run: tuple[CliRun, Path], tmp_path: Path
) -> None:
    first_run, first = default_run
    second = tmp_path / "second.png"
    second_run = generate(demo_model_dir, second)
    for result, out in ((first_run, first), (second_run, second)):
        assert result.returncode == 0, result.stderr
        assert f"image written to {out}" in result.stdout
    assert digest(first) == digest(second)
    with Image.open(first) as image:
        assert image.format == "PNG"
        assert image.size == (128, 128)


def test_another_seed_gives_another_image(
    demo_model_dir: Path, default_run: tuple[CliRun, Path], tmp_path: Path
) -> None:
    result, base = default_run
    other = tmp_path / "other.png"
    assert result.returncode == 0
    assert generate(demo_model_dir, other, "--seed", "8").returncode == 0
    assert digest(base) != digest(other)


def test_shows_progress_for_loading_and_steps(
    default_run: tuple[CliRun, Path],
) -> None:
    result, _ = default_run
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


def _refused_before_loading(result: CliRun, named: str) -> None:
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert "Loading pipeline components" not in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unusable_out_path_exits_2_before_loading(demo_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a-directory").mkdir()
    regular = tmp_path / "regular.txt"
    regular.write_text("x")
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    cases = {
        "": "--out is empty",
        str(tmp_path / "a-directory"): "is a directory",
        str(regular / "image.png"): "is not a directory",
        str(fifo): "is not a regular file",
        str(tmp_path / "missing" / "image.png"): "does not exist; create it, or add --make-parents",
        # Longer than NAME_MAX, and short enough itself but not with the atomic write's
        # temporary name beside it (both ended in ENAMETOOLONG, the first one after loading).
        str(tmp_path / ("x" * 296 + ".png")): "is too long for its file system",
        str(tmp_path / ("y" * 246 + ".png")): "is too long for its file system",
    }
    for out, named in cases.items():
        _refused_before_loading(generate(demo_model_dir, Path(out) if out else Path("")), named)
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # never replaced


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_a_read_only_out_directory_exits_2_before_loading(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "read-only"
    directory.mkdir()
    script = 'mount -t tmpfs -o ro tmpfs "$1" && shift && exec "$@"'
    command = [sys.executable, "-m", "dlo_worker", "generate", "--model", str(demo_model_dir)]
    result = subprocess.run(
        [
            *("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"),
            *(str(directory), *command, "--device", "cpu", "--out", str(directory / "x.png")),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    _refused_before_loading(result, "is not writable")


def test_the_png_follows_the_umask_or_keeps_an_existing_files_mode(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    new = tmp_path / "new.png"
    result = subprocess.run(
        ["sh", "-c", 'umask 027 && exec "$@"', "sh", *_generate_argv(demo_model_dir, new)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(new.stat().st_mode) == 0o640
    existing = tmp_path / "existing.png"
    existing.write_bytes(b"old")
    existing.chmod(0o644)
    assert generate(demo_model_dir, existing).returncode == 0
    assert stat.S_IMODE(existing.stat().st_mode) == 0o644
    assert existing.read_bytes().startswith(b"\x89PNG")


def test_make_parents_creates_the_missing_directories(demo_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "image.png"
    result = generate(demo_model_dir, out, "--make-parents")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--class-label", "5000"), "class_label: 5000 is not a class of this model (0-999)"),
        (("--prompt", "a cat"), "prompt: DiTPipeline is class-conditional and takes no prompt"),
        (("--guidance-scale", "1e30"), "--guidance-scale"),
    ],
    ids=["class-out-of-range", "prompt-on-dit", "huge-guidance"],
)
def test_requests_the_model_cannot_take_exit_2(
    demo_model_dir: Path, tmp_path: Path, flags: tuple[str, ...], says: str
) -> None:
    result = generate(demo_model_dir, tmp_path / "x.png", *flags)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr
    assert "Loading pipeline components" not in result.stderr  # refused before loading
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--width", "100"), "width: 100 is not a multiple of 8"),
        (("--height", "4096"), "height: 4096 is not a multiple of 8 from 8 to 1024"),
        (("--class-label", "3"), "class_label: FluxPipeline is conditioned on a prompt"),
    ],
    ids=["width-not-a-patch-multiple", "height-too-large", "class-label-on-flux"],
)
def test_sizes_and_fields_are_checked_before_the_weights_load(
    flux_model_dir: Path, tmp_path: Path, flags: tuple[str, ...], says: str
) -> None:
    """Sizes were validated only after the model loaded (minutes for a large one)."""
    result = generate(flux_model_dir, tmp_path / "x.png", "--prompt", "a cat", *flags)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert "Loading pipeline components" not in result.stderr
    assert "Traceback" not in result.stderr
