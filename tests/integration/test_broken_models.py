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


def _generate(model: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        generate_argv(model, out, 0), env=ENV, capture_output=True, text=True, check=False
    )


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
    result = _generate(model, tmp_path / "x.png")
    assert result.returncode == 2, result.stderr
    assert f"{named}" in result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr
    assert "Loading pipeline components" not in result.stderr
    assert not (tmp_path / "x.png").exists()


def _fill_block(model: Path, value: float) -> None:
    from safetensors.torch import load_file, save_file

    path = model / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    for key in state:
        if key.startswith("transformer_blocks.3."):
            state[key].fill_(value)
    save_file(state, path, metadata={"format": "pt"})


def test_non_finite_weights_exit_2_naming_the_tensor(demo_model_dir: Path, tmp_path: Path) -> None:
    model = copy_pipeline(demo_model_dir, tmp_path / "model")
    _fill_block(model, float("nan"))
    result = _generate(model, tmp_path / "x.png")
    assert result.returncode == 2, result.stderr
    assert f"{model / 'transformer'}: " in result.stderr
    assert "hold NaN or infinity (first: 'transformer_blocks.3." in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_an_image_that_overflows_exits_1_instead_of_writing_a_black_png(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    model = copy_pipeline(demo_model_dir, tmp_path / "model")
    _fill_block(model, 3e38)  # finite weights, overflowing activations
    result = _generate(model, tmp_path / "x.png")
    assert result.returncode == 1, result.stderr
    assert "the decoded image holds" in result.stderr
    assert "NaN or infinite" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()
