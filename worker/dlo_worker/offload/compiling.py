"""torch.compile on a DLO model: each streamed block's ``forward`` is compiled, the hooks
that stream its weights stay eager.

A streamed block's pre-hook chooses a slot, starts copies, waits on events and repoints
the block's parameters, all on the host: no graph can contain it. So DLO keeps the hooks
out of every graph and lets the block's own computation be compiled whole:

- ``block.compile(...)`` on a streamed block (what diffusers'
  ``compile_repeated_blocks`` calls on each repeated block) compiles the block's
  ``forward`` with the given options, ``fullgraph=True`` included; the hooks around it
  run eagerly. Resident blocks compile as usual, so a DLO model compiled this way runs
  the same graphs as the resident model compiled the same way.
- The hooks are ``torch.compiler.disable``-d with a reason naming the supported way:
  ``torch.compile(block)`` runs them eagerly and compiles ``forward`` as a frame of its
  own; ``torch.compile(dit)`` breaks its graph at each streamed block, and with
  ``fullgraph=True`` fails at its first call with that reason.
- A DiT or streamed block compiled before DLO is enabled is refused (its compiled graph
  would trace the hooks), naming the order that works.
- CUDA graphs (``mode="reduce-overhead"``): a block's graph is recorded against the
  addresses of the slot it ran in, and replayed whenever it runs in that slot again.
  Slots alternate, so with an odd number of streamed blocks a block's slot alternates
  from one forward to the next: torch records one graph per block and slot (its CUDA
  graph trees re-record when a static input's address differs, keeping both): they are
  recorded during the second and third forwards, and from the fourth on every block
  replays one of them. The copies and waits stay
  outside the graphs, ordered on the compute stream the graphs replay on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch._dynamo.utils
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils.hooks import RemovableHandle

from dlo_worker.offload.block import StreamedBlock
from dlo_worker.offload.errors import OffloadSetupError

SUPPORTED_WAY = (
    "compile the DiT's blocks (transformer.compile_repeated_blocks(fullgraph=True), "
    "block.compile(), or dlo-worker --compile)"
)

HOOKS_STAY_EAGER = (
    "DLO streams this block's weights from eager hooks, so no compiled graph can span a "
    f"streamed block's call; {SUPPORTED_WAY} instead"
)
"""The reason the hooks give Dynamo, which prints it where a graph would include them."""

Hook = TypeVar("Hook", bound=Callable[..., Any])


def eager(hook: Hook) -> Hook:
    """``hook`` as Dynamo must run it: never traced, called eagerly between graphs."""
    disabled: Hook = torch.compiler.disable(hook, reason=HOOKS_STAY_EAGER)
    return disabled


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (its own counter)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def check_not_compiled(modules: Iterable[tuple[str, nn.Module]]) -> None:
    """Refuse a DiT or streamed block that was compiled before DLO was enabled."""
    for name, module in modules:
        if isinstance(module, OptimizedModule) or module._compiled_call_impl is not None:
            raise OffloadSetupError(
                f"{name} was compiled before DLO was enabled, and its compiled graph would "
                "trace the hooks that stream its weights; enable DLO on the uncompiled "
                f"model, then {SUPPORTED_WAY}"
            )


class RecompileCounter:
    """Graphs Dynamo compiled (process-wide) once every watched DiT finished its first
    forward after its blocks were compiled: a new input size or a failed guard, 0 in
    steady state. Dynamo's own counter, read twice: no hook inside a graph."""

    def __init__(self, dits: int) -> None:
        self._dits = dits
        self._graphs_after_first_forward: dict[int, int] = {}
        """Per DiT, Dynamo's graph count when its first forward after a compile finished."""

    def restart(self) -> None:
        """Blocks were (re)compiled: the next forward of each DiT is a first one again."""
        self._graphs_after_first_forward.clear()

    def forward_finished(self, key: int) -> bool:
        """Note the end of a forward of DiT ``key``; true when it was its first."""
        if key in self._graphs_after_first_forward:
            return False
        self._graphs_after_first_forward[key] = compiled_graphs()
        return True

    @property
    def recompiles(self) -> int:
        counts = self._graphs_after_first_forward
        if len(counts) < self._dits:
            return 0
        return compiled_graphs() - max(counts.values())


def uses_cuda_graphs(compile_kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.compile(**compile_kwargs)`` records CUDA graphs."""
    options = compile_kwargs.get("options") or {}
    return compile_kwargs.get("mode") == "reduce-overhead" or bool(options.get("triton.cudagraphs"))


def one_cuda_graph_step_per_forward(_module: nn.Module, _args: tuple[object, ...]) -> None:
    """A DiT forward pre-hook: the CUDA graphs of its blocks form one step of torch's
    CUDA graph trees. Each compiled block is an outermost compiled call, so without it
    every block would start a step of its own, and the next block's graph could reuse the
    memory of the output it reads (torch refuses that with an error). A block's outputs
    stay valid until the next forward starts."""
    torch.compiler.cudagraph_mark_step_begin()


def routed_to_forward(block: nn.Module) -> bool:
    """Whether DLO routes this block's ``compile()`` to its ``forward`` (a streamed block):
    a DiT with such a block has its CUDA graph steps marked by :class:`BlockCompilation`."""
    return "compile" in vars(block)


class BlockCompilation:
    """Routes ``compile()`` on each streamed block to its ``forward`` and counts the graphs
    compiled once every DiT ran its first forward; private to the backend, installed with
    the hooks and removed with them (each block's own ``compile`` and ``forward`` back).
    Blocks compiled with CUDA graphs (``mode="reduce-overhead"``) make each DiT forward one
    CUDA graph step (:func:`one_cuda_graph_step_per_forward`), so the standard API works
    under DLO without the caller marking steps."""

    def __init__(self) -> None:
        self._blocks: list[StreamedBlock] = []
        self._compiled: set[StreamedBlock] = set()
        self._handles: list[RemovableHandle] = []
        self._cuda_graphs = False
        self._counter = RecompileCounter(0)

    def install(self, blocks: list[StreamedBlock], dits: dict[int, nn.Module]) -> None:
        self._blocks = list(blocks)
        self._counter = RecompileCounter(len(dits))
        for block in blocks:
            # An instance attribute shadows nn.Module.compile for this block only.
            object.__setattr__(block.module, "compile", self._compile_for(block))
        for key, dit in dits.items():
            self._handles.append(dit.register_forward_pre_hook(eager(self._step_started)))
            self._handles.append(
                dit.register_forward_hook(
                    eager(lambda _module, _args, _output, key=key: self._forward_finished(key))
                )
            )

    def _compile_for(self, block: StreamedBlock) -> Callable[..., None]:
        def compile_forward(*args: Any, **kwargs: Any) -> None:
            """Compile this streamed block's ``forward`` (``torch.compile``'s arguments);
            DLO's hooks around it stay eager."""
            module = block.module
            forward = type(module).forward.__get__(module)
            object.__setattr__(module, "forward", torch.compile(forward, *args, **kwargs))
            self._compiled.add(block)
            self._cuda_graphs = self._cuda_graphs or uses_cuda_graphs(kwargs)
            self._counter.restart()

        return compile_forward

    def _step_started(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if self._cuda_graphs:
            one_cuda_graph_step_per_forward(module, args)

    def _forward_finished(self, key: int) -> None:
        if self._compiled:
            self._counter.forward_finished(key)

    @property
    def compiled_blocks(self) -> int:
        return len(self._compiled)

    @property
    def recompiles(self) -> int:
        """Graphs compiled (process-wide) since every DiT finished its first forward after
        the blocks were compiled: a new input size or a failed guard; 0 in steady state."""
        return self._counter.recompiles if self._compiled else 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self._blocks:
            block.module.__dict__.pop("compile", None)
            if block in self._compiled:
                block.module.__dict__.pop("forward", None)
        self._blocks.clear()
        self._compiled.clear()
        self._cuda_graphs = False
        self._counter.restart()
