"""Train the demos' weights on the CPU, so ``dlo-worker demo-model`` draws what it is
asked.

Writes ``worker/dlo_worker/pipeline/demo_weights/``: a VAE decoder both demos share, the
class-conditional DiT's transformer, and the tiny Flux's transformer with its CLIP text
encoder, in float16. The pictures are
:mod:`dlo_worker.pipeline.drawings`' (a circle or a square, one of four colours, on one of
three backgrounds; class label = index). The latent space is fixed, not learnt: a latent
is the picture averaged over the VAE's 4x4 pixel cells (RGB scaled to [-1, 1], a fourth
channel of zeros), so the decoder learns an upsampling of any picture of plain shapes and
the transformer the latent each class label names (it predicts the clean latent from a
DDPM-noised one, the scheduler's ``prediction_type="sample"``; one label in five dropped
for classifier-free guidance; an exponential moving average kept). The Flux learns the
same latents from the pictures' descriptions ("a red circle on a blue background") at
128x128, by flow matching as FluxPipeline samples (the velocity, sigmas shifted as the
pipeline shifts them at that size), its CLIP text encoder trained with it so that the
pooled prompt vector tells the drawings apart. The decoder starts from the tiny Flux's
seed-0 VAE (the same architecture as the DiT's).

    OMP_NUM_THREADS=1 python scripts/train_demo_weights.py --parts decoder   # 3 minutes
    OMP_NUM_THREADS=2 python scripts/train_demo_weights.py --parts dit       # 16 minutes
    OMP_NUM_THREADS=2 python scripts/train_demo_weights.py --parts flux      # 18 minutes

Deterministic for a given torch build and thread count; the weights in the repository
were written by these commands on two cores (CPU; the decoder with torch 2.11, the
transformers with torch 2.15).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from safetensors.torch import save_file
from torch.nn import functional
from transformers import CLIPTextModel

from dlo_worker.pipeline.demo_model import (
    LATENT_CELL,
    TRAINED_WEIGHTS,
    build_demo_flux_pipeline,
    build_demo_pipeline,
    latent_of,
)
from dlo_worker.pipeline.drawings import BACKGROUNDS, COLOURS, DRAWINGS, SHAPES, render

DIT_IMAGE = 128
DIT_BATCH = 16
EMA_DECAY = 0.995
FLUX_IMAGE = 128
FLUX_BATCH = 16
FLUX_TEXT_STEPS = 200
FLUX_GUIDANCE = 8.0
"""Guidance embeddings drawn from [0, 8) in training: the picture does not depend on it."""


def random_pictures(count: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` pictures of one to three circles and squares of random colours, sizes and
    places on a random plain background: what the decoder must upsample well."""
    coordinates = torch.arange(size, dtype=torch.float32)
    rows, columns = torch.meshgrid(coordinates, coordinates, indexing="ij")
    pictures = []
    for _ in range(count):
        picture = torch.rand(3, 1, 1, generator=generator).expand(3, size, size).clone()
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            centre = torch.rand(2, generator=generator) * size
            reach = (0.08 + 0.3 * float(torch.rand(1, generator=generator))) * size
            if float(torch.rand(1, generator=generator)) < 0.5:
                inside = (rows - centre[0]) ** 2 + (columns - centre[1]) ** 2 <= reach**2
            else:
                inside = ((rows - centre[0]).abs() <= reach) & (
                    (columns - centre[1]).abs() <= reach
                )
            picture = torch.where(inside, torch.rand(3, 1, 1, generator=generator), picture)
        pictures.append(picture)
    return torch.stack(pictures)


def train_decoder(steps: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    vae = build_demo_flux_pipeline(0).vae.train()
    optimizer = torch.optim.AdamW(vae.decoder.parameters(), lr=1e-3)
    for step in range(steps):
        pictures = random_pictures(8, 64, generator)
        latents = latent_of(pictures)
        latents = latents + 0.03 * torch.randn(latents.shape, generator=generator)
        loss = functional.mse_loss(vae.decoder(latents), pictures * 2 - 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report("decoder", step, steps, loss)
    return {f"decoder.{k}": v for k, v in vae.decoder.state_dict().items()}


class AveragedTraining:
    """AdamW on a one-cycle schedule (peak 1e-3) over ``steps``, keeping an exponential
    moving average of ``module``'s weights: what each transformer is trained with."""

    def __init__(self, module: torch.nn.Module, steps: int) -> None:
        self.module = module
        self.average = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        self.schedule = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, max_lr=1e-3, total_steps=steps, pct_start=0.05
        )

    def step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.schedule.step()
        with torch.no_grad():  # the weights kept are an exponential moving average
            for name, value in self.module.state_dict().items():
                self.average[name].lerp_(value, 1 - EMA_DECAY)


def train_dit(steps: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    pipeline = build_demo_pipeline(0)
    transformer = pipeline.transformer.train()
    training = AveragedTraining(transformer, steps)
    targets = latent_of(torch.stack([render(d, DIT_IMAGE) for d in DRAWINGS]))
    alphas = pipeline.scheduler.alphas_cumprod
    null_class = transformer.config.num_embeds_ada_norm
    for step in range(steps):
        labels = torch.randint(len(DRAWINGS), (DIT_BATCH,), generator=generator)
        clean = targets[labels]
        # One in five without its label: the unconditional branch classifier-free guidance runs.
        dropped = torch.rand(DIT_BATCH, generator=generator) < 0.2
        labels = torch.where(dropped, torch.full_like(labels, null_class), labels)
        timesteps = torch.randint(len(alphas), (DIT_BATCH,), generator=generator)
        noise = torch.randn(clean.shape, generator=generator)
        alpha = alphas[timesteps].view(-1, 1, 1, 1)
        noisy = alpha.sqrt() * clean + (1 - alpha).sqrt() * noise
        predicted = transformer(noisy, timestep=timesteps, class_labels=labels).sample
        loss = functional.mse_loss(predicted, clean)
        training.step(loss)
        report("dit", step, steps, loss)
    return training.average


def flux_prompt_inputs(
    pipeline: FluxPipeline, prompts: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CLIP's token ids (its pooled vector is trained), and T5's frozen hidden states with
    their position ids as ``FluxPipeline.encode_prompt`` makes them for sampling."""
    clip_ids = pipeline.tokenizer(
        prompts,
        padding="max_length",
        max_length=pipeline.tokenizer_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    with torch.no_grad():
        t5_states, _, text_ids = pipeline.encode_prompt(prompts, prompt_2=None)
    return clip_ids, t5_states, text_ids


def train_flux_text_encoder(clip: CLIPTextModel, clip_ids: torch.Tensor) -> None:
    """Teach CLIP to tell the descriptions apart in its pooled vector, which conditions
    every Flux block: three linear heads read the shape, colour and background from it
    (cross-entropy, all 22 prompts each step). Random, the pooled vectors of the 22
    prompts are over 0.99 cosine-similar, and the diffusion loss alone barely separates
    them: the transformer then draws the average of similar prompts."""
    attributes = [(d.shape, d.colour, d.background) for d in DRAWINGS]
    choices = (SHAPES, tuple(COLOURS), tuple(BACKGROUNDS))
    labels = [
        torch.tensor([names.index(drawing[i]) for drawing in attributes])
        for i, names in enumerate(choices)
    ]
    heads = torch.nn.ModuleList(
        torch.nn.Linear(clip.config.hidden_size, len(names)) for names in choices
    )
    optimizer = torch.optim.AdamW([*clip.parameters(), *heads.parameters()], lr=3e-3)
    for step in range(FLUX_TEXT_STEPS):
        pooled = clip(clip_ids).pooler_output
        loss = sum(
            (functional.cross_entropy(h(pooled), y) for h, y in zip(heads, labels, strict=True)),
            torch.zeros(()),
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report("flux text encoder", step, FLUX_TEXT_STEPS, loss)


def train_flux(steps: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The tiny Flux's CLIP text encoder (:func:`train_flux_text_encoder`), then its
    transformer on the 22 drawings' descriptions with both text encoders frozen (T5 stays
    the seed-0 random encoder; its per-token states differ by prompt too)."""
    pipeline = build_demo_flux_pipeline(0)
    clip_ids, t5_states, text_ids = flux_prompt_inputs(pipeline, [d.description for d in DRAWINGS])
    clip = pipeline.text_encoder.train()
    train_flux_text_encoder(clip, clip_ids)
    with torch.no_grad():
        pooled = clip.eval()(clip_ids).pooler_output
    transformer = pipeline.transformer.train()
    training = AveragedTraining(transformer, steps)
    side = FLUX_IMAGE // LATENT_CELL // 2
    latents = latent_of(torch.stack([render(d, FLUX_IMAGE) for d in DRAWINGS]))
    targets = FluxPipeline._pack_latents(latents, *latents.shape)
    image_ids = pipeline._prepare_latent_image_ids(1, side, side, "cpu", torch.float32)
    # The sigma shift FluxPipeline applies at this image size (dynamic shifting).
    shift = math.exp(calculate_shift(side * side))
    for step in range(steps):
        prompts = torch.randint(len(DRAWINGS), (FLUX_BATCH,), generator=generator)
        clean = targets[prompts]
        uniform = torch.rand(FLUX_BATCH, generator=generator)
        sigmas = shift * uniform / (1 + (shift - 1) * uniform)
        noise = torch.randn(clean.shape, generator=generator)
        noisy = (1 - sigmas.view(-1, 1, 1)) * clean + sigmas.view(-1, 1, 1) * noise
        velocity = transformer(
            hidden_states=noisy,
            timestep=sigmas,
            guidance=FLUX_GUIDANCE * torch.rand(FLUX_BATCH, generator=generator),
            pooled_projections=pooled[prompts],
            encoder_hidden_states=t5_states[prompts],
            txt_ids=text_ids,
            img_ids=image_ids,
        ).sample
        loss = functional.mse_loss(velocity, noise - clean)  # flow matching's target
        training.step(loss)
        report("flux", step, steps, loss)
    return {
        **{f"transformer.{k}": v for k, v in training.average.items()},
        **{f"text_encoder.{k}": v for k, v in clip.state_dict().items()},
    }


_started = time.perf_counter()


def report(part: str, step: int, steps: int, loss: torch.Tensor) -> None:
    if step % 50 == 0 or step == steps - 1:
        elapsed = time.perf_counter() - _started
        print(
            f"{part} step {step + 1}/{steps} loss {float(loss.detach()):.5f} ({elapsed:.0f} s)",
            flush=True,
        )


def save(weights: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in weights.items()}, path)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", choices=["decoder", "dit", "flux"], default=["decoder", "dit", "flux"]
    )
    parser.add_argument("--decoder-steps", type=int, default=400)
    parser.add_argument("--dit-steps", type=int, default=2000)
    parser.add_argument("--flux-steps", type=int, default=2500)
    parser.add_argument("--out", type=Path, default=TRAINED_WEIGHTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    trainers = {
        "decoder": (train_decoder, args.decoder_steps),
        "dit": (train_dit, args.dit_steps),
        "flux": (train_flux, args.flux_steps),
    }
    for part in args.parts:
        trainer, steps = trainers[part]
        save(
            trainer(steps, torch.Generator().manual_seed(math.prod(map(ord, part)))),
            args.out / f"{part}.safetensors",
        )


if __name__ == "__main__":
    main()
