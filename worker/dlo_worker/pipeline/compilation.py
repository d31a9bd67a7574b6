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

In the default and ``reduce-overhead`` modes inductor runs deterministically
(``torch._inductor.config.deterministic``): otherwise it times candidate kernel
configurations on the device when a graph first runs and keeps the fastest, and two
timings that differ by noise pick kernels that round differently. Measured on an H200
(Flux, 1024x1024, ``bench/flux_compile.py``): without it the DLO and resident compiled
steps differed by up to 0.078; with it they are bitwise equal, at the same step time.
``max-autotune-no-cudagraphs`` exists to time kernel choices, so it keeps them: its
images match from run to run only as far as those timings do.

``reduce-overhead`` records each compiled block as a CUDA graph; each DiT forward is one
step of torch's CUDA graph trees (:func:`~dlo_worker.offload.compiling.
one_cuda_graph_step_per_forward`), marked here for a resident DiT and by DLO's block
compilation for a DiT whose blocks it streams.

Shapes are static at first and torch's automatic dynamic shapes take over at the first
new image size: a second size compiles once more with the changed dimensions symbolic,
and later sizes reuse that graph, instead of one compile per size until Dynamo's
recompile limit silently falls back to eager. Inductor chooses a dynamic graph's kernels
for the size it is compiled at, so images are bitwise equal between two processes (DLO or
resident) that compiled the same sizes in the same order; Dynamo's memory of sizes from
earlier processes (its local profile beside the cache) is turned off for that reason.

Compiled graphs go to inductor's cache (``--compile-cache-dir``; the operator puts it on
the node): a restarted worker that finds them there still traces each block class with
Dynamo, but loads the compiled kernels instead of generating and building them.

Inductor cannot run a graph it could not write there: it imports the generated code from
the cache. A cache whose file system is full therefore fails the compile, at the first
request of a size, not at start (compiling is lazy, and a new size compiles again while
serving). Such a graph falls back to the eager path for good (:class:`EagerFallback`): one
warning naming the directory, ``dlo_compile_eager_fallbacks`` counts the graphs, the
request is served, and the graphs already compiled keep running compiled. Failing instead
would answer every request with an error until someone freed space; failing at start
could not catch a cache that fills up later. Any other compile failure still raises.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.utils
from torch import nn
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

from dlo_worker.config import CompileMode
from dlo_worker.errors import UserFixableError
from dlo_worker.offload.compiling import (
    RecompileCounter,
    one_cuda_graph_step_per_forward,
    routed_to_forward,
)
from dlo_worker.offload.plan import discover

logger = logging.getLogger(__name__)

CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


class CompileSetupError(RuntimeError, UserFixableError):
    """``--compile``'s options cannot take effect on this machine."""


@dataclass(eq=False)
class CompiledBlocks:
    """What ``--compile`` did in this process: the ``compile stats`` log line and the
    ``dlo_compile_*`` metrics read it."""

    mode: CompileMode
    blocks: int
    cache_dir: Path | None
    first_forward_seconds: float | None = None
    """Wall time of each DiT's first forward after its blocks were compiled, summed: the
    compile (or the cache load) of every block graph plus one forward."""
    _counter: RecompileCounter = field(default_factory=lambda: RecompileCounter(0))
    eager_graphs: set[str] = field(default_factory=set)
    """Block classes whose graph runs eagerly because the cache's file system was full."""

    @property
    def eager_fallbacks(self) -> int:
        """Block graphs that fell back to the eager path because the cache was full."""
        return len(self.eager_graphs)

    @property
    def recompiles(self) -> int:
        """Graphs compiled after every DiT's first forward: 0 in steady state."""
        return self._counter.recompiles

    @property
    def cache_hits(self) -> int:
        """Graphs inductor loaded from its cache instead of compiling them (process-wide)."""
        return int(torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"])

    @property
    def cache_misses(self) -> int:
        """Graphs inductor compiled because its cache did not hold them (process-wide)."""
        return int(torch._dynamo.utils.counters["inductor"]["fxgraph_cache_miss"])

    def fields(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "blocks": self.blocks,
            "first_forward_seconds": self.first_forward_seconds,
            "recompiles": self.recompiles,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "eager_fallbacks": self.eager_fallbacks,
            "cache_dir": str(self.cache_dir) if self.cache_dir is not None else None,
        }


def check_device(mode: CompileMode | None, device: torch.device) -> None:
    """CUDA graphs need a CUDA device (``--device auto`` may have resolved to the CPU)."""
    if mode == CompileMode.REDUCE_OVERHEAD and device.type != "cuda":
        raise CompileSetupError(
            f"--compile-mode reduce-overhead on {device}: CUDA graphs need a CUDA device; "
            "use --compile-mode default"
        )


def use_cache_dir(cache_dir: Path) -> None:
    """Send inductor's compiled graphs (and Triton's kernels, kept beneath) to
    ``cache_dir``, before anything is compiled."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CompileSetupError(
            f"--compile-cache-dir {cache_dir}: cannot create it ({error.strerror}); give a "
            "writable directory"
        ) from error
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise CompileSetupError(
            f"--compile-cache-dir {cache_dir}: not writable by this process; give a "
            "writable directory"
        )
    os.environ[CACHE_DIR_VARIABLE] = str(cache_dir.resolve())


def compile_blocks(
    pipeline: object,
    mode: CompileMode,
    device: torch.device,
    block_paths: Sequence[str] | None = None,
    cache_dir: Path | None = None,
) -> CompiledBlocks:
    """Compile every DiT's blocks with ``mode``. Compilation itself happens lazily, on
    each block's first call; the returned record times each DiT's first forward."""
    check_device(mode, device)
    if cache_dir is not None:
        use_cache_dir(cache_dir)
    if mode in (CompileMode.DEFAULT, CompileMode.REDUCE_OVERHEAD):
        import torch._inductor.config

        torch._inductor.config.deterministic = True
    # No sizes remembered from earlier processes (Dynamo keeps them beside the cache): a
    # graph compiled dynamic picks kernels for the size it first sees, so a restart would
    # otherwise round differently from a fresh worker given the same requests.
    torch._dynamo.config.automatic_dynamic_local_pgo = False
    dits = discover(pipeline, block_paths).dits
    compiled = CompiledBlocks(mode, 0, cache_dir, _counter=RecompileCounter(len(dits)))
    for dit in dits:
        # DLO's block compilation marks the CUDA graph steps of a DiT it streams blocks of;
        # this marks those of a resident DiT (or one whose blocks DLO all keeps resident).
        streamed = any(routed_to_forward(block) for _name, block in dit.blocks)
        for _name, block in dit.blocks:
            block.compile(fullgraph=True, mode=mode.torch_mode)
            EagerFallback(compiled, block).install()
            compiled.blocks += 1
        mark_steps = mode == CompileMode.REDUCE_OVERHEAD and not streamed
        _watch_first_forward(compiled, dit.module, device, mark_steps=mark_steps)
    logger.info(
        "blocks compiled lazily",
        extra={"fields": {"blocks": compiled.blocks, "mode": mode, "cache_dir": cache_dir}},
    )
    return compiled


def _watch_first_forward(
    compiled: CompiledBlocks, dit: nn.Module, device: torch.device, *, mark_steps: bool
) -> None:
    """Time the DiT's first forward (it compiles every block graph; synchronized once, on
    CUDA) and count recompiles after it; with ``mark_steps``, make each forward one CUDA
    graph step. Later forwards pay nothing but that step mark."""
    key = id(dit)
    first_started: list[float] = []

    def forward_starts(module: nn.Module, args: tuple[object, ...]) -> None:
        if mark_steps:
            one_cuda_graph_step_per_forward(module, args)
        first_started[:] = [time.perf_counter()]

    def first_forward_ends(_module: nn.Module, _args: object, _output: object) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        compiled._counter.forward_finished(key)
        seconds = time.perf_counter() - first_started[0]
        compiled.first_forward_seconds = (compiled.first_forward_seconds or 0.0) + seconds
        logger.info(
            "first compiled forward",
            extra={"fields": {"seconds": round(seconds, 3), "blocks": compiled.blocks}},
        )
        handle.remove()

    dit.register_forward_pre_hook(forward_starts)
    handle = dit.register_forward_hook(first_forward_ends)


NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def out_of_space(error: BaseException) -> OSError | None:
    """The "no space left" (or quota) error behind a failed compile: inductor wraps what
    failed (``inner_exception``), other layers chain it."""
    pending: list[BaseException] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE:
            return current
        for cause in (getattr(current, "inner_exception", None), current.__cause__):
            if isinstance(cause, BaseException):
                pending.append(cause)
        if current.__context__ is not None:
            pending.append(current.__context__)
    return None


class EagerFallback:
    """Runs ``block`` eagerly once its class's graph could not be compiled because the
    compile cache's file system is full (see the module docstring): the compiled call
    is wrapped where ``block.compile`` installed it, the instance ``forward`` DLO routes a
    streamed block's compile to, or the module's compiled call otherwise."""

    def __init__(self, compiled: CompiledBlocks, block: nn.Module) -> None:
        self._compiled = compiled
        self._block = block
        self._graph = type(block).__qualname__

    def install(self) -> None:
        block = self._block
        if routed_to_forward(block):
            eager_forward = type(block).forward.__get__(block)
            guarded = self._guarded(vars(block)["forward"], eager_forward)
            object.__setattr__(block, "forward", guarded)
        elif (compiled_call := block._compiled_call_impl) is not None:
            block._compiled_call_impl = self._guarded(compiled_call, block._call_impl)

    def _guarded(
        self, compiled_call: Callable[..., Any], eager_call: Callable[..., Any]
    ) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._graph in self._compiled.eager_graphs:
                return eager_call(*args, **kwargs)
            try:
                return compiled_call(*args, **kwargs)
            except Exception as error:
                full = out_of_space(error)
                if full is None:
                    raise
                self._fall_back(full)
            return eager_call(*args, **kwargs)

        return call

    def _fall_back(self, full: OSError) -> None:
        self._compiled.eager_graphs.add(self._graph)
        logger.warning(
            "compile cache full: this block graph runs eagerly; free space in the cache "
            "directory and restart the worker to compile it",
            extra={
                "fields": {
                    "graph": self._graph,
                    "cache_dir": inductor_cache_dir(),
                    "error": full.strerror,
                }
            },
        )
