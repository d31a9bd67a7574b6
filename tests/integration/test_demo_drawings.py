"""The DiT demo draws what it is asked: ``dlo-worker demo-model`` writes trained weights,
and each class label gives an image whose centre colour, background and shape
(:func:`dlo_worker.pipeline.drawings.recognise`) are the ones the label names, with the
settings ``scripts/demo.sh`` uses (25 steps, the default guidance)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dlo_worker.pipeline.demo_model import DemoKind, DemoWeights, write_demo_model
from dlo_worker.pipeline.drawings import DRAWINGS, recognise
from tests.support.generate import ENV

DEMO_SH = Path(__file__).parents[2] / "scripts" / "demo.sh"


def as_tensor(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float()


def test_every_class_label_of_the_dit_demo_draws_its_picture(tmp_path: Path) -> None:
    from diffusers import DiTPipeline

    model = write_demo_model(tmp_path / "dit", kind=DemoKind.DIT, weights=DemoWeights.TRAINED)
    images = DiTPipeline.from_pretrained(model)(
        class_labels=list(range(len(DRAWINGS))),
        num_inference_steps=25,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert [recognise(as_tensor(image)).description for image in images] == [
        drawing.description for drawing in DRAWINGS
    ]


def test_the_cli_demo_draws_what_demo_sh_says(tmp_path: Path) -> None:
    """As ``scripts/demo.sh`` runs it (the CLI's default weights are the trained ones), and
    what the script says it drew is what the image shows."""
    script = DEMO_SH.read_text()
    label = re.search(r"--class-label (\d+)", script)
    assert label is not None, "demo.sh asks for no class label"
    drawing = DRAWINGS[int(label.group(1))]
    assert f"{drawing.description} (DiT, class label {label.group(1)})" in script
    model = tmp_path / "model"
    command = [sys.executable, "-m", "dlo_worker"]
    subprocess.run([*command, "demo-model", str(model)], check=True, env=ENV)
    out = tmp_path / "image.png"
    generate = ["generate", "--model", str(model), "--device", "cpu", "--steps", "25"]
    asked = ["--seed", "0", "--class-label", label.group(1), "--out", str(out)]
    subprocess.run([*command, *generate, *asked], check=True, env=ENV)
    image = np.asarray(Image.open(out).convert("RGB"), dtype=np.float32) / 255
    assert recognise(as_tensor(image)) == drawing


@pytest.mark.parametrize(
    "flags",
    [["--seed", "3"], ["--kind", "flux"], ["--size", "full", "--kind", "flux"]],
)
def test_trained_weights_exist_only_for_the_tiny_dit_with_seed_0(
    tmp_path: Path, flags: list[str]
) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "dlo_worker", "demo-model", str(tmp_path / "a"), *flags,
         "--weights", "trained"],
        capture_output=True,
        text=True,
        env=ENV,
        check=False,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "add --weights random" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "a").exists()


def test_a_seed_alone_asks_for_random_weights(tmp_path: Path) -> None:
    seeded = tmp_path / "seeded"
    command = [sys.executable, "-m", "dlo_worker", "demo-model", str(seeded), "--seed", "3"]
    subprocess.run(command, env=ENV, check=True)
    written = (seeded / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    random = write_demo_model(tmp_path / "random", seed=3)
    assert written == (random / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
