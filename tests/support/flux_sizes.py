"""FLUX.1-dev's component sizes in bf16 as the device planner sees them (bytes per
component, and per block for the ones DLO streams): the planner's and its advice's tests
place this pipeline against budgets without reading a checkpoint."""

from __future__ import annotations

from dlo_worker.loader.device_plan import ComponentBytes

MIB = 2**20
DIT = ComponentBytes(
    "transformer",
    total=200 * MIB + 19 * 648 * MIB + 38 * 270 * MIB,
    blocks=(648 * MIB,) * 19 + (270 * MIB,) * 38,
)
T5 = ComponentBytes("text_encoder_2", total=250 * MIB + 24 * 368 * MIB, blocks=(368 * MIB,) * 24)
CLIP = ComponentBytes("text_encoder", total=235 * MIB)
VAE = ComponentBytes("vae", total=160 * MIB)
FLUX = [CLIP, T5, DIT, VAE]
T5_COPY_SECONDS = sum(T5.blocks) / 55e9
"""T5-XXL's blocks at 55 GB/s: what streaming it adds to each request (about 0.17 s)."""
