"""Where the residency curve's last percent goes: DLO under a GPU memory budget against
the same copies run beside the resident model, issued when DLO issues them.

At 16 and 20 GiB the synchronized step of ``flux_dlo.py --budgets`` stayed above its bound
max(resident step, streamed bytes / H2D) while the compute stream never waited for a copy.
This separates what the copies cost compute from what DLO's own mechanics cost, and
times DLO back to back as a denoising loop runs it (the answer, see docs/benchmarks.md:
the synchronization after each step waits for the copies DLO starts for the next step).

For each budget, one GPU, the Flux-class model of ``flux_dlo.py``:

- *DLO*: ``enable_dlo`` with ``gpu_memory_budget_gib``;
- *DLO, no bytes moved*: the same, with the host-to-device copies left out of the copy
  stream (its hooks, events, stream waits and parameter swaps run; the output is
  meaningless, only the time is read);
- *DLO, bytes elsewhere*: the same copies, landing in a scratch buffer the blocks never
  read;
- *resident*: every weight on the GPU;
- *resident, copies up front*: a side stream copies the streamed bytes from the step's
  start (``flux_dlo.py``'s floor);
- *resident, copies as DLO issues them*: the streamed blocks' bytes copied from a
  registered host tensor laid out as DLO's arena into two device buffers on a copy
  stream, at the points of the forward where DLO's two slots issue them (one block
  ahead, each copy after the release of the block two back), and the compute stream
  waits for each block's copy before the block runs: DLO's transfers and dependencies,
  with the weights read from where they always are;
- the same without the compute stream's waits (the transfers alone);
- DLO, the resident model and the imitation once more, steps back to back.

    python bench/residency_interference.py --budgets 16 20 --json interference.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from flux_dlo import (
    back_to_back_step_seconds,
    build_flux,
    flux_inputs,
    pinned_h2d_gbps,
    release,
    resident_beside_copies_seconds,
    step_seconds,
)
from torch import nn


def execution_order(model: nn.Module) -> list[nn.Module]:
    """Flux runs its double-stream blocks, then its single-stream blocks."""
    return [*model.transformer_blocks, *model.single_transformer_blocks]


class CopiesAsDLOIssuesThem:
    """DLO's two-slot copy schedule over byte buffers, driven by hooks on a resident model.

    Mirrors :class:`dlo_worker.offload.hooks.BlockHooks` for a fixed order: before streamed
    block ``k`` runs, ``k`` and ``k + 1`` are in the slots (loaded now if not); after it
    ran, its slot is released and refilled with ``k + 2``; a finished forward loads the
    first streamed block into the free slot.
    """

    def __init__(
        self, model: nn.Module, streamed: list[nn.Module], device: torch.device, wait: bool
    ) -> None:
        self._sizes = [sum(p.nbytes for p in block.parameters()) for block in streamed]
        largest = max(self._sizes)
        # As DLO's arena: each block from its own range of one registered host tensor,
        # written first (pages never written may all be the kernel's one zero page).
        self._source = torch.ones(sum(self._sizes), dtype=torch.uint8)
        self._offsets = [sum(self._sizes[:position]) for position in range(len(self._sizes))]
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(self._source.data_ptr(), self._source.nbytes, 0)) == 0
        self._slots = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]
        self._ready = [torch.cuda.Event() for _ in range(2)]
        self._released = [torch.cuda.Event() for _ in range(2)]
        for event in self._released:
            event.record()
        self._holds: list[int | None] = [None, None]
        self._last_used = 1
        self._wait = wait
        self._copy_stream = torch.cuda.Stream(device)
        self._handles = []
        for position, block in enumerate(streamed):
            self._handles.append(block.register_forward_pre_hook(self._before(position)))
            self._handles.append(block.register_forward_hook(self._after(position)))
        self._handles.append(
            model.register_forward_hook(lambda *_: self._load_first_into_free_slot())
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(self._source.data_ptr())

    def _slot_of(self, position: int) -> int | None:
        return self._holds.index(position) if position in self._holds else None

    def _load(self, position: int, slot: int) -> None:
        self._holds[slot] = position
        size = self._sizes[position]
        self._copy_stream.wait_event(self._released[slot])
        with torch.cuda.stream(self._copy_stream):
            start = self._offsets[position]
            self._slots[slot][:size].copy_(self._source[start : start + size], non_blocking=True)
        self._ready[slot].record(self._copy_stream)

    def _before(self, position: int) -> Callable[..., None]:
        def before(*_: object) -> None:
            slot = self._slot_of(position)
            if slot is None:
                slot = 1 - self._last_used
                self._load(position, slot)
            following = position + 1
            if following < len(self._sizes) and self._slot_of(following) is None:
                self._load(following, 1 - slot)
            if self._wait:
                torch.cuda.current_stream().wait_event(self._ready[slot])
            self._last_used = slot

        return before

    def _after(self, position: int) -> Callable[..., None]:
        def after(*_: object) -> None:
            slot = self._slot_of(position)
            self._released[slot].record(torch.cuda.current_stream())
            after_next = position + 2
            if (
                after_next < len(self._sizes)
                and self._holds[1 - slot] == position + 1
                and self._slot_of(after_next) is None
            ):
                self._load(after_next, slot)

        return after

    def _load_first_into_free_slot(self) -> None:
        if self._slot_of(0) is None:
            self._load(0, 1 - self._last_used)


@contextmanager
def copies_replaced_by(replacement: Callable[..., None]) -> Iterator[None]:
    """DLO's host-to-device copies done by ``replacement`` (a diagnostic of this
    benchmark only: the variants below time DLO with its copies changed)."""
    from dlo_worker.offload.slots import SlotPair

    original = SlotPair._copy_host_to_device
    SlotPair._copy_host_to_device = replacement
    try:
        yield
    finally:
        SlotPair._copy_host_to_device = original


def dlo_rows(device: torch.device, inputs: dict, budget: float, repeats: int) -> dict:
    """DLO at ``budget``, then without its copies; which blocks it streamed."""
    from dlo_worker.offload import enable_dlo
    from dlo_worker.offload.slots import SlotPair

    model = build_flux(device)
    release(device)
    backend = enable_dlo(model, device=device, use_allgather=False, gpu_memory_budget_gib=budget)
    # Streamed blocks hold empty placeholders between forwards.
    streamed = [
        index
        for index, block in enumerate(execution_order(model))
        if all(p.numel() == 0 for p in block.parameters())
    ]
    streamed_bytes = sum(layout.nbytes for layout in backend.block_layouts())
    row = {"budget_gib": budget, "streamed_blocks": streamed, "streamed_bytes": streamed_bytes}
    row["dlo_s"] = step_seconds(model, inputs, repeats)
    row["dlo_back_to_back_s"] = back_to_back_step_seconds(model, inputs, repeats)
    with copies_replaced_by(lambda self, copies, targets: None):
        row["dlo_no_bytes_s"] = step_seconds(model, inputs, repeats)
    # The same copies, landing in a scratch buffer the blocks never read (the slots keep
    # stale weights): DLO's transfers without compute reading what they wrote.
    largest = max(layout.nbytes for layout in backend.block_layouts())
    scratch = torch.empty(largest, dtype=torch.uint8, device=device)

    def elsewhere(self: SlotPair, copies: list, targets: dict) -> None:
        offset = 0
        for _dtype, _offset, source in copies:
            target = scratch[offset : offset + source.nbytes]
            target.copy_(source.view(torch.uint8), non_blocking=True)
            offset += source.nbytes

    with copies_replaced_by(elsewhere):
        row["dlo_bytes_elsewhere_s"] = step_seconds(model, inputs, repeats)
    stats = backend.stats()
    row["blocks_loaded"], row["on_demand_loads"] = stats.blocks_loaded, stats.on_demand_loads
    backend.disable()
    del model, backend
    release(device)
    return row


def resident_rows(device: torch.device, inputs: dict, rows: list[dict], repeats: int) -> float:
    """The resident model beside each budget's copies; returns the resident step."""
    model = build_flux(device)
    release(device)
    resident = step_seconds(model, inputs, repeats)
    for row in rows:
        row["resident_back_to_back_s"] = back_to_back_step_seconds(model, inputs, repeats)
    order = execution_order(model)
    for row in rows:
        row["copies_up_front_s"] = resident_beside_copies_seconds(
            model, inputs, row["streamed_bytes"], repeats
        )
        streamed = [order[index] for index in row["streamed_blocks"]]
        for wait, key in ((True, "copies_as_dlo_s"), (False, "copies_as_dlo_no_wait_s")):
            copies = CopiesAsDLOIssuesThem(model, streamed, device, wait)
            row[key] = step_seconds(model, inputs, repeats)
            if wait:
                row["copies_as_dlo_back_to_back_s"] = back_to_back_step_seconds(
                    model, inputs, repeats
                )
            copies.remove()
            del copies
            release(device)
    del model
    release(device)
    return resident


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[16.0, 20.0])
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    bandwidth = pinned_h2d_gbps(device)
    inputs = flux_inputs(args.resolution, device)
    rows = [dlo_rows(device, inputs, budget, args.repeats) for budget in args.budgets]
    resident = resident_rows(device, inputs, rows, args.repeats)
    print(
        f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, pinned H2D "
        f"{bandwidth:.1f} GB/s, {args.resolution}x{args.resolution}, resident {resident:.4f} s"
    )
    for row in rows:
        row["bound_s"] = max(resident, row["streamed_bytes"] / (bandwidth * 1e9))
        ratios = {
            key: row[key] / row["bound_s"]
            for key in (
                "dlo_s",
                "dlo_back_to_back_s",
                "resident_back_to_back_s",
                "copies_as_dlo_back_to_back_s",
                "dlo_no_bytes_s",
                "dlo_bytes_elsewhere_s",
                "copies_up_front_s",
                "copies_as_dlo_s",
                "copies_as_dlo_no_wait_s",
            )
        }
        row["over_bound"] = ratios
        print(
            f"budget {row['budget_gib']:g} GiB: {len(row['streamed_blocks'])} streamed, "
            f"{row['streamed_bytes'] / 2**30:.2f} GiB, bound {row['bound_s']:.4f} s, "
            f"{row['blocks_loaded']} loads ({row['on_demand_loads']} on demand) | "
            + " | ".join(f"{key} {row[key]:.4f} s = {ratio:.3f}x" for key, ratio in ratios.items())
        )
    if args.json:
        args.json.write_text(
            json.dumps({"resident_s": resident, "h2d_gbps": bandwidth, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
