"""The demos draw what they are asked: ``dlo-worker demo-model`` writes trained weights, and
each DiT class label and each Flux prompt gives an image whose centre colour, background
and shape (:func:`dlo_worker.pipeline.drawings.recognise`) are the ones it names, with the
settings ``scripts/demo.sh`` uses (the DiT: 25 steps, the default guidance; the Flux: the
script's own command line)."""

from __future__ import annotations

import re
import shlex
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
from tests.support.in_process import run_dlo_worker

DEMO_SH = Path(__file__).parents[2] / "scripts" / "demo.sh"


def as_tensor(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float()


def succeeds(arguments: list[str]) -> None:
    """``dlo-worker <arguments>`` in this process, which must exit 0."""
    result = run_dlo_worker(arguments)
    assert result.returncode == 0, result.stderr


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


def _demo_sh_flux_command() -> tuple[str, list[str]]:
    """The prompt ``scripts/demo.sh`` gives the Flux demo and its ``generate`` arguments
    after the model, as the script runs them (``$OUT``'s paths left for the caller)."""
    script = DEMO_SH.read_text()
    prompt = re.search(r'^PROMPT="([^"]+)"$', script, re.MULTILINE)
    command = re.search(
        r'^dlo-worker generate --model "\$OUT/flux-model" ((?:.*\\\n)*.*)$', script, re.MULTILINE
    )
    assert prompt is not None, "demo.sh sets no PROMPT"
    assert command is not None, "demo.sh runs no Flux generate"
    arguments = shlex.split(command.group(1).replace("\\\n", " "))
    return prompt.group(1), [prompt.group(1) if a == "$PROMPT" else a for a in arguments]


def _flag(arguments: list[str], name: str) -> int:
    return int(arguments[arguments.index(name) + 1])


def test_every_description_the_flux_demo_draws_its_picture(tmp_path: Path) -> None:
    """All 22 prompts in one batch, at the size, steps and seed demo.sh uses and the worker's
    default guidance."""
    from diffusers import FluxPipeline

    _, arguments = _demo_sh_flux_command()
    model = write_demo_model(tmp_path / "flux", kind=DemoKind.FLUX, weights=DemoWeights.TRAINED)
    images = FluxPipeline.from_pretrained(model)(
        prompt=[drawing.description for drawing in DRAWINGS],
        height=_flag(arguments, "--height"),
        width=_flag(arguments, "--width"),
        num_inference_steps=_flag(arguments, "--steps"),
        guidance_scale=4.0,
        generator=torch.Generator().manual_seed(_flag(arguments, "--seed")),
        output_type="np",
    ).images
    assert [recognise(as_tensor(image)).description for image in images] == [
        drawing.description for drawing in DRAWINGS
    ]


def test_the_cli_flux_demo_draws_what_demo_sh_asks_for(tmp_path: Path) -> None:
    """demo.sh's Flux command line as it stands, on the CLI's default (trained) weights."""
    prompt, arguments = _demo_sh_flux_command()
    drawing = next((d for d in DRAWINGS if d.description == prompt), None)
    assert drawing is not None, f"demo.sh asks the Flux demo for {prompt!r}, which it never drew"
    model = tmp_path / "flux-model"
    succeeds(["demo-model", str(model), "--kind", "flux"])
    out = tmp_path / "flux.png"
    arguments = [str(out) if a == "$OUT/flux.png" else a for a in arguments]
    succeeds(["generate", "--model", str(model), *arguments])
    image = np.asarray(Image.open(out).convert("RGB"), dtype=np.float32) / 255
    assert recognise(as_tensor(image)) == drawing


def test_the_cli_demo_draws_what_demo_sh_says(tmp_path: Path) -> None:
    """As ``scripts/demo.sh`` runs it (the CLI's default weights are the trained ones), and
    what the script says it drew is what the image shows."""
    script = DEMO_SH.read_text()
    label = re.search(r"--class-label (\d+)", script)
    assert label is not None, "demo.sh asks for no class label"
    drawing = DRAWINGS[int(label.group(1))]
    assert f"{drawing.description} (DiT, class label {label.group(1)})" in script
    model = tmp_path / "model"
    succeeds(["demo-model", str(model)])
    out = tmp_path / "image.png"
    generate = ["generate", "--model", str(model), "--device", "cpu", "--steps", "25"]
    succeeds([*generate, "--seed", "0", "--class-label", label.group(1), "--out", str(out)])
    image = np.asarray(Image.open(out).convert("RGB"), dtype=np.float32) / 255
    assert recognise(as_tensor(image)) == drawing


@pytest.mark.parametrize(
    "flags",
    [["--seed", "3"], ["--kind", "flux", "--seed", "1"], ["--size", "full", "--kind", "flux"]],
)
def test_trained_weights_exist_only_for_the_tiny_demos_with_seed_0(
    tmp_path: Path, flags: list[str]
) -> None:
    refused = run_dlo_worker(["demo-model", str(tmp_path / "a"), *flags, "--weights", "trained"])
    assert refused.returncode == 2, refused.stderr
    assert "add --weights random" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "a").exists()


def test_a_seed_alone_asks_for_random_weights(tmp_path: Path) -> None:
    """``demo-model``'s end-to-end run: the installed module as a process of its own."""
    seeded = tmp_path / "seeded"
    command = [sys.executable, "-m", "dlo_worker", "demo-model", str(seeded), "--seed", "3"]
    subprocess.run(command, env=ENV, check=True)
    written = (seeded / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    random = write_demo_model(tmp_path / "random", seed=3)
    assert written == (random / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
