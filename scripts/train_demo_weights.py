"""Train the DiT demo's weights on the CPU, so ``dlo-worker demo-model`` draws what it is
asked.

Writes ``worker/dlo_worker/pipeline/demo_weights/``: a VAE decoder and the
class-conditional DiT's transformer, in float16. The pictures are
:mod:`dlo_worker.pipeline.drawings`' (a circle or a square, one of four colours, on one of
three backgrounds; class label = index). The latent space is fixed, not learnt: a latent
is the picture averaged over the VAE's 4x4 pixel cells (RGB scaled to [-1, 1], a fourth
channel of zeros), so the decoder learns an upsampling of any picture of plain shapes and
the transformer the latent each class label names (it predicts the clean latent from a
DDPM-noised one, the scheduler's ``prediction_type="sample"``; one label in five dropped
for classifier-free guidance; an exponential moving average kept). The
decoder starts from the tiny Flux's seed-0 VAE (the same architecture as the DiT's), so
the Flux demo can share it once its transformer is trained.

    OMP_NUM_THREADS=1 python scripts/train_demo_weights.py --parts decoder   # 3 minutes
    OMP_NUM_THREADS=2 python scripts/train_demo_weights.py --parts dit       # 16 minutes

Deterministic for a given torch build and thread count; the weights in the repository
were written by these two commands on two cores (CPU; the decoder with torch 2.11, the
transformer with torch 2.15).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.nn import functional

from dlo_worker.pipeline.demo_model import (
    TRAINED_WEIGHTS,
    build_demo_flux_pipeline,
    build_demo_pipeline,
    latent_of,
)
from dlo_worker.pipeline.drawings import DRAWINGS, render

DIT_IMAGE = 128
DIT_BATCH = 16
EMA_DECAY = 0.995


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


def train_dit(steps: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    pipeline = build_demo_pipeline(0)
    transformer = pipeline.transformer.train()
    average = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    targets = latent_of(torch.stack([render(d, DIT_IMAGE) for d in DRAWINGS]))
    alphas = pipeline.scheduler.alphas_cumprod
    null_class = transformer.config.num_embeds_ada_norm
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=1e-3, total_steps=steps, pct_start=0.05
    )
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
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():  # the weights kept are an exponential moving average
            for name, value in transformer.state_dict().items():
                average[name].lerp_(value, 1 - EMA_DECAY)
        report("dit", step, steps, loss)
    return average


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
        "--parts", nargs="+", choices=["decoder", "dit"], default=["decoder", "dit"]
    )
    parser.add_argument("--decoder-steps", type=int, default=400)
    parser.add_argument("--dit-steps", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=TRAINED_WEIGHTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    trainers = {
        "decoder": (train_decoder, args.decoder_steps),
        "dit": (train_dit, args.dit_steps),
    }
    for part in args.parts:
        trainer, steps = trainers[part]
        save(
            trainer(steps, torch.Generator().manual_seed(math.prod(map(ord, part)))),
            args.out / f"{part}.safetensors",
        )


if __name__ == "__main__":
    main()
