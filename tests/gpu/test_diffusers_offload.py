"""diffusers' own offload modes when DLO is off: ``generate`` with ``--enable-cpu-offload``
(model-level) and ``--enable-layerwise-offload`` (group offloading of the DiT, block
level, with streams) writes the image a resident run writes, for the class-conditional DiT
demo and the text-to-image Flux demo, and logs which components it offloaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.generate import digest

ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
REQUESTS = {
    "dit": ["--seed", "3", "--steps", "4"],
    "flux": ["--prompt", "a red cat", "--seed", "3", "--steps", "4"],
}


def run(model: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    command = ["generate", "--model", str(model), "--out", str(out), "--device", "cuda"]
    return subprocess.run(
        [sys.executable, "-m", "dlo_worker", *command, "--log-level", "info", *flags],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def generate(model: Path, out: Path, *flags: str) -> str:
    result = run(model, out, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.parametrize(
    ("kind", "flag"),
    [
        ("dit", "--enable-cpu-offload"),
        ("flux", "--enable-cpu-offload"),
        ("flux", "--enable-layerwise-offload"),
    ],
)
def test_a_diffusers_offload_mode_writes_the_resident_image(
    kind: str, flag: str, demo_model_dir: Path, flux_model_dir: Path, tmp_path: Path
) -> None:
    model = demo_model_dir if kind == "dit" else flux_model_dir
    generate(model, tmp_path / "resident.png", *REQUESTS[kind])
    log = generate(model, tmp_path / "offloaded.png", *REQUESTS[kind], flag)
    (line,) = [line for line in log.splitlines() if 'msg="diffusers offload enabled"' in line]
    assert f"mode={flag}" in line
    components = line.split("components=", 1)[1].split()[0]
    assert "transformer" in components.split(",")
    if flag == "--enable-cpu-offload":
        assert "vae" in components.split(",")  # every component, not only the DiT
    else:
        assert components == "transformer"
    assert digest(tmp_path / "offloaded.png") == digest(tmp_path / "resident.png")


def test_group_offloading_of_a_dit_class_diffusers_does_not_support_is_refused(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """DiTTransformer2DModel sets ``_supports_group_offloading = False``."""
    result = run(demo_model_dir, tmp_path / "x.png", "--enable-layerwise-offload")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "does not support DiTTransformer2DModel (transformer)" in result.stderr
    assert not (tmp_path / "x.png").exists()
