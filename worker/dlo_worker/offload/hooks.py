"""The per-block hot path: a circular ring of forward hooks over the streamed blocks.

Before block ``i`` runs, its hook makes sure ``i`` sits in a slot (loading it on
demand if the prefetch guessed wrong: a skipped block, a different DiT, the first
call), starts prefetching its successor into the other slot, makes the compute
stream wait for ``i``'s ready event and repoints ``i``'s parameters into the
slot. After it runs, the slot is released and the parameters go back to
placeholders. The successor of each DiT's last block is its first, so the first
block of the next denoising step is already on its way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from dlo_worker.offload.slots import SlotPair
from dlo_worker.offload.streamed_block import StreamedBlock


class BlockRing:
    """Installs and runs the hooks of every streamed block; private to the backend."""

    def __init__(self, slots: SlotPair, placeholders: dict[torch.dtype, torch.Tensor]) -> None:
        self._slots = slots
        self._placeholders = placeholders
        self._slot_in_use: dict[StreamedBlock, int] = {}
        self._handles: list[RemovableHandle] = []

    def install(self, blocks: list[StreamedBlock]) -> None:
        for block in blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._pre_hook(block)))
            self._handles.append(block.module.register_forward_hook(self._post_hook(block)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._slot_in_use.clear()

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def _pre_hook(self, block: StreamedBlock) -> Callable[..., None]:
        def pre_forward(_module: torch.nn.Module, _args: tuple) -> None:
            self.before_block(block)

        return pre_forward

    def _post_hook(self, block: StreamedBlock) -> Callable[..., None]:
        def post_forward(_module: torch.nn.Module, _args: tuple, _output: object) -> None:
            self.after_block(block)

        return post_forward

    def before_block(self, block: StreamedBlock) -> None:
        slots, counters = self._slots, self._slots.counters
        started = time.perf_counter()
        slot_index = slots.index_of(block)
        if slot_index is None:
            # Not prefetched: load into the slot the previous block did not use.
            slot_index = 1 - slots.last_used
            slots.load(block, slot_index)
            counters.on_demand_loads += 1
        successor = block.successor
        other = 1 - slot_index
        if successor not in (None, block) and slots.slots[other].block is not successor:
            slots.load(successor, other)
        slots.wait_ready(slot_index)
        if not slots.on_cuda:
            # Synchronous copies are fully exposed on the CPU.
            counters.exposed_wait_seconds += time.perf_counter() - started
            counters.waits += 1
        block.materialize(slot_index)
        slots.last_used = slot_index
        self._slot_in_use[block] = slot_index

    def after_block(self, block: StreamedBlock) -> None:
        slot_index = self._slot_in_use.pop(block)
        self._slots.release(slot_index)
        block.to_placeholders(self._placeholders)
