"""Requests checked against what the loaded pipeline takes (pure)."""

from __future__ import annotations

from dlo_worker.requests import GenerationRequest, RequestLimits, request_problems

DIT = RequestLimits("DiTPipeline", "class", 1000)
FLUX = RequestLimits("FluxPipeline", "prompt")


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
