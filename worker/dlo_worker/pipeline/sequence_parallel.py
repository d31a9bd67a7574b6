"""Sequence parallelism: diffusers' context parallelism (Ulysses) over the engine's SP groups.

Every rank of one SP group runs the same request. Each DiT splits its sequence across
the group where its class's ``_cp_plan`` says (Flux: the image and text tokens at the
model's input; Wan: the tokens entering the first block), attention trades sequence for
heads with an all-to-all (Ulysses), and the output is gathered again, so every SP rank
ends each step with the same latents; text encoders and the VAE run whole on every rank.

The ranks form one ``(dp, ring, ulysses)`` device mesh laid out like
:func:`dlo_worker.process.topology.group_ranks` (``rank = dp * SP + sp``; TP is refused with
SP), so the mesh's Ulysses dimension of a rank is exactly its SP group; with DP > 1 every
DP replica has its own SP group, and DLO's AllGather keeps the DP group.

Only Ulysses runs: diffusers' ring attention needs an attention backend that returns the
log-sum-exp of each block (flash, cuDNN, Sage; CUDA only), which the pipelines here do
not select. Ulysses needs the attention heads, and the split token counts, divisible by
the SP size: the first is checked before any weight is read, the second per request
(``RequestLimits.token_split``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dlo_worker.config import ParallelOptions
from dlo_worker.errors import UserFixableError
from dlo_worker.loader.model_directory import dit_classes

logger = logging.getLogger(__name__)

MESH_DIMENSIONS = ("dp", "ring", "ulysses")


class SequenceParallelError(ValueError, UserFixableError):
    """The model cannot run with the configured sequence parallelism."""


def supported_classes() -> list[str]:
    """The diffusers DiT classes that carry a context-parallel plan."""
    from diffusers.models import transformers

    return sorted(
        name
        for name in dir(transformers)
        if getattr(getattr(transformers, name), "_cp_plan", None) is not None
    )


def check_model(
    model_dir: Path, dit_components: tuple[str, ...], parallel: ParallelOptions
) -> None:
    """Before any weight is read: every DiT class has a context-parallel plan, and its
    attention heads divide over the SP ranks; the error names the class and the fix."""
    size = parallel.sequence_parallel_size
    if size == 1:
        return
    import diffusers

    for component, class_name in dit_classes(model_dir, dit_components).items():
        model_class = getattr(diffusers, class_name, None)
        if model_class is None:
            continue  # the loader reports an unknown class
        if getattr(model_class, "_cp_plan", None) is None:
            raise SequenceParallelError(
                f"--sequence-parallel-size {size}: {class_name} ({component}) has no "
                "context-parallel plan in diffusers, so its sequence cannot be split; use "
                "--sequence-parallel-size 1 (scale with --data-parallel-size). Classes with "
                f"a plan: {', '.join(supported_classes())}"
            )
        config = json.loads((model_dir / component / "config.json").read_text())
        heads = config.get("num_attention_heads")
        if isinstance(heads, int) and heads % size:
            raise SequenceParallelError(
                f"--sequence-parallel-size {size}: {class_name} ({component}) has {heads} "
                "attention heads, and Ulysses attention gives each SP rank a whole number "
                f"of them; use a --sequence-parallel-size that divides {heads}"
            )


@contextlib.contextmanager
def _cpu_accelerator_count() -> Iterator[None]:
    """diffusers derives the rank's device as ``rank % torch.accelerator.device_count()``,
    which divides by zero where no accelerator exists; the CPU counts as one there (the
    device it derives is not used for the CPU's gloo collectives)."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def apply(
    pipeline: object,
    parallel: ParallelOptions,
    device: torch.device,
    dit_components: tuple[str, ...],
) -> list[str]:
    """Enable Ulysses context parallelism on every DiT of ``pipeline`` (their classes were
    checked by :func:`check_model`); returns the components it applied to. The world of
    :mod:`dlo_worker.process.topology` is already initialized."""
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        device.type,
        (parallel.data_parallel_size, 1, parallel.sequence_parallel_size),
        mesh_dim_names=MESH_DIMENSIONS,
    )
    applied = []
    components = getattr(pipeline, "components", {})
    for name in dit_components:
        component = components.get(name)
        if isinstance(component, nn.Module) and getattr(component, "_cp_plan", None):
            config = ContextParallelConfig(
                ulysses_degree=parallel.sequence_parallel_size, mesh=mesh
            )
            with _cpu_accelerator_count():
                # diffusers adds it to its models; nn.Module does not declare it.
                cast(Any, component).enable_parallelism(config=config)
            applied.append(name)
    logger.info(
        "sequence parallelism enabled",
        extra={
            "fields": {
                "mode": "ulysses",
                "size": parallel.sequence_parallel_size,
                "components": ",".join(applied),
            }
        },
    )
    return applied
