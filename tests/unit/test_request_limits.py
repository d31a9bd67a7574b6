"""Requests checked against what the loaded pipeline takes (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from dlo_worker.engine.request import (
    GenerationRequest,
    Guidance,
    RequestDefaults,
    RequestLimits,
    defaults_problems,
    request_problems,
)

DIT = RequestLimits("DiTPipeline", "class", 1000, takes_num_images=True, default_size=(256, 256))
FLUX = RequestLimits(
    "FluxPipeline",
    "prompt",
    guidance=Guidance.EMBEDDED,
    takes_negative_prompt=True,
    takes_true_cfg_scale=True,
    takes_size=True,
    takes_num_images=True,
    default_size=(1024, 1024),
    size_multiple=16,
    max_side=2048,
)
SCHNELL = RequestLimits(
    "FluxPipeline",
    "prompt",
    guidance=Guidance.UNUSED,
    takes_negative_prompt=True,
    takes_true_cfg_scale=True,
    takes_size=True,
)
CFG = RequestLimits(
    "StableDiffusion3Pipeline", "prompt", takes_negative_prompt=True, takes_size=True
)
BARE = RequestLimits("SomePipeline", "prompt")


def test_a_class_conditional_model_takes_labels_below_its_class_count() -> None:
    assert request_problems(GenerationRequest(class_label=999), DIT) == []
    (problem,) = request_problems(GenerationRequest(class_label=1000), DIT)
    assert problem == "class_label: 1000 is not a class of this model (0-999)"


def test_conditioning_the_model_does_not_take_is_refused_only_when_sent() -> None:
    assert request_problems(GenerationRequest(), DIT) == []
    assert request_problems(GenerationRequest(), FLUX) == []
    assert request_problems(GenerationRequest(prompt="a cat"), FLUX) == []
    assert request_problems(GenerationRequest(prompt="a cat"), DIT)[0].startswith("prompt: ")
    assert request_problems(GenerationRequest(class_label=3), FLUX)[0].startswith("class_label:")


@pytest.mark.parametrize(
    ("request_fields", "limits", "says"),
    [
        ({"width": 1000}, FLUX, "width: 1000 is not a multiple of 16 from 16 to 2048"),
        ({"height": 4096}, FLUX, "height: 4096 is not a multiple of 16 from 16 to 2048"),
        ({"width": 512}, DIT, "width: DiTPipeline draws 256x256 images only"),
        ({"num_images": 2}, BARE, "num_images: SomePipeline draws one image per request"),
        (
            {"negative_prompt": "x"},
            FLUX,
            "negative_prompt: FluxPipeline uses a negative prompt only with true_cfg_scale > 1",
        ),
        ({"true_cfg_scale": 4.0}, FLUX, "true_cfg_scale: > 1 needs a negative_prompt"),
        (
            {"true_cfg_scale": 4.0, "negative_prompt": "x"},
            CFG,
            "true_cfg_scale: StableDiffusion3Pipeline takes no true_cfg_scale",
        ),
        (
            {"negative_prompt": "x", "guidance_scale": 1.0},
            CFG,
            "negative_prompt: has no effect unless guidance_scale > 1",
        ),
        ({"negative_prompt": "x"}, BARE, "negative_prompt: SomePipeline takes no negative"),
        ({"negative_prompt": "x"}, DIT, "negative_prompt: DiTPipeline is class-conditional"),
        (
            {"guidance_scale": 3.5},
            SCHNELL,
            "guidance_scale: FluxPipeline is not guidance-conditioned",
        ),
    ],
)
def test_fields_the_pipeline_would_ignore_or_reject_are_refused(
    request_fields: dict, limits: RequestLimits, says: str
) -> None:
    problems = request_problems(GenerationRequest(**request_fields), limits)
    assert any(problem.startswith(says) for problem in problems), problems


@pytest.mark.parametrize(
    ("request_fields", "limits"),
    [
        ({"width": 512, "height": 768, "num_images": 4, "prompt": "a cat"}, FLUX),
        ({"negative_prompt": "blur", "true_cfg_scale": 4.0}, FLUX),
        ({"negative_prompt": "blur", "guidance_scale": 7.0}, CFG),
        ({"num_images": 3, "class_label": 5}, DIT),
        ({"width": 2048, "height": 16}, FLUX),
    ],
)
def test_fields_the_pipeline_uses_are_accepted(request_fields: dict, limits: RequestLimits) -> None:
    assert request_problems(GenerationRequest(**request_fields), limits) == []


def test_sequence_parallelism_needs_a_patch_count_that_splits_over_the_sp_ranks() -> None:
    limits = dataclasses.replace(FLUX, token_split=4)
    # 96x48 is 6x3 = 18 patches of 16x16: even, but not a multiple of 4.
    (problem,) = request_problems(GenerationRequest(prompt="x", width=96, height=48), limits)
    assert problem.startswith("width x height: 96x48 is 18 patches of 16x16 pixels")
    assert "4 sequence-parallel ranks" in problem
    assert request_problems(GenerationRequest(prompt="x", width=128, height=48), limits) == []
    # The default size (1024x1024: 4096 patches) splits; only the given side counts with it.
    assert request_problems(GenerationRequest(prompt="x"), limits) == []
    # A side that is not whole patches is reported once, by the size rule.
    (problem,) = request_problems(GenerationRequest(prompt="x", width=100, height=48), limits)
    assert problem.startswith("width: 100 is not a multiple of 16")
    assert (
        request_problems(
            GenerationRequest(prompt="x", width=96, height=48),
            dataclasses.replace(FLUX, token_split=2),
        )
        == []
    )


def test_server_defaults_fill_only_the_fields_a_request_leaves_out() -> None:
    defaults = RequestDefaults(steps=8, width=512)
    filled = defaults.apply(GenerationRequest(seed=3, width=768))
    assert (filled.steps, filled.width, filled.height, filled.seed) == (8, 768, None, 3)
    assert {"steps", "width", "seed"} <= filled.model_fields_set  # checked like sent values
    assert defaults.apply(GenerationRequest(steps=2)).steps == 2


def test_server_defaults_the_pipeline_cannot_take_name_their_flags() -> None:
    assert defaults_problems(RequestDefaults(steps=8, width=512, height=768), FLUX) == []
    (problem,) = defaults_problems(RequestDefaults(width=500), FLUX)
    assert problem.startswith("--default-width: 500 is not a multiple of 16")
    (problem,) = defaults_problems(RequestDefaults(height=256), DIT)
    assert problem.startswith("--default-height: DiTPipeline draws 256x256 images only")


@pytest.mark.parametrize(
    ("loras", "adapters", "problem"),
    [
        ([{"name": "f"}], (), "loras: f fused into the weights at start (--fuse-lora)"),
        ([{"name": "c"}, {"name": "d"}], ("a", "b"), "loras: c, d not loaded; choose from a, b"),
        ([{"name": "a"}, {"name": "a"}], ("a",), "loras: a named more than once; name each once"),
    ],
)
def test_adapters_a_request_names_must_be_loaded_once_each(
    loras: list[dict], adapters: tuple[str, ...], problem: str
) -> None:
    limits = RequestLimits("FluxPipeline", "prompt", adapters=adapters, fused_adapters=("f",))
    problems = request_problems(GenerationRequest.model_validate({"loras": loras}), limits)
    assert len(problems) == 1
    assert problems[0].startswith(problem)


def test_no_adapters_is_every_workers_choice() -> None:
    """``[]`` (a client's, or the default of a server that loads adapters while serving)
    runs none, whatever is loaded."""
    for adapters in ((), ("a",)):
        limits = RequestLimits("FluxPipeline", "prompt", adapters=adapters)
        assert request_problems(GenerationRequest.model_validate({"loras": []}), limits) == []
    refused = request_problems(
        GenerationRequest.model_validate({"loras": [{"name": "a"}]}),
        RequestLimits("FluxPipeline", "prompt"),
    )
    assert refused == [
        "loras: this worker loaded no LoRA adapters; leave loras out, or start it with "
        "--lora NAME=PATH"
    ]


def test_adapters_and_their_scales_are_taken_when_loaded() -> None:
    limits = RequestLimits("FluxPipeline", "prompt", adapters=("a", "b"))
    for loras in ([], [{"name": "a", "scale": -10.0}, {"name": "b", "scale": 10.0}]):
        assert request_problems(GenerationRequest.model_validate({"loras": loras}), limits) == []
