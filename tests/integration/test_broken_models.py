"""Broken pipeline directories exit 2 naming the file and the fix, before any generation
(each case ended in a traceback, or loaded silently, before these checks)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import copy_pipeline
from tests.support.generate import run_generate
from tests.support.in_process import CliRun


def _generate(model: Path, out: Path, *flags: str) -> CliRun:
    return run_generate(model, out, 0, *flags)


def _assert_refused(result: CliRun, out: Path, *says: str, status: int = 2) -> None:
    """The run exited ``status``, its log says each of ``says``, and it left no traceback and
    no image."""
    assert result.returncode == status, result.stderr
    for text in says:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


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


def _variant_only_weights(model: Path) -> Path:
    """As a download with ``variant="fp16"`` leaves a component."""
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_name("diffusion_pytorch_model.fp16.safetensors"))
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
    "variant-only-weights": (
        _variant_only_weights,
        "only variant weights (diffusion_pytorch_model.fp16.safetensors)",
    ),
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
    _assert_refused(result, tmp_path / "x.png", str(named), says)
    assert "Loading pipeline components" not in result.stderr


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
    _assert_refused(
        result,
        tmp_path / "x.png",
        f"{model / 'transformer'}: ",
        "hold NaN or infinity (first: 'transformer_blocks.3.",
    )


def test_an_image_that_overflows_exits_1_instead_of_writing_a_black_png(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    model = copy_pipeline(demo_model_dir, tmp_path / "model")
    _fill_block(model, 3e38)  # finite weights, overflowing activations
    result = _generate(model, tmp_path / "x.png")
    _assert_refused(
        result, tmp_path / "x.png", "the decoded image holds", "NaN or infinite", status=1
    )


def _generate_flux(model: Path, out: Path, *flags: str) -> CliRun:
    return run_generate(
        model, out, 0, "--prompt", "a cat", "--width", "64", "--height", "64", *flags
    )


def _remove(relative: str) -> Callable[[Path], Path]:
    def remove(model: Path) -> Path:
        path = model / relative
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        return path.parent if path.name == "tokenizer.json" else path

    return remove


def _truncate(relative: str) -> Callable[[Path], Path]:
    def truncate(model: Path) -> Path:
        path = model / relative
        path.write_bytes(path.read_bytes()[:-100])
        return path

    return truncate


def _break_json(relative: str) -> Callable[[Path], Path]:
    def damage(model: Path) -> Path:
        path = model / relative
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
        return path.parent

    return damage


def _edit_json(relative: str, change: Callable[[dict], None], named: str) -> Callable[[Path], Path]:
    def edit(model: Path) -> Path:
        path = model / relative
        value = json.loads(path.read_text())
        change(value)
        path.write_text(json.dumps(value))
        return model / named

    return edit


def _rename_class(index: dict) -> None:
    index["text_encoder"] = ["transformers", "CLIPTextModelThatDoesNotExist"]


def _rename_pipeline(index: dict) -> None:
    index["_class_name"] = "FluxPipelineThatDoesNotExist"


def _bad_scheduler(config: dict) -> None:
    config["num_train_timesteps"] = -5


def _tokenizer_of_a_larger_vocabulary(model: Path) -> Path:
    """A CLIP tokenizer with a token beyond the CLIP encoder's embedding (a tokenizer of
    another model: its ids index past the table, or wrap into other tokens)."""
    path = model / "tokenizer" / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["model"]["vocab"]["zzzz</w>"] = 9999
    path.write_text(json.dumps(tokenizer))
    return model / "tokenizer"


FLUX_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    # Each loaded a fallback or garbled component and generated (exit 0), or ended in a
    # traceback that did not name the file.
    "tokenizer-json-missing": (_remove("tokenizer/tokenizer.json"), "loaded no vocabulary"),
    "tokenizer-2-missing": (_remove("tokenizer_2"), "the component model_index.json names"),
    "tokenizer-json-broken": (_break_json("tokenizer/tokenizer.json"), "cannot load"),
    "tokenizer-of-another-model": (_tokenizer_of_a_larger_vocabulary, "ids up to 9999"),
    "text-encoder-truncated": (_truncate("text_encoder/model.safetensors"), "truncated"),
    "text-encoder-config-missing": (_remove("text_encoder/config.json"), "missing"),
    "unknown-component-class": (
        _edit_json("model_index.json", _rename_class, "model_index.json"),
        "CLIPTextModelThatDoesNotExist",
    ),
    "unknown-pipeline-class": (
        _edit_json("model_index.json", _rename_pipeline, "model_index.json"),
        "FluxPipelineThatDoesNotExist",
    ),
    "bad-scheduler-config": (
        _edit_json("scheduler/scheduler_config.json", _bad_scheduler, "scheduler"),
        "scheduler_config.json",
    ),
}


@pytest.mark.parametrize("case", FLUX_CASES)
def test_a_broken_component_exits_2_naming_it_before_any_weight_loads(
    flux_model_dir: Path, tmp_path: Path, case: str
) -> None:
    breaks, says = FLUX_CASES[case]
    model = copy_pipeline(flux_model_dir, tmp_path / "model")
    named = breaks(model)
    result = _generate_flux(model, tmp_path / "x.png")
    _assert_refused(result, tmp_path / "x.png")
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("dlo-worker generate:")]
    assert str(named) in line, line
    assert says in line, line
    assert "Loading pipeline components" not in result.stderr


def _store_as(dtype: torch.dtype) -> Callable[[Path], Path]:
    def store(model: Path) -> Path:
        from safetensors.torch import load_file, save_file

        path = model / "transformer" / "diffusion_pytorch_model.safetensors"
        state = load_file(path)
        key = next(
            k for k in sorted(state) if k.startswith("transformer_blocks.0.") and "weight" in k
        )
        state[key] = state[key].to(dtype)
        save_file(state, path, metadata={"format": "pt"})
        return path

    return store


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.bool, torch.float8_e4m3fn], ids=["int32", "bool", "float8"]
)
@pytest.mark.parametrize("dlo", [False, True], ids=["resident", "dlo"])
def test_dit_weights_stored_in_a_dtype_the_model_cannot_run_are_refused(
    demo_model_dir: Path, tmp_path: Path, dtype: torch.dtype, dlo: bool
) -> None:
    model = copy_pipeline(demo_model_dir, tmp_path / "model")
    named = _store_as(dtype)(model)
    flags = ("--enable-distributed-layerwise-offload", "--dlo-no-use-allgather") if dlo else ()
    result = _generate(model, tmp_path / "x.png", *flags)
    _assert_refused(result, tmp_path / "x.png", f"{named}: ", str(dtype).removeprefix("torch."))


@pytest.mark.parametrize(
    "flags",
    [
        ("--enable-distributed-layerwise-offload", "--dlo-no-use-allgather"),
        ("--enable-distributed-layerwise-offload",),
    ],
    ids=["dlo-rank-local", "dlo-allgather-world-1"],
)
def test_non_finite_weights_of_a_checkpoint_mapped_dit_exit_2_before_any_image(
    demo_model_dir: Path, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """Caught resident, but not when the DiT streams from its checkpoint mapping: every
    request then failed (exit 1; serve ready and answering 500 forever)."""
    model = copy_pipeline(demo_model_dir, tmp_path / "model")
    _fill_block(model, float("inf"))
    result = _generate(model, tmp_path / "x.png", *flags)
    assert "host backing" not in result.stdout
    _assert_refused(
        result,
        tmp_path / "x.png",
        f"{model / 'transformer'}: ",
        "hold NaN or infinity (first: 'transformer_blocks.3.",
    )


def _nan_in_vae(model: Path) -> Path:
    from safetensors.torch import load_file, save_file

    path = model / "vae" / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    key = next(k for k in sorted(state) if k.startswith("decoder.") and k.endswith("weight"))
    state[key][0] = float("nan")
    save_file(state, path, metadata={"format": "pt"})
    return model / "vae"


def test_non_finite_weights_of_any_component_exit_2_naming_it(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    model = copy_pipeline(demo_model_dir, tmp_path / "model")
    named = _nan_in_vae(model)
    result = _generate(model, tmp_path / "x.png")
    _assert_refused(
        result,
        tmp_path / "x.png",
        f"{named}: 1 parameter(s) hold NaN or infinity (first: 'decoder.",
    )
