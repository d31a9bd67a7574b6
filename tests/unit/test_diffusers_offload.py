"""What runs diffusers' offload modes decides before loading: where the loader leaves each
component, and which DiT classes group offloading refuses (the GPU tests run the modes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlo_worker.config import OffloadPolicy
from dlo_worker.loader.placement import stays_on_host
from dlo_worker.pipeline.diffusers_offload import (
    GroupOffloadUnsupportedError,
    OffloadDeviceError,
    check_device,
    check_model,
)

DITS = ("transformer", "transformer_2")


@pytest.mark.parametrize(
    ("policy", "on_host"),
    [
        (OffloadPolicy.MODEL_CPU_OFFLOAD, {"transformer", "vae", "text_encoder"}),
        (OffloadPolicy.LAYERWISE_OFFLOAD, {"transformer"}),
        (OffloadPolicy.NONE, set()),
    ],
)
def test_the_loader_leaves_in_host_memory_what_the_offload_moves(
    policy: OffloadPolicy, on_host: set[str]
) -> None:
    components = ("transformer", "vae", "text_encoder")
    assert {c for c in components if stays_on_host(policy, c, DITS)} == on_host


def test_group_offloading_names_a_dit_class_diffusers_does_not_support(
    demo_model_dir: Path, flux_model_dir: Path
) -> None:
    with pytest.raises(GroupOffloadUnsupportedError, match="DiTTransformer2DModel"):
        check_model(OffloadPolicy.LAYERWISE_OFFLOAD, demo_model_dir, DITS)
    check_model(OffloadPolicy.LAYERWISE_OFFLOAD, flux_model_dir, DITS)
    check_model(OffloadPolicy.MODEL_CPU_OFFLOAD, demo_model_dir, DITS)  # every class


def test_both_modes_need_a_cuda_device() -> None:
    for policy in (OffloadPolicy.MODEL_CPU_OFFLOAD, OffloadPolicy.LAYERWISE_OFFLOAD):
        with pytest.raises(OffloadDeviceError, match="the device is cpu"):
            check_device(policy, torch.device("cpu"))
    check_device(OffloadPolicy.NONE, torch.device("cpu"))
