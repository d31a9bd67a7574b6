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


class BlockCompilation:
    """Routes ``compile()`` on each streamed block to its ``forward`` and counts the graphs
    compiled once every DiT ran its first forward; private to the backend, installed with
    the hooks and removed with them (each block's own ``compile`` and ``forward`` back)."""

    def __init__(self) -> None:
        self._blocks: list[StreamedBlock] = []
        self._compiled: set[StreamedBlock] = set()
        self._handles: list[RemovableHandle] = []
        self._dits = 0
        self._graphs_after_first_forward: dict[int, int] = {}
        """Per DiT, Dynamo's graph count when its first forward after a compile finished."""

    def install(self, blocks: list[StreamedBlock], dits: dict[int, nn.Module]) -> None:
        self._blocks = list(blocks)
        self._dits = len(dits)
        for block in blocks:
            # An instance attribute shadows nn.Module.compile for this block only.
            object.__setattr__(block.module, "compile", self._compile_for(block))
        for key, dit in dits.items():
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
            self._graphs_after_first_forward.clear()

        return compile_forward

    def _forward_finished(self, key: int) -> None:
        if self._compiled:
            self._graphs_after_first_forward.setdefault(key, compiled_graphs())

    @property
    def compiled_blocks(self) -> int:
        return len(self._compiled)

    @property
    def recompiles(self) -> int:
        """Graphs compiled (process-wide) since every DiT finished its first forward after
        the blocks were compiled: a new input size or a failed guard; 0 in steady state."""
        counts = self._graphs_after_first_forward
        if not self._compiled or len(counts) < self._dits:
            return 0
        return compiled_graphs() - max(counts.values())

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
        self._graphs_after_first_forward.clear()
