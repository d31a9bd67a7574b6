"""The per-block hot path: forward hooks on every streamed block and on every DiT.

Before block ``i`` runs, its hook asks the :class:`~dlo_worker.offload.schedule.Schedule`
what follows, makes sure ``i`` sits in a slot (loading it on demand if the prefetch
guessed wrong: the first forward of a new order, a skipped block, a block run outside a
DiT forward), starts loading the predicted successor into the other slot, makes the
compute stream wait for ``i``'s ready event and repoints ``i``'s parameters into the
slot. After it runs (also when its forward raised), the slot is released and the
parameters go back to placeholders. The DiT hooks mark where a forward starts and ends,
so the schedule can learn the order blocks really run in. Every hook runs eagerly, outside
any compiled graph (:mod:`~dlo_worker.offload.compiling`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo_worker.offload.block import StreamedBlock
from dlo_worker.offload.compiling import eager
from dlo_worker.offload.ranges import profiled
from dlo_worker.offload.schedule import Prediction, Schedule
from dlo_worker.offload.slots import SlotPair


class BlockHooks:
    """Installs and runs the hooks of every streamed block and DiT; private to the backend."""

    def __init__(
        self,
        slots: SlotPair,
        schedule: Schedule,
    ) -> None:
        self._slots = slots
        self._schedule = schedule
        self._slot_in_use: dict[StreamedBlock, int] = {}
        self._predicted: dict[StreamedBlock, Prediction] = {}
        self._handles: list[RemovableHandle] = []

    def install(self, blocks: list[StreamedBlock], dits: dict[int, nn.Module]) -> None:
        for block in blocks:
            self._handles.append(
                block.module.register_forward_pre_hook(eager(self._pre_hook(block)))
            )
            self._handles.append(
                block.module.register_state_dict_post_hook(_streamed_weights_empty(block))
            )
            self._handles.append(
                block.module.register_forward_hook(eager(self._post_hook(block)), always_call=True)
            )
        for key, dit in dits.items():
            self._handles.append(
                dit.register_forward_pre_hook(
                    eager(
                        lambda _module, _args, key=key: self._prefetch(
                            self._schedule.forward_started(key)
                        )
                    )
                )
            )
            self._handles.append(
                dit.register_forward_hook(
                    eager(
                        lambda _module, _args, _output, key=key: self._prefetch(
                            self._schedule.forward_finished(key)
                        )
                    ),
                    always_call=True,
                )
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._slot_in_use.clear()
        self._predicted.clear()

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def _pre_hook(self, block: StreamedBlock) -> Callable[..., None]:
        def pre_forward(_module: torch.nn.Module, _args: tuple[object, ...]) -> None:
            self.before_block(block)

        return pre_forward

    def _post_hook(self, block: StreamedBlock) -> Callable[..., None]:
        def post_forward(
            _module: torch.nn.Module, _args: tuple[object, ...], _output: object
        ) -> None:
            self.after_block(block)

        return post_forward

    def _prefetch(self, prediction: Prediction) -> None:
        """Load a DiT's first block into the free slot unless a slot already holds it."""
        first, slots = prediction.successor, self._slots
        if first is None or slots.index_of(first) is not None or self._slot_in_use:
            return
        slots.load(first, 1 - slots.last_used, upcoming=prediction.following)

    def before_block(self, block: StreamedBlock) -> None:
        with profiled("pre_forward", block.name):
            self._before_block(block)

    def _before_block(self, block: StreamedBlock) -> None:
        slots, counters = self._slots, self._slots.counters
        started = time.perf_counter()
        with slots.exposed():
            slot_index, prediction = self._load_and_wait(block)
        # Claimed from here: the post-hook releases the slot even if what follows raises.
        self._slot_in_use[block] = slot_index
        self._predicted[block] = prediction
        slots.last_used = slot_index
        if not slots.on_cuda:
            # Synchronous copies are fully exposed on the CPU.
            counters.exposed_wait_seconds += time.perf_counter() - started
            counters.waits += 1
        with profiled("repoint", block.name):
            block.materialize(slot_index)

    def _load_and_wait(self, block: StreamedBlock) -> tuple[int, Prediction]:
        """Load ``block`` unless prefetched, start the next load, and order compute after
        ``block``'s copy: the slot it runs from and what the schedule expects next."""
        slots, counters = self._slots, self._slots.counters
        prediction = self._schedule.block_started(block)
        slot_index = slots.index_of(block)
        if slot_index is None:
            # Not prefetched: load into the slot the previous block did not use.
            slot_index = 1 - slots.last_used
            upcoming = (prediction.successor, *prediction.following) if prediction.successor else ()
            slots.load(block, slot_index, upcoming=upcoming)
            counters.on_demand_loads += 1
        successor, other = prediction.successor, 1 - slot_index
        if successor not in (None, block) and slots.slots[other].block is not successor:
            slots.load(successor, other, upcoming=prediction.following)
        if slots.shards > 1 and successor is not None:
            slots.copy_shards_ahead((successor, *prediction.following))
        slots.wait_ready(slot_index)
        return slot_index, prediction

    def after_block(self, block: StreamedBlock) -> None:
        """Release the slot and refill it at once with the block after next (the copy waits
        for the release on the copy stream). Runs even when the block's forward raised, so
        the slot is never left claimed."""
        with profiled("post_forward", block.name):
            self._after_block(block)

    def _after_block(self, block: StreamedBlock) -> None:
        slot_index = self._slot_in_use.pop(block, None)
        prediction = self._predicted.pop(block, Prediction())
        block.to_placeholders()
        if slot_index is None:
            return
        slots = self._slots
        slots.release(slot_index)
        following = prediction.then
        if (
            following not in (None, block, prediction.successor)
            and slots.index_of(following) is None
            and slots.slots[1 - slot_index].block is prediction.successor
        ):
            # A staged load packs before it returns: compute waits where the block that
            # just ran is shorter than the pack.
            with slots.exposed():
                slots.load(following, slot_index, upcoming=prediction.following[1:])


def _streamed_weights_empty(block: StreamedBlock) -> Callable[..., None]:
    """A ``state_dict`` post-hook: the block's streamed weights appear as empty tensors,
    as they are between runs, rather than as their placeholders' one repeated element
    (a saved copy would load without error and hold nothing real). ``keep_vars=True``
    asks for the Parameter objects themselves, which are left in."""

    def hook(
        _module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: object
    ) -> None:
        for parameter, dtype, *_, name in block.parameters:
            key = prefix + name
            if key in state_dict and not isinstance(state_dict[key], nn.Parameter):
                state_dict[key] = torch.empty(0, dtype=dtype, device=parameter.device)

    return hook
