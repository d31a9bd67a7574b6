"""``--compile``: regional compilation of each DiT's repeated blocks.

The blocks are those DLO streams (discovered the same way, or named by
``--dlo-block-paths``), each compiled whole (``fullgraph=True``) with ``block.compile``:
a resident model and a DLO model run the same graphs, so their images stay bitwise equal
and their speed compares like for like. Under DLO a streamed block's ``compile`` compiles
its ``forward`` and leaves the hooks that stream its weights eager
(:mod:`dlo_worker.offload.compiling`).

Regional rather than whole-model compilation: the blocks repeat, so Dynamo traces one
block class once and reuses its graph (guards permitting) for every instance, which
keeps the first step's compile short; DLO's hooks could not be traced into a whole-DiT
graph anyway.

In the default mode inductor runs deterministically (``torch._inductor.config.
deterministic``): otherwise it times candidate kernel configurations on the device when a
graph first runs and keeps the fastest, and two timings that differ by noise pick
kernels that round differently. Measured on an H200 (Flux, 1024x1024, ``bench/
flux_compile.py``): without it the DLO and resident compiled steps differed by up to
0.078; with it they are bitwise equal, at the same step time. ``max-autotune-no-
cudagraphs`` exists to time kernel choices, so it keeps them: its images match from run to
run only as far as those timings do.

Shapes are static at first and torch's automatic dynamic shapes take over at the first
new image size: a second size compiles once more with the changed dimensions symbolic,
and later sizes reuse that graph, instead of one compile per size until Dynamo's
recompile limit silently falls back to eager.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dlo_worker.config import CompileMode
from dlo_worker.offload.plan import discover

logger = logging.getLogger(__name__)


def compile_blocks(
    pipeline: object, mode: CompileMode, block_paths: Sequence[str] | None = None
) -> int:
    """Compile every DiT's blocks with ``mode``; returns how many blocks were compiled.
    Compilation itself happens lazily, on each block's first call."""
    if mode == CompileMode.DEFAULT:
        import torch._inductor.config

        torch._inductor.config.deterministic = True
    compiled = 0
    for dit in discover(pipeline, block_paths).dits:
        for _name, block in dit.blocks:
            block.compile(fullgraph=True, mode=mode.torch_mode)
            compiled += 1
    logger.info("blocks compiled lazily", extra={"fields": {"blocks": compiled, "mode": mode}})
    return compiled
