"""What the trained demos draw: a coloured circle or square, centred, on a plain
background (pure; torch only, no I/O).

The demos' weights (``demo_weights/``, written by ``scripts/train_demo_weights.py``) are
trained on exactly these pictures, the DiT's one per class label, the Flux's one per
:attr:`Drawing.description`, so a newcomer sees that a request was understood, and a
test can check it by measurable properties (:func:`recognise`): the colours of the centre
and of the corners, and which shape's outline the pixels of the centre's colour match
best.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.86, 0.16, 0.16),
    "green": (0.16, 0.70, 0.24),
    "blue": (0.16, 0.31, 0.86),
    "yellow": (0.92, 0.82, 0.16),
}
BACKGROUNDS: dict[str, tuple[float, float, float]] = {
    "white": (0.96, 0.96, 0.96),
    "black": (0.06, 0.06, 0.06),
    "blue": COLOURS["blue"],
}
SHAPES = ("circle", "square")
RADIUS = 0.30
"""A circle's radius and half a square's side, as a fraction of the image's side."""


@dataclass(frozen=True)
class Drawing:
    shape: str
    colour: str
    background: str

    @property
    def description(self) -> str:
        return f"a {self.colour} {self.shape} on a {self.background} background"

    @property
    def class_label(self) -> int:
        """The DiT demo's class label for this drawing."""
        return DRAWINGS.index(self)


DRAWINGS: tuple[Drawing, ...] = tuple(
    Drawing(shape, colour, background)
    for shape, colour, background in itertools.product(SHAPES, COLOURS, BACKGROUNDS)
    if colour != background
)
"""Every drawing the demos were trained on; a drawing's index is its DiT class label, its
description the Flux's prompt."""


def _inside(shape: str, size: int) -> torch.Tensor:
    """Where ``shape`` covers a (size, size) picture."""
    centre = (size - 1) / 2
    coordinates = torch.arange(size, dtype=torch.float32) - centre
    rows, columns = torch.meshgrid(coordinates, coordinates, indexing="ij")
    reach = RADIUS * size
    if shape == "circle":
        return rows**2 + columns**2 <= reach**2
    return (rows.abs() <= reach) & (columns.abs() <= reach)


def render(drawing: Drawing, size: int) -> torch.Tensor:
    """The picture of ``drawing``: (3, size, size), values in [0, 1]."""
    colour = torch.tensor(COLOURS[drawing.colour]).view(3, 1, 1)
    background = torch.tensor(BACKGROUNDS[drawing.background]).view(3, 1, 1)
    return torch.where(_inside(drawing.shape, size), colour, background)


def _nearest(pixel: torch.Tensor, palette: dict[str, tuple[float, float, float]]) -> str:
    return min(palette, key=lambda name: float((pixel - torch.tensor(palette[name])).norm()))


def recognise(image: torch.Tensor) -> Drawing:
    """What ``image`` (3, H, W in [0, 1], square) shows: the palette colours nearest to the
    mean of its centre and of its corners, and the shape whose outline best matches (by
    intersection over union) the pixels nearer that centre colour than that background."""
    size = image.shape[-1]
    patch = max(2, size // 16)
    middle = slice(size // 2 - patch, size // 2 + patch)
    centre = image[:, middle, middle].flatten(1).mean(1)
    corners = torch.cat(
        [image[:, rows, columns].flatten(1) for rows in (slice(None, patch), slice(-patch, None))
         for columns in (slice(None, patch), slice(-patch, None))],
        dim=1,
    ).mean(1)  # fmt: skip
    colour, background = _nearest(centre, COLOURS), _nearest(corners, BACKGROUNDS)
    fill = torch.tensor(COLOURS[colour]).view(3, 1, 1)
    plain = torch.tensor(BACKGROUNDS[background]).view(3, 1, 1)
    covered = (image - fill).norm(dim=0) < (image - plain).norm(dim=0)

    def overlap(shape: str) -> float:
        outline = _inside(shape, size)
        return float((covered & outline).sum()) / float((covered | outline).sum())

    return Drawing(max(SHAPES, key=overlap), colour, background)
