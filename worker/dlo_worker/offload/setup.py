"""The steps of ``enable`` that give streamed blocks their shape and their host side.

The backend owns the order and the lifecycle; this module owns what each step does:
which blocks stay resident, each streamed block's layout and mapped pieces, the DiT
tensors the host weights bind that do not stream (copied to the device once), the
page-locked arena the blocks are packed into, and for mapped blocks the choice between
registering them with the driver and packing them through staging.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from dlo_worker.native import NOT_BUILT, staging_ring_library
from dlo_worker.offload import adapters
from dlo_worker.offload.block import MappedPiece, StreamedBlock, StreamedParameter, coalesce
from dlo_worker.offload.config import OffloadConfig
from dlo_worker.offload.errors import OffloadSetupError
from dlo_worker.offload.feeds.arena import HostArena
from dlo_worker.offload.feeds.registration import RegisteredRanges, RegistrationRefusedError
from dlo_worker.offload.feeds.ring import StagingRing, check_built
from dlo_worker.offload.feeds.staging import HostStaging, Packer, wait_all
from dlo_worker.offload.host_weights import HostWeights, HostWeightsError
from dlo_worker.offload.layout import layout_of, shard_bounds, slot_capacity, streamed_parameters
from dlo_worker.offload.params import assign_tensor, pack_block, parameter_bytes, set_parameter_data
from dlo_worker.offload.plan import DiTPlan, OffloadPlan
from dlo_worker.offload.residency import resident_within_budget, spread_evenly
from dlo_worker.offload.slots import SlotPair, TransferCounters

logger = logging.getLogger(__name__)


def choose_resident(plan: OffloadPlan, config: OffloadConfig) -> set[int]:
    """Ids of the blocks that stay on the device: ``resident_layers`` per DiT, or as many
    as the GPU memory budget holds after non-block weights and the two slots."""
    budget = config.gpu_memory_budget_bytes
    if budget is None:
        return {
            id(dit.blocks[index][1])
            for dit in plan.dits
            for index in spread_evenly(len(dit.blocks), config.resident_layers)
        }
    blocks = [block for dit in plan.dits for _, block in dit.blocks]
    # LoRA adapters stay on the device whether their block streams or not: counted with
    # the non-block weights, never in a block's bytes (nor in the slots).
    adapter_ids = {id(p) for block in blocks for p in adapters.adapter_parameters(block)}
    block_bytes = [
        parameter_bytes(p for p in block.parameters() if id(p) not in adapter_ids)
        for block in blocks
    ]
    block_ids = {id(p) for block in blocks for p in block.parameters()} - adapter_ids
    non_block = sum(
        parameter_bytes(p for p in dit.module.parameters() if id(p) not in block_ids)
        + parameter_bytes(dit.module.buffers())
        for dit in plan.dits
    )
    non_block += config.adapter_bytes
    slots = 2 * max(block_bytes, default=0)
    available = budget - non_block - slots
    if available < 0:
        raise OffloadSetupError(
            f"--dlo-gpu-memory-budget-gib {budget / 2**30:.2f} cannot hold the DiT's "
            f"non-block weights and LoRA adapters ({non_block / 2**30:.2f} GiB) and the two "
            f"slots ({slots / 2**30:.2f} GiB); raise it to at least "
            f"{(non_block + slots) / 2**30:.2f} GiB"
        )
    chosen = resident_within_budget(block_bytes, available)
    logger.info(
        "dlo residency from the budget",
        extra={
            "fields": {
                "budget_gib": round(budget / 2**30, 3),
                "non_block_gib": round(non_block / 2**30, 3),
                "slot_gib": round(slots / 2**30, 3),
                "resident_blocks": len(chosen),
                "resident_gib": round(sum(block_bytes[i] for i in chosen) / 2**30, 3),
            }
        },
    )
    return {id(blocks[index]) for index in chosen}


class StreamSetup:
    """What one ``enable`` knows about where the weights come from and how they are split:
    the configuration, the device, the loader's host weights and this rank's shard."""

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device,
        host_weights: HostWeights | None,
        shards: int,
        rank: int,
    ) -> None:
        self.config = config
        self.device = device
        self.host_weights = host_weights
        self.shards = shards
        self.rank = rank

    def check_plan_covers(self, plan: OffloadPlan) -> None:
        """Refuse host weights that bind a DiT the pipeline does not have."""
        if self.host_weights is None:
            return
        unknown = sorted(set(self.host_weights.components) - {dit.name for dit in plan.dits})
        if unknown:
            raise HostWeightsError(
                f"the host weights bind {', '.join(unknown)} but the pipeline has no such "
                "DiT; hand them to the backend of the pipeline it was loaded with"
            )

    def describe(
        self, dit: DiTPlan, name: str, block: nn.Module, resident_parameter_ids: set[int]
    ) -> StreamedBlock:
        """The streamed block: its packed layout and, where the host weights bind
        its DiT, the mapped pieces it is read from."""
        named = streamed_parameters(block, resident_parameter_ids)
        layout = layout_of(named)
        spans = {
            span.name: span
            for dtype_layout in layout.by_dtype.values()
            for span in dtype_layout.spans
        }
        entries = []
        for param_name, parameter in named:
            span = spans[param_name]
            entries.append(
                StreamedParameter(
                    parameter, parameter.dtype, span.offset, span.numel, span.shape, param_name
                )
            )
        streamed = StreamedBlock(
            name=f"{dit.name}.{name}", module=block, layout=layout, parameters=entries
        )
        if self.host_weights is not None and dit.name in self.host_weights.components:
            streamed.mapped = self._mapped_pieces(self.host_weights, dit, name, entries)
        return streamed

    @staticmethod
    def _mapped_pieces(
        host_weights: HostWeights,
        dit: DiTPlan,
        block_name: str,
        entries: list[StreamedParameter],
    ) -> dict[torch.dtype, list[MappedPiece]]:
        """Flat views of the mapped checkpoint for every parameter, in layout order."""
        pieces: dict[torch.dtype, list[MappedPiece]] = {}
        for entry in entries:
            view = host_weights.tensor(dit.name, f"{block_name}.{entry.name}")
            if not view.is_contiguous() or view.dtype != entry.dtype:
                raise HostWeightsError(
                    f"{dit.name}.{block_name}.{entry.name}: the mapped view is not a contiguous "
                    f"{entry.dtype} tensor; the loader's preflight and the model disagree"
                )
            pieces.setdefault(entry.dtype, []).append(
                MappedPiece(entry.offset, entry.numel, view.reshape(-1))
            )
        return {
            dtype: coalesce(sorted(dtype_pieces, key=lambda piece: piece.offset))
            for dtype, dtype_pieces in pieces.items()
        }

    def materialize_unstreamed(
        self,
        plan: OffloadPlan,
        streamed: list[tuple[DiTPlan, str, nn.Module]],
        resident_parameter_ids: set[int],
    ) -> None:
        """Copy every DiT tensor bound to the host weights that does not stream onto the device.

        Embedders, norms, resident layers and persistent buffers are small; they are
        copied out of the mapping once. Streamed parameters stay bound to the host weights.
        """
        host_weights = self.host_weights
        if host_weights is None:
            return
        streamed_names: dict[str, set[str]] = {}
        for dit, name, block in streamed:
            streamed_names.setdefault(dit.name, set()).update(
                f"{name}.{param_name}"
                for param_name, parameter in block.named_parameters()
                if id(parameter) not in resident_parameter_ids
            )
        for dit in plan.dits:
            if dit.name not in host_weights.components:
                continue
            skipped = streamed_names.get(dit.name, set())
            for tensor_name in dit.module.state_dict(keep_vars=True):
                if tensor_name in skipped:
                    continue
                value = host_weights.tensor(dit.name, tensor_name).to(self.device, copy=True)
                assign_tensor(dit.module, tensor_name, value)

    def _staged(self, block: StreamedBlock) -> bool:
        """A mapped block streamed rank-locally keeps its mapping (registered or staged);
        every other block is packed into the arena."""
        return bool(block.mapped) and self.shards == 1

    def arena_for(self, blocks: list[StreamedBlock]) -> HostArena:
        """The page-locked (on CUDA) arena holding every block that is not staged."""
        numel_by_dtype: dict[torch.dtype, int] = {}
        for block in blocks:
            if self._staged(block):
                continue
            for dtype, layout in block.layout.by_dtype.items():
                numel_by_dtype[dtype] = numel_by_dtype.get(dtype, 0) + layout.shard_numel(
                    self.shards
                )
        return HostArena(numel_by_dtype, page_lock=self.device.type == "cuda")

    def fill_host(self, blocks: list[StreamedBlock], arena: HostArena, packer: Packer) -> None:
        """Give every block its host side (see the backend's docstring), then drop the
        loader's copy of its parameters."""
        staged = [block for block in blocks if self._staged(block)]
        in_arena = [block for block in blocks if not self._staged(block)]
        # Packing tens of GiB (read from disk on a cold page cache) takes a while: show it.
        progress = tqdm(in_arena, desc="DLO host weights", unit="block", disable=len(in_arena) < 2)
        for block in progress:
            for dtype, layout in block.layout.by_dtype.items():
                target = arena.take(dtype, layout.shard_numel(self.shards))
                block.arena_views[dtype] = target
                start, stop = shard_bounds(layout.numel, self.shards, self.rank)
                if block.mapped:
                    # Straight from the mapped checkpoint: only this rank's range is read.
                    wait_all(packer.pack(block.mapped[dtype], start, stop, target))
                elif self.shards == 1:
                    pack_block(block, dtype, target)
                else:
                    # Pack where the loader left the weights (the GPU packs far faster),
                    # then keep only this rank's shard on the host.
                    source_device = next(
                        entry.parameter.device for entry in block.parameters if entry.dtype == dtype
                    )
                    flat = torch.empty(
                        layout.padded_numel(self.shards), dtype=dtype, device=source_device
                    )
                    pack_block(block, dtype, flat)
                    target.copy_(flat[start:stop])
            block.mapped = {}
        for block in blocks:
            for parameter, *_ in block.parameters:
                set_parameter_data(parameter, torch.empty(0, dtype=parameter.dtype))
        if self.host_weights is not None and not staged:
            # Every shard is prepared: the source mapping is no longer needed.
            self.host_weights.close()

    def register(self, blocks: list[StreamedBlock]) -> tuple[RegisteredRanges | None, str]:
        """Register the mapped views of ``blocks`` for direct copies, or None (staging), with
        the outcome ``stats`` reports; logs why registration was refused."""
        budget = self.config.pin_limit_bytes
        if budget <= 0:
            return None, "off"
        if self.device.type != "cuda":
            refused = RegistrationRefusedError("cpu", "host registration needs a CUDA device")
        elif self.host_weights is None or not self.host_weights.registrable:
            refused = RegistrationRefusedError(
                "adapter",
                "the mapped weights go through a checkpoint adapter, so the mapping is not the "
                "final layout; enable the runtime cache to register its final tensors",
            )
        else:
            from dlo_worker.offload.feeds.cuda_registrar import CudaHostRegistrar

            places = [
                (pieces, index)
                for block in blocks
                for pieces in block.mapped.values()
                for index in range(len(pieces))
            ]
            try:
                registered = RegisteredRanges.register(
                    [pieces[index].view for pieces, index in places],
                    CudaHostRegistrar(self.device),
                    budget_bytes=budget,
                    timeout_s=self.config.host_registration_timeout_s,
                )
            except RegistrationRefusedError as error:
                refused = error
            else:
                # Copy from the registered (shared-mapping) views of the same bytes; views
                # of one file share a storage, so neighbours in file and layout coalesce.
                for (pieces, index), view in zip(places, registered.views, strict=True):
                    pieces[index] = pieces[index]._replace(view=view.reshape(-1))
                for block in blocks:
                    block.mapped = {
                        dtype: coalesce(pieces) for dtype, pieces in block.mapped.items()
                    }
                return registered, "registered"
        logger.warning(
            "host registration refused, staging instead",
            extra={"fields": {"reason": refused.reason, "why": str(refused)}},
        )
        return None, refused.reason

    def stage(
        self,
        mapped: list[StreamedBlock],
        slots: SlotPair,
        packer: Packer,
        counters: TransferCounters,
    ) -> tuple[HostStaging | StagingRing, str]:
        """The bounded staging of unregistered mapped blocks and why it is this kind
        (``default``, ``configured``, ``not-built``): the native chunk ring where it was
        built (``config.staging`` auto or ring), else the ring of block-sized buffers."""
        choice = self.config.staging
        built = staging_ring_library() is not None
        if choice == "ring":
            check_built()
        if choice != "buffers" and built:
            ring = StagingRing(
                self.device,
                slots.copy_stream,
                counters,
                lanes=self.config.pack_threads,
                chunk_bytes=self.config.ring_chunk_bytes,
                chunks=self.config.staging_ring_chunks_per_thread * self.config.pack_threads,
            )
            return ring, "configured" if choice == "ring" else "default"
        if choice == "auto":
            logger.warning("staging through block buffers", extra={"fields": {"why": NOT_BUILT}})
        buffers = HostStaging(
            slot_capacity([block.layout for block in mapped], 1),
            packer,
            counters,
            page_lock=self.device.type == "cuda",
            depth=self.config.staging_buffers,
        )
        return buffers, "configured" if choice == "buffers" else "not-built"
