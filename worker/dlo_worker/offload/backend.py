"""DistributedLayerwiseOffloadBackend: setup and teardown owner of DLO.

``enable`` discovers the DiTs and their blocks, keeps everything that is not a
streamed block on the device, fills the host side of every streamed block,
allocates the two shared device slots, installs the hooks and primes the first
block. ``disable`` synchronizes, removes the hooks and frees every buffer; it
runs before the worker destroys any process group.

The backend is a small state machine (:class:`BackendState`): ``enable`` moves
``created``/``disabled`` to ``enabled`` or, if any step fails, releases what the
earlier steps acquired (hooks, page-locked memory, packer threads, slots, the
DiTs' mark) and lands in ``disabled`` before re-raising; ``disable`` is
idempotent. Each DiT it streams is marked, so a second backend, diffusers' group
offloading or accelerate's hooks on the same DiT are refused at enable time.

The host side follows the loader's choice (design doc, "Host backing and transfer
composition"):

- ordinary tensors: each block is packed into a page-locked arena (complete, or
  this rank's 1/N shard for AllGather) and the loader's copy is freed;
- a :class:`~dlo_worker.offload.host_weights.HostWeightSource` (the loader's checkpoint
  ``HostWeightPlan``), AllGather: each rank packs its shard from
  the mapped files into the arena, then the plan's mappings are closed;
- a mapped source (checkpoint plan or runtime-cache entry), rank-local: blocks keep
  only immutable views of the mapped files. With a registration budget
  (``host_registration_budget_bytes``) on CUDA, the views' ranges are registered with
  the driver and each load copies them directly (:mod:`~dlo_worker.offload.feeds.direct`);
  otherwise, or if registration is refused (budget, platform, a deferred adapter, a
  failed call: all or nothing, the reason is logged and reported in ``stats``), they
  are packed through bounded pinned staging: block-sized buffers
  (:mod:`~dlo_worker.offload.feeds.staging`) or, with ``staging_ring``, a cache-sized ring of
  chunks fed by native threads (:mod:`~dlo_worker.offload.feeds.ring`).

With a plan the DiT was never materialized, so failing to consume the plan is a
hard error (:class:`HostWeightPlanError`), never a fallback.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from dlo_worker.errors import UserFixableError
from dlo_worker.offload.block import MappedPiece, StreamedBlock, StreamedParameter, coalesce
from dlo_worker.offload.config import OffloadConfig
from dlo_worker.offload.feeds.arena import ARENA, HostArena
from dlo_worker.offload.feeds.direct import DIRECT
from dlo_worker.offload.feeds.registration import RegisteredRanges, RegistrationRefusedError
from dlo_worker.offload.feeds.ring import StagingRing
from dlo_worker.offload.feeds.staging import HostStaging, Packer, wait_all
from dlo_worker.offload.hooks import BlockHooks
from dlo_worker.offload.host_weights import HostWeightPlanError, HostWeightSource
from dlo_worker.offload.layout import (
    BlockLayout,
    layout_of,
    shard_bounds,
    slot_capacity,
    streamed_parameters,
)
from dlo_worker.offload.plan import DiTPlan, OffloadPlan, discover
from dlo_worker.offload.residency import resident_within_budget, spread_evenly
from dlo_worker.offload.schedule import Schedule
from dlo_worker.offload.slots import SlotPair, TransferCounters

logger = logging.getLogger(__name__)


class OffloadSetupError(RuntimeError, UserFixableError):
    """The model cannot be streamed as asked (shared parameters, bad group, second enable)."""


class UnsupportedHostBackingError(ValueError, UserFixableError):
    """The object passed as ``plan`` is not a HostWeightSource this backend can consume."""


class BackendState(StrEnum):
    CREATED = "created"
    """Nothing held yet."""
    ENABLED = "enabled"
    """Hooks installed; host memory (page-locked on CUDA), packer threads and the two
    device slots held; every streamed DiT marked."""
    DISABLED = "disabled"
    """Everything released (after ``disable`` or a failed ``enable``); the streamed blocks
    hold empty placeholders, so the model must be loaded again before it runs."""


MARK = "_dlo_backend"
"""Attribute set on every DiT a backend streams (as diffusers marks modules with hooks)."""
FOREIGN_HOOKS = {
    "_diffusers_hook": "diffusers hooks (group offloading, layerwise casting, caching)",
    "_hf_hook": "accelerate hooks (enable_model_cpu_offload, device_map)",
}


CONTEXT_PARALLEL_HOOK_PREFIXES = ("cp_input---", "cp_output---")
"""diffusers' context-parallel hooks (sequence parallelism) split and gather activations
and never touch weights, so DLO streams a DiT that carries them."""


def _only_context_parallel(hooks: object) -> bool:
    names = getattr(hooks, "hooks", None)
    return isinstance(names, dict) and all(
        name.startswith(CONTEXT_PARALLEL_HOOK_PREFIXES) for name in names
    )


@dataclass(frozen=True)
class OffloadStats:
    """What DLO did so far; exported by the metrics endpoint."""

    transfer_mode: str
    host_backing: str
    """``ordinary`` or ``checkpoint-mmap`` (the loader's choice, consumed here)."""
    shards: int
    streamed_blocks: int
    resident_blocks: int
    blocks_loaded: int
    on_demand_loads: int
    """Blocks that were not prefetched when they ran (the first forward of a new order)."""
    order_changes: int
    """Forwards whose block order differed from the learned one (then relearned)."""
    bytes_streamed: int
    """Host-to-device bytes copied by this rank."""
    allgather_bytes: int
    exposed_wait_seconds: float
    """Total time compute waited for weights."""
    exposed_wait_seconds_per_block: float
    h2d_seconds: float
    h2d_gbps: float
    host_bytes: int
    """Private host bytes holding streamed weights on this rank (page-locked on CUDA)."""
    staging_bytes: int
    """The two pinned staging buffers of checkpoint-backed rank-local streaming."""
    staging: str
    """Unregistered mapped blocks: ``ring`` (the native chunk ring) or ``buffers``
    (block-sized buffers); ``none`` without staging."""
    host_registration: str
    """Mapped blocks: ``registered`` (direct copies), ``off`` (no budget), or why staging
    is used (``budget``, ``unsupported``, ``cpu``, ``adapter``, ``not-mapped``, ``failed``,
    ``timeout``, ``not-pinned``); ``none`` without mapped blocks."""
    registered_bytes: int
    """Host bytes registered with the driver for direct copies (page-locked, shared)."""
    pack_gbps: float
    """Staging pack rate (bytes packed / pack wall time)."""
    pack_wait_seconds: float
    host_page_locked: bool
    device_slot_bytes: int
    largest_block_bytes: int


def _release_freed_host_memory() -> None:
    """Return freed host tensors to the OS now rather than at some later malloc."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        logger.debug("malloc_trim unavailable; freed memory stays with the allocator")


class DistributedLayerwiseOffloadBackend:
    """Streams DiT blocks through two device slots; see the module docstring."""

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        plan: HostWeightSource | None = None,
    ) -> None:
        if plan is not None and not isinstance(plan, HostWeightSource):
            raise UnsupportedHostBackingError(
                "plan must be a HostWeightSource (e.g. DiffusersPipelineLoader."
                f"take_host_weight_plan()), got {type(plan).__name__}"
            )
        self.config = config
        self.host_weight_plan = plan
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._shards, self._rank = self._sharding()
        self.state = BackendState.CREATED
        self._counters = TransferCounters()
        self._blocks: list[StreamedBlock] = []
        self._resident_blocks = 0
        self._arena: HostArena | None = None
        self._staging: HostStaging | StagingRing | None = None
        self._staging_kind = "none"
        self._registered: RegisteredRanges | None = None
        self._registration = "none"
        self._packer: Packer | None = None
        self._slots: SlotPair | None = None
        self._hooks: BlockHooks | None = None
        self._schedule: Schedule | None = None
        self._plan: OffloadPlan | None = None
        self._marked: list[nn.Module] = []

    @property
    def enabled(self) -> bool:
        return self.state == BackendState.ENABLED

    @property
    def plan(self) -> OffloadPlan | None:
        return self._plan

    def _sharding(self) -> tuple[int, int]:
        group = self.config.process_group
        if not self.config.use_allgather or group is None:
            return 1, 0
        size = dist.get_world_size(group)
        return size, dist.get_rank(group)

    def enable(self, model_or_pipeline: object) -> DistributedLayerwiseOffloadBackend:
        """Take over the DiT blocks of ``model_or_pipeline``; returns ``self``.

        All or nothing: if a step fails, what the earlier steps acquired is released
        and the error propagates (the backend is then ``disabled``).
        """
        if self.state == BackendState.ENABLED:
            raise OffloadSetupError("DLO is already enabled on this backend; disable() it first")
        if self.host_weight_plan is not None and self.host_weight_plan.closed:
            raise HostWeightPlanError(
                "the host-weight plan was already consumed and closed; load the model again"
            )
        started = time.perf_counter()
        plan = discover(model_or_pipeline, self.config.block_paths)
        self._check_plan_covers(plan)
        self._check_not_taken(plan)
        self._counters = TransferCounters()
        self._registration = "none"
        self._staging_kind = "none"
        try:
            self._enable(model_or_pipeline, plan)
        except BaseException:
            self._release()
            self.state = BackendState.DISABLED
            raise
        self.state = BackendState.ENABLED
        logger.info(
            "dlo enabled",
            extra={
                "fields": {
                    "streamed_blocks": len(self._blocks),
                    "resident_blocks": self._resident_blocks,
                    "shards": self._shards,
                    "host_backing": self._host_backing,
                    "host_gib": round(self._arena.nbytes / 2**30, 3),
                    "staging_gib": round(self._staging.nbytes / 2**30, 3) if self._staging else 0,
                    "host_registration": self._registration,
                    "staging": self._staging_kind,
                    "pack_threads": self._packer.threads,
                    "slot_gib": round(self._slots.device_bytes / 2**30, 3),
                    "setup_s": round(time.perf_counter() - started, 3),
                }
            },
        )
        return self

    def _check_not_taken(self, plan: OffloadPlan) -> None:
        """Refuse a DiT another backend streams, or that carries foreign offload hooks."""
        for dit in plan.dits:
            owner = getattr(dit.module, MARK, None)
            if owner is not None and owner is not self:
                raise OffloadSetupError(
                    f"{dit.name} ({type(dit.module).__name__}) is already streamed by another "
                    "DLO backend; call its disable() first (and load the model again)"
                )
            for module_name, module in dit.module.named_modules():
                for attribute, what in FOREIGN_HOOKS.items():
                    hooks = getattr(module, attribute, None)
                    if hooks is not None and not _only_context_parallel(hooks):
                        where = f"{dit.name}.{module_name}".rstrip(".")
                        raise OffloadSetupError(
                            f"{where} carries {what}; DLO cannot stream a DiT another offload "
                            "strategy manages: remove those hooks (or load the pipeline "
                            "without them) before enabling DLO"
                        )

    def _enable(self, model_or_pipeline: object, plan: OffloadPlan) -> None:
        """The steps of ``enable``; each acquires what ``_release`` gives back."""
        for dit in plan.dits:
            setattr(dit.module, MARK, self)
            self._marked.append(dit.module)
        resident = self._choose_resident(plan)
        self._resident_blocks = len(resident)
        streamed = [
            (dit, name, block)
            for dit in plan.dits
            for name, block in dit.blocks
            if id(block) not in resident
        ]
        resident_modules = [module for dit in plan.dits for module in dit.resident_modules]
        resident_parameter_ids = {
            id(parameter) for module in resident_modules for parameter in module.parameters()
        }
        named_streamed = [(f"{dit.name}.{name}", block) for dit, name, block in streamed]
        self._check_parameters_are_not_shared(
            model_or_pipeline, named_streamed, resident_parameter_ids
        )
        streamed_ids = {id(block) for _, block in named_streamed}
        self._materialize_unstreamed_from_plan(plan, streamed, resident_parameter_ids)
        self._move_everything_else_to_device(model_or_pipeline, streamed_ids)
        for module in resident_modules:
            module.to(self.device)

        self._blocks = [
            self._describe(dit, name, block, resident_parameter_ids)
            for dit, name, block in streamed
        ]
        self._check_streams_something(plan)
        by_module = {id(block.module): block for block in self._blocks}
        shard_buffers = self.config.allgather_shard_buffers if self._shards > 1 else 0
        self._schedule = Schedule.in_attribute_order(
            {
                id(dit.module): [by_module[id(m)] for _, m in dit.blocks if id(m) in by_module]
                for dit in plan.dits
            },
            # The two slots hold the next two blocks; the shard buffers or the staging
            # buffers the ones after.
            lookahead=max(shard_buffers + 1, self.config.staging_buffers),
        )
        self._packer = Packer(self.config.pack_threads)
        self._fill_host()
        _release_freed_host_memory()

        layouts = [block.layout for block in self._blocks]
        capacity = slot_capacity(layouts, self._shards)
        mapped = [block for block in self._blocks if block.mapped]
        if mapped:
            self._registered = self._register(mapped)
        self._slots = SlotPair(
            self.device,
            capacity,
            process_group=self.config.process_group if self._shards > 1 else None,
            shards=self._shards,
            counters=self._counters,
            shard_buffers=shard_buffers,
        )
        if mapped and self._registered is None:
            self._staging = self._stage(mapped)
        mapped_source = DIRECT if self._registered is not None else self._staging
        for block in self._blocks:
            block.source = mapped_source if block.mapped else ARENA
        placeholders = {
            dtype: torch.empty(0, dtype=dtype, device=self.device)
            for dtype in {dtype for layout in layouts for dtype in layout.by_dtype}
        }
        for block in self._blocks:
            for index, slot in enumerate(self._slots.slots):
                block.bind_slot_views(index, slot.buffers)
            block.to_placeholders(placeholders)
        self._hooks = BlockHooks(self._slots, self._schedule, placeholders)
        self._hooks.install(self._blocks, {id(dit.module): dit.module for dit in plan.dits})
        first = self._schedule.first()
        if first.successor is not None:
            self._slots.load(first.successor, 0, upcoming=first.following)
            self._slots.last_used = 1
        self._plan = plan

    def _stage(self, mapped: list[StreamedBlock]) -> HostStaging | StagingRing:
        """The bounded staging of unregistered mapped blocks: the native chunk ring when
        ``config.staging_ring`` asks for it, else the ring of block-sized buffers."""
        on_cuda = self.device.type == "cuda"
        if self.config.staging_ring:
            self._staging_kind = "ring"
            return StagingRing(
                self.device,
                self._slots.copy_stream if on_cuda else None,
                self._counters,
                lanes=self.config.pack_threads,
                chunk_bytes=self.config.staging_ring_chunk_bytes,
            )
        self._staging_kind = "buffers"
        return HostStaging(
            slot_capacity([block.layout for block in mapped], 1),
            self._packer,
            self._counters,
            page_lock=on_cuda,
            depth=self.config.staging_buffers,
        )

    def _register(self, blocks: list[StreamedBlock]) -> RegisteredRanges | None:
        """Register the mapped views of ``blocks`` for direct copies, or None (staging),
        recording the outcome for ``stats`` and logging why registration was refused."""
        budget = self.config.host_registration_budget_bytes
        if budget <= 0:
            self._registration = "off"
            return None
        if self.device.type != "cuda":
            refused = RegistrationRefusedError("cpu", "host registration needs a CUDA device")
        elif not self.host_weight_plan.registrable:
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
                    [pieces[index].source for pieces, index in places],
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
                    pieces[index] = pieces[index]._replace(source=view.reshape(-1))
                for block in blocks:
                    block.mapped = {
                        dtype: coalesce(pieces) for dtype, pieces in block.mapped.items()
                    }
                self._registration = "registered"
                return registered
        self._registration = refused.reason
        logger.warning(
            "host registration refused, staging instead",
            extra={"fields": {"reason": refused.reason, "why": str(refused)}},
        )
        return None

    def _choose_resident(self, plan: OffloadPlan) -> set[int]:
        """Ids of the blocks that stay on the device: ``resident_layers`` per DiT, or as many
        as the GPU memory budget holds after non-block weights and the two slots."""
        budget = self.config.gpu_memory_budget_bytes
        if budget is None:
            return {
                id(dit.blocks[index][1])
                for dit in plan.dits
                for index in spread_evenly(len(dit.blocks), self.config.resident_layers)
            }
        blocks = [block for dit in plan.dits for _, block in dit.blocks]
        block_bytes = [_parameter_bytes(block.parameters()) for block in blocks]
        block_ids = {id(p) for block in blocks for p in block.parameters()}
        non_block = sum(
            _parameter_bytes(p for p in dit.module.parameters() if id(p) not in block_ids)
            + _parameter_bytes(dit.module.buffers())
            for dit in plan.dits
        )
        slots = 2 * max(block_bytes, default=0)
        available = budget - non_block - slots
        if available < 0:
            raise OffloadSetupError(
                f"--dlo-gpu-memory-budget-gib {budget / 2**30:.2f} cannot hold the DiT's "
                f"non-block weights ({non_block / 2**30:.2f} GiB) and the two slots "
                f"({slots / 2**30:.2f} GiB); raise it to at least "
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

    def _check_streams_something(self, plan: OffloadPlan) -> None:
        """Blocks that hold no weights would make DLO a silent no-op."""
        if self._resident_blocks or any(block.layout.nbytes for block in self._blocks):
            return
        names = ", ".join(f"{dit.name} ({type(dit.module).__name__})" for dit in plan.dits)
        paths = sorted({path for dit in plan.dits for path in dit.block_paths})
        raise OffloadSetupError(
            f"DLO would stream no weights for {names}: the blocks at {paths} hold no "
            "parameters (or were already released by an earlier disable()); name the DiT's "
            "block lists with block_paths (--dlo-block-paths), or load the model again"
        )

    @staticmethod
    def _check_parameters_are_not_shared(
        model_or_pipeline: object,
        streamed: list[tuple[str, nn.Module]],
        resident_parameter_ids: set[int],
    ) -> None:
        owners: dict[int, str] = {}
        for name, block in streamed:
            for parameter in block.parameters():
                if id(parameter) in resident_parameter_ids:
                    continue
                if id(parameter) in owners and owners[id(parameter)] != name:
                    raise OffloadSetupError(
                        f"a parameter is shared by {owners[id(parameter)]} and {name}; "
                        "tied weights cannot be streamed"
                    )
                owners[id(parameter)] = name
        streamed_ids = {id(block) for _, block in streamed}
        for module in _modules_of(model_or_pipeline):
            for submodule in _walk_except(module, streamed_ids):
                for parameter in submodule.parameters(recurse=False):
                    if id(parameter) in owners:
                        raise OffloadSetupError(
                            f"a parameter of {owners[id(parameter)]} is also used outside the "
                            "streamed blocks; tied weights cannot be streamed"
                        )

    def _move_everything_else_to_device(
        self, model_or_pipeline: object, streamed_ids: set[int]
    ) -> None:
        """Non-block weights, buffers, resident blocks, encoders and the VAE go to the device."""
        for module in _modules_of(model_or_pipeline):
            _move_module_except(module, streamed_ids, self.device)

    def _describe(
        self, dit: DiTPlan, name: str, block: nn.Module, resident_parameter_ids: set[int]
    ) -> StreamedBlock:
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
        if self._plan_backs(dit):
            streamed.mapped = self._mapped_pieces(dit, name, entries)
        return streamed

    def _plan_backs(self, dit: DiTPlan) -> bool:
        plan = self.host_weight_plan
        return plan is not None and dit.name in plan.components

    @property
    def _host_backing(self) -> str:
        plan = self.host_weight_plan
        return str(plan.backing) if plan is not None else "ordinary"

    def _mapped_pieces(
        self, dit: DiTPlan, block_name: str, entries: list[StreamedParameter]
    ) -> dict[torch.dtype, list[MappedPiece]]:
        """Flat views of the mapped checkpoint for every parameter, in layout order."""
        pieces: dict[torch.dtype, list[MappedPiece]] = {}
        for entry in entries:
            view = self.host_weight_plan.tensor(dit.name, f"{block_name}.{entry.name}")
            if not view.is_contiguous() or view.dtype != entry.dtype:
                raise HostWeightPlanError(
                    f"{dit.name}.{block_name}.{entry.name}: the plan's view is not a contiguous "
                    f"{entry.dtype} tensor; the loader's preflight and the model disagree"
                )
            pieces.setdefault(entry.dtype, []).append(
                MappedPiece(entry.offset, entry.numel, view.reshape(-1))
            )
        return {
            dtype: coalesce(sorted(dtype_pieces, key=lambda piece: piece.offset))
            for dtype, dtype_pieces in pieces.items()
        }

    def _check_plan_covers(self, plan: OffloadPlan) -> None:
        host_plan = self.host_weight_plan
        if host_plan is None:
            return
        unknown = sorted(set(host_plan.components) - {dit.name for dit in plan.dits})
        if unknown:
            raise HostWeightPlanError(
                f"the host-weight plan binds {', '.join(unknown)} but the pipeline has no such "
                "DiT; hand the plan to the backend of the pipeline it was loaded with"
            )

    def _materialize_unstreamed_from_plan(
        self,
        plan: OffloadPlan,
        streamed: list[tuple[DiTPlan, str, nn.Module]],
        resident_parameter_ids: set[int],
    ) -> None:
        """Copy every plan-bound DiT tensor that does not stream onto the device.

        Embedders, norms, resident layers and persistent buffers are small; they are
        copied out of the mapping once. Streamed parameters stay bound to the plan.
        """
        host_plan = self.host_weight_plan
        if host_plan is None:
            return
        streamed_names: dict[str, set[str]] = {}
        for dit, name, block in streamed:
            streamed_names.setdefault(dit.name, set()).update(
                f"{name}.{param_name}"
                for param_name, parameter in block.named_parameters()
                if id(parameter) not in resident_parameter_ids
            )
        for dit in plan.dits:
            if not self._plan_backs(dit):
                continue
            skipped = streamed_names.get(dit.name, set())
            for tensor_name in dit.module.state_dict(keep_vars=True):
                if tensor_name in skipped:
                    continue
                value = host_plan.tensor(dit.name, tensor_name).to(self.device, copy=True)
                _assign_tensor(dit.module, tensor_name, value)

    def _fill_host(self) -> None:
        """Give every block its host side (see the module docstring), then drop the loader's
        copy of its parameters."""
        staged = [block for block in self._blocks if block.mapped and self._shards == 1]
        in_arena = [block for block in self._blocks if block not in staged]
        numel_by_dtype: dict[torch.dtype, int] = {}
        for block in in_arena:
            for dtype, layout in block.layout.by_dtype.items():
                numel_by_dtype[dtype] = numel_by_dtype.get(dtype, 0) + layout.shard_numel(
                    self._shards
                )
        self._arena = HostArena(numel_by_dtype, page_lock=self.device.type == "cuda")
        # Packing tens of GiB (read from disk on a cold page cache) takes a while: show it.
        progress = tqdm(in_arena, desc="DLO host weights", unit="block", disable=len(in_arena) < 2)
        for block in progress:
            for dtype, layout in block.layout.by_dtype.items():
                target = self._arena.take(dtype, layout.shard_numel(self._shards))
                block.host_source[dtype] = target
                start, stop = shard_bounds(layout.numel, self._shards, self._rank)
                if block.mapped:
                    # Straight from the mapped checkpoint: only this rank's range is read.
                    wait_all(self._packer.pack(block.mapped[dtype], start, stop, target))
                elif self._shards == 1:
                    _pack(block, dtype, target)
                else:
                    # Pack where the loader left the weights (the GPU packs far faster),
                    # then keep only this rank's shard on the host.
                    source_device = next(
                        entry.parameter.device for entry in block.parameters if entry.dtype == dtype
                    )
                    flat = torch.empty(
                        layout.padded_numel(self._shards), dtype=dtype, device=source_device
                    )
                    _pack(block, dtype, flat)
                    target.copy_(flat[start:stop])
            block.mapped = {}
        for block in self._blocks:
            for parameter, *_ in block.parameters:
                _set_parameter_data(parameter, torch.empty(0, dtype=parameter.dtype))
        if self.host_weight_plan is not None and not staged:
            # Every shard is prepared: the source mapping is no longer needed.
            self.host_weight_plan.close()

    def disable(self) -> None:
        """Synchronize, remove hooks, free slots and host memory. Idempotent.

        Streamed blocks keep empty placeholder parameters afterwards: the model
        must be loaded again to run. Call this before destroying process groups.
        """
        if self.state != BackendState.ENABLED:
            return
        self._release()
        self.state = BackendState.DISABLED
        logger.info("dlo disabled")

    def _release(self) -> None:
        """Give back whatever is held, in reverse order of acquisition (each part optional,
        so a half-finished enable is undone by the same code)."""
        if self._slots is not None:
            self._slots.synchronize()
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._staging is not None:
            # Before the slots go: a chunk ring still enqueues the fills it was handed.
            self._staging.close()
            self._staging = None
        if self._slots is not None:
            self._slots.free()
            self._slots = None
        if self._registered is not None:
            # Unregistered before the mappings close (below), after the copies finished.
            self._registered.release()
            self._registered = None
        if self._packer is not None:
            self._packer.close()
            self._packer = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self.host_weight_plan is not None:
            self.host_weight_plan.close()
        for block in self._blocks:
            block.host_source.clear()
            block.mapped.clear()
            block.source = None
            block.slot_views[0].clear()
            block.slot_views[1].clear()
        for module in self._marked:
            if getattr(module, MARK, None) is self:
                delattr(module, MARK)
        self._marked.clear()
        self._blocks = []
        self._schedule = None
        self._plan = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        _release_freed_host_memory()

    def stats(self) -> OffloadStats:
        """Counters so far; synchronizes the device to read pending timings (not a hot path)."""
        if self._slots is not None:
            self._slots.synchronize()
        counters = self._counters
        waits = max(counters.waits, 1)
        return OffloadStats(
            transfer_mode="allgather" if self._shards > 1 else "rank-local",
            host_backing=self._host_backing,
            shards=self._shards,
            streamed_blocks=len(self._blocks),
            resident_blocks=self._resident_blocks,
            blocks_loaded=counters.blocks_loaded,
            on_demand_loads=counters.on_demand_loads,
            order_changes=self._schedule.relearned if self._schedule else 0,
            bytes_streamed=counters.h2d_bytes,
            allgather_bytes=counters.allgather_bytes,
            exposed_wait_seconds=counters.exposed_wait_seconds,
            exposed_wait_seconds_per_block=counters.exposed_wait_seconds / waits,
            h2d_seconds=counters.h2d_seconds,
            h2d_gbps=counters.h2d_bytes / counters.h2d_seconds / 1e9
            if counters.h2d_seconds
            else 0.0,
            host_bytes=self._arena.nbytes if self._arena else 0,
            staging_bytes=self._staging.nbytes if self._staging else 0,
            host_registration=self._registration,
            staging=self._staging_kind,
            registered_bytes=self._registered.nbytes if self._registered else 0,
            pack_gbps=self._pack_gbps(),
            pack_wait_seconds=counters.pack_wait_seconds,
            host_page_locked=bool(self._arena and self._arena.page_locked),
            device_slot_bytes=self._slots.device_bytes if self._slots else 0,
            largest_block_bytes=max((b.layout.nbytes for b in self._blocks), default=0),
        )

    def _pack_gbps(self) -> float:
        """Bytes packed per second of packing: wall time of the buffers' packs, or the
        ring's packers' busy time divided among them."""
        if isinstance(self._staging, StagingRing):
            ring = self._staging.counters()
            busy = ring.pack_seconds / self._staging.lanes
            return ring.packed_bytes / busy / 1e9 if busy else 0.0
        counters = self._counters
        return counters.pack_bytes / counters.pack_seconds / 1e9 if counters.pack_seconds else 0.0

    def block_layouts(self) -> list[BlockLayout]:
        return [block.layout for block in self._blocks]


def _parameter_bytes(tensors: object) -> int:
    """Bytes of distinct tensors (meta tensors count by shape: nothing is allocated)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None:
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _set_parameter_data(parameter: nn.Parameter, value: torch.Tensor) -> None:
    """``parameter.data = value``, also for the meta parameters of a plan-backed DiT (whose
    tensor type cannot change in place); the Parameter object stays the same either way."""
    if parameter.is_meta:
        torch.utils.swap_tensors(parameter, nn.Parameter(value, parameter.requires_grad))
    else:
        parameter.data = value


def _assign_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Point parameter or buffer ``name`` of ``module`` at ``value`` (same Parameter object)."""
    owner_path, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_path)
    if attribute in owner._parameters:
        _set_parameter_data(owner._parameters[attribute], value)
    elif attribute in owner._buffers:
        owner._buffers[attribute] = value
    else:
        raise HostWeightPlanError(f"{name} is neither a parameter nor a buffer of the model")


def _modules_of(model_or_pipeline: object) -> list[nn.Module]:
    if isinstance(model_or_pipeline, nn.Module):
        return [model_or_pipeline]
    components = getattr(model_or_pipeline, "components", {})
    return [module for module in components.values() if isinstance(module, nn.Module)]


def _move_module_except(module: nn.Module, skipped_ids: set[int], device: torch.device) -> None:
    """Move every parameter and buffer of ``module`` to ``device``, except inside skipped blocks."""
    for submodule in _walk_except(module, skipped_ids):
        for parameter in submodule.parameters(recurse=False):
            if parameter.device != device:
                parameter.data = parameter.data.to(device)
        for name, buffer in list(submodule.named_buffers(recurse=False)):
            if buffer is not None and buffer.device != device:
                submodule._buffers[name] = buffer.to(device)
    for skipped in _skipped_blocks(module, skipped_ids):
        for submodule in skipped.modules():
            for name, buffer in list(submodule.named_buffers(recurse=False)):
                if buffer is not None and buffer.device != device:
                    submodule._buffers[name] = buffer.to(device)


def _walk_except(module: nn.Module, skipped_ids: set[int]):
    if id(module) in skipped_ids:
        return
    yield module
    for child in module.children():
        yield from _walk_except(child, skipped_ids)


def _skipped_blocks(module: nn.Module, skipped_ids: set[int]) -> list[nn.Module]:
    return [sub for sub in module.modules() if id(sub) in skipped_ids]


def _pack(block: StreamedBlock, dtype: torch.dtype, target: torch.Tensor) -> None:
    """Write the block's ``dtype`` tensors at their layout offsets; zero the gaps."""
    end = 0
    for parameter, parameter_dtype, offset, numel, *_ in block.parameters:
        if parameter_dtype != dtype:
            continue
        target[end:offset].zero_()
        target[offset : offset + numel].copy_(parameter.detach().reshape(-1))
        end = offset + numel
    target[end:].zero_()
