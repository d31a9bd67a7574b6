"""The trained DiT demo's pictures and the measurement that checks a drawn image against them."""

from __future__ import annotations

import pytest
import torch

from dlo_worker.pipeline.drawings import DRAWINGS, Drawing, recognise, render


@pytest.mark.parametrize("drawing", DRAWINGS, ids=lambda d: d.description)
def test_each_picture_is_recognised_as_itself(drawing: Drawing) -> None:
    assert recognise(render(drawing, 128)) == drawing


def test_a_picture_with_noise_is_still_recognised_and_another_is_not_it() -> None:
    drawing = Drawing("circle", "red", "blue")
    noisy = (
        render(drawing, 64)
        + 0.08 * torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(0))
    ).clamp(0, 1)
    assert recognise(noisy) == drawing
    assert recognise(render(Drawing("square", "red", "blue"), 64)) != drawing


def test_class_labels_name_each_drawing_once() -> None:
    assert len(DRAWINGS) == 22
    assert len({d.description for d in DRAWINGS}) == len(DRAWINGS)
    assert [d.class_label for d in DRAWINGS] == list(range(len(DRAWINGS)))
    assert Drawing("square", "yellow", "black").class_label == 20
