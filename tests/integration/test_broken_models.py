"""Broken pipeline directories exit 2 naming the file and the fix, before any generation
(each case ended in a traceback, or loaded silently, before these checks)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.checkpoints import copy_pipeline
from tests.support.generate import ENV, generate_argv


def _drop_config(model: Path) -> Path:
    (model / "transformer" / "config.json").unlink()
    return model / "transformer" / "config.json"


def _invalid_config(model: Path) -> Path:
    (model / "transformer" / "config.json").write_text("{not json")
    return model / "transformer" / "config.json"


def _layers(delta: int) -> Callable[[Path], Path]:
    def change(model: Path) -> Path:
        path = model / "transformer" / "config.json"
        config = json.loads(path.read_text())
        config["num_layers"] += delta
        path.write_text(json.dumps(config))
        return model / "transformer"

    return change


def _drop_weights(model: Path) -> Path:
    (model / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    return model / "transformer"


def _truncate_vae(keep: int | None) -> Callable[[Path], Path]:
    def truncate(model: Path) -> Path:
        path = model / "vae" / "diffusion_pytorch_model.safetensors"
        data = path.read_bytes()
        path.write_bytes(data[:keep] if keep is not None else data[:-100])
        return path

    return truncate


CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing-config": (_drop_config, "missing"),
    "invalid-config": (_invalid_config, "not valid JSON"),
    "one-layer-too-many": (_layers(+1), "config.json describes"),
    "one-layer-too-few": (_layers(-1), "that config.json does not describe"),
    "missing-weights": (_drop_weights, "no weights"),
    "truncated-vae-header": (_truncate_vae(1000), "not a readable safetensors file"),
    "truncated-vae-data": (_truncate_vae(None), "the file is truncated"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_broken_model_exits_2_naming_the_file_before_loading(
    demo_model_dir: Path, tmp_path: Path, case: str
) -> None:
    breaks, says = CASES[case]
    model = copy_pipeline(demo_model_dir, tmp_path / "model")
    named = breaks(model)
    result = subprocess.run(
        generate_argv(model, tmp_path / "x.png", 0),
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert f"{named}" in result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr
    assert "Loading pipeline components" not in result.stderr
    assert not (tmp_path / "x.png").exists()
