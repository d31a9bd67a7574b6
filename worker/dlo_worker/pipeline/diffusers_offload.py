"""diffusers' own offload modes, run when DLO is off, so a user can compare the three
modes on their model with one flag.

- ``--enable-cpu-offload``: ``DiffusionPipeline.enable_model_cpu_offload``, one whole
  component on the accelerator at a time (accelerate's hooks move it in before its
  forward and the next component's forward moves it out).
- ``--enable-layerwise-offload``: diffusers group offloading of every DiT, block level,
  one block per group, on a side stream with ``record_stream`` (diffusers' block-level
  configuration that overlaps the next block's copy with this block's compute); the other
  components stay on the device.

Both move weights between host memory and a CUDA device, so both need one: with the
CPU as the device there is nothing to offload to, and the flag is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dlo_worker.config import OffloadPolicy
from dlo_worker.errors import UserFixableError
from dlo_worker.loader.model_directory import dit_classes

logger = logging.getLogger(__name__)

DIFFUSERS_POLICIES = (OffloadPolicy.MODEL_CPU_OFFLOAD, OffloadPolicy.LAYERWISE_OFFLOAD)
_FLAGS = {
    OffloadPolicy.MODEL_CPU_OFFLOAD: "--enable-cpu-offload",
    OffloadPolicy.LAYERWISE_OFFLOAD: "--enable-layerwise-offload",
}


class OffloadDeviceError(ValueError, UserFixableError):
    """A diffusers offload mode was asked for without a CUDA device to offload to."""


class GroupOffloadUnsupportedError(ValueError, UserFixableError):
    """The model's DiT class does not support diffusers' group offloading."""


def check_device(policy: OffloadPolicy, device: torch.device) -> None:
    if policy in DIFFUSERS_POLICIES and device.type != "cuda":
        raise OffloadDeviceError(
            f"{_FLAGS[policy]} moves weights between host memory and a CUDA device, and the "
            f"device is {device}: drop the flag (on the CPU everything is in host memory "
            "already) or run on a GPU"
        )


def check_model(policy: OffloadPolicy, model_dir: Path, dit_components: tuple[str, ...]) -> None:
    """Before any weight is read: refuse group offloading of a DiT class diffusers does not
    support (it says so with ``_supports_group_offloading``), naming the class and the
    modes that do run."""
    if policy != OffloadPolicy.LAYERWISE_OFFLOAD:
        return
    import diffusers

    for component, class_name in dit_classes(model_dir, dit_components).items():
        model_class = getattr(diffusers, class_name, None)
        if model_class is not None and not getattr(model_class, "_supports_group_offloading", True):
            raise GroupOffloadUnsupportedError(
                f"--enable-layerwise-offload: diffusers' group offloading does not support "
                f"{class_name} ({component}); use --enable-distributed-layerwise-offload "
                "(DLO streams it) or --enable-cpu-offload"
            )


def apply(
    pipeline, policy: OffloadPolicy, device: torch.device, dit_components: tuple[str, ...]
) -> None:
    """Install diffusers' offload for ``policy`` on a pipeline the loader left in host
    memory per :func:`stays_on_host`."""
    check_device(policy, device)
    if policy == OffloadPolicy.MODEL_CPU_OFFLOAD:
        pipeline.enable_model_cpu_offload(device=device)
        offloaded = [name for name, c in pipeline.components.items() if isinstance(c, nn.Module)]
    elif policy == OffloadPolicy.LAYERWISE_OFFLOAD:
        offloaded = []
        for name in dit_components:
            component = pipeline.components.get(name)
            if isinstance(component, nn.Module):
                # diffusers adds it to its models; nn.Module does not declare it.
                cast(Any, component).enable_group_offload(
                    onload_device=device,
                    offload_device=torch.device("cpu"),
                    offload_type="block_level",
                    num_blocks_per_group=1,
                    use_stream=True,
                    record_stream=True,
                )
                offloaded.append(name)
    else:
        return
    logger.info(
        "diffusers offload enabled",
        extra={"fields": {"mode": _FLAGS[policy], "components": ",".join(offloaded)}},
    )
