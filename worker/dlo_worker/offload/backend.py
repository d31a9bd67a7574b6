"""DistributedLayerwiseOffloadBackend: setup and teardown owner of DLO.

``enable`` discovers the DiTs and their blocks, keeps everything that is not a
streamed block on the device, fills the host side of every streamed block,
allocates the two shared device slots, installs the hooks and primes the first
block. ``disable`` synchronizes, removes the hooks and frees every buffer; it
runs before the worker destroys any process group.

The backend is a small state machine (:class:`BackendState`). Everything an enabled
backend holds (hooks, page-locked memory, packer threads, slots, staging, registered
ranges, the DiTs' mark) lives in one :class:`Enabled` object that exists only in the
``enabled`` state. ``enable`` builds it step by step, each acquisition pushing its
release on an exit stack: if a step fails, the stack gives back what the earlier steps
acquired, in reverse, and the backend lands in ``disabled`` before re-raising.
``disable`` releases it the same way and is idempotent. Each DiT it streams is marked, so
a second backend, diffusers' group offloading or accelerate's hooks on the same DiT are
refused at enable time (:mod:`~dlo_worker.offload.ownership`).

The host side follows the loader's choice (docs/host-storage.md):

- ordinary tensors: each block is packed into a page-locked arena (complete, or
  this rank's 1/N shard for AllGather) and the loader's copy is freed;
- a :class:`~dlo_worker.offload.host_weights.HostWeights` (the loader's checkpoint
  ``MappedCheckpoint``), AllGather: each rank packs its shard from
  the mapped files into the arena, then the checkpoint mappings are closed;
- mapped host weights (checkpoint mapping or runtime-cache entry), rank-local: blocks keep
  only immutable views of the mapped files. With a pin limit
  (``pin_limit_bytes``) on CUDA, the views' ranges are registered with
  the driver and each load copies them directly (:mod:`~dlo_worker.offload.feeds.direct`);
  otherwise, or if registration is refused (budget, platform, a deferred adapter, a
  failed call: all or nothing, the reason is logged and reported in ``stats``), they
  are packed through bounded pinned staging: a cache-sized ring of chunks fed by native
  threads (:mod:`~dlo_worker.offload.feeds.ring`), the default where it was built, or
  block-sized buffers (:mod:`~dlo_worker.offload.feeds.staging`).

With host weights the DiT was never materialized, so failing to consume them is a
hard error (:class:`HostWeightsError`), never a fallback.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist

from dlo_worker.offload import adapters, compiling, ownership
from dlo_worker.offload.block import StreamedBlock
from dlo_worker.offload.compiling import BlockCompilation
from dlo_worker.offload.config import OffloadConfig
from dlo_worker.offload.errors import OffloadSetupError, UnsupportedHostBackingError
from dlo_worker.offload.feeds.arena import ARENA, HostArena
from dlo_worker.offload.feeds.direct import DIRECT
from dlo_worker.offload.feeds.registration import RegisteredRanges
from dlo_worker.offload.feeds.ring import RingCounters, StagingRing
from dlo_worker.offload.feeds.staging import HostStaging, Packer
from dlo_worker.offload.hooks import BlockHooks
from dlo_worker.offload.host_weights import HostWeights, HostWeightsError
from dlo_worker.offload.layout import BlockLayout, slot_capacity
from dlo_worker.offload.params import modules_of, move_module_except, release_freed_host_memory
from dlo_worker.offload.plan import OffloadPlan, discover, dit_modules
from dlo_worker.offload.schedule import Schedule
from dlo_worker.offload.setup import StreamSetup, choose_resident
from dlo_worker.offload.slots import SlotPair, TransferCounters
from dlo_worker.offload.stats import OffloadStats

logger = logging.getLogger(__name__)


class BackendState(StrEnum):
    CREATED = "created"
    """Nothing held yet."""
    ENABLED = "enabled"
    """An :class:`Enabled` holds the hooks, host memory (page-locked on CUDA), packer
    threads and the two device slots; every streamed DiT is marked."""
    DISABLED = "disabled"
    """Everything released (after ``disable`` or a failed ``enable``); the streamed blocks
    hold empty placeholders, so the model must be loaded again before it runs."""


@dataclass(eq=False)
class Enabled:
    """What an enabled backend holds; it exists only while the backend is enabled, so
    none of it is ever missing then. :meth:`release` gives it back in reverse order of
    acquisition."""

    plan: OffloadPlan
    blocks: list[StreamedBlock]
    schedule: Schedule
    packer: Packer
    arena: HostArena
    slots: SlotPair
    hooks: BlockHooks
    compilation: BlockCompilation
    staging: HostStaging | StagingRing | None
    """Only with mapped blocks that are not registered with the driver."""
    registered: RegisteredRanges | None
    """Only when the mapped blocks' ranges were registered for direct copies."""
    releases: ExitStack

    def release(self) -> None:
        self.releases.close()


class DistributedLayerwiseOffloadBackend:
    """Streams DiT blocks through two device slots; see the module docstring."""

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        host_weights: HostWeights | None = None,
    ) -> None:
        if host_weights is not None and not isinstance(host_weights, HostWeights):
            raise UnsupportedHostBackingError(
                "host_weights must be a HostWeights (e.g. DiffusersPipelineLoader."
                f"take_host_weights()), got {type(host_weights).__name__}"
            )
        self.config = config
        self.host_weights = host_weights
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._shards, self._rank = self._sharding()
        self.state = BackendState.CREATED
        self._enabled: Enabled | None = None
        # What the last enable did; kept after disable, as the counters are.
        self._counters = TransferCounters()
        self._resident_blocks = 0
        self._staging_kind = "none"
        self._staging_reason = "none"
        self._registration = "none"

    @property
    def enabled(self) -> bool:
        return self.state == BackendState.ENABLED

    @property
    def plan(self) -> OffloadPlan | None:
        return self._enabled.plan if self._enabled is not None else None

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
        if self.host_weights is not None and self.host_weights.closed:
            raise HostWeightsError(
                "these host weights were already consumed and closed; load the model again"
            )
        started = time.perf_counter()
        # Before discovery, which a compiled DiT's wrapper would mislead.
        compiling.check_not_compiled(dit_modules(model_or_pipeline))
        plan = discover(model_or_pipeline, self.config.block_paths, self.config.text_encoders)
        setup = StreamSetup(self.config, self.device, self.host_weights, self._shards, self._rank)
        setup.check_plan_covers(plan)
        ownership.check_not_taken(plan, self)
        compiling.check_not_compiled(
            (f"{dit.name}.{name}", block) for dit in plan.dits for name, block in dit.blocks
        )
        self._counters = TransferCounters()
        self._registration = "none"
        self._staging_kind = "none"
        self._staging_reason = "none"
        try:
            enabled = self._enable(model_or_pipeline, plan, setup)
        except BaseException:
            self.state = BackendState.DISABLED
            raise
        self._enabled = enabled
        self.state = BackendState.ENABLED
        logger.info(
            "dlo enabled",
            extra={
                "fields": {
                    "streamed_blocks": len(enabled.blocks),
                    "resident_blocks": self._resident_blocks,
                    "shards": self._shards,
                    "host_backing": self._host_backing,
                    "host_gib": round(enabled.arena.nbytes / 2**30, 3),
                    "staging_gib": round(enabled.staging.nbytes / 2**30, 3)
                    if enabled.staging
                    else 0,
                    "host_registration": self._registration,
                    "staging": self._staging_kind,
                    "staging_reason": self._staging_reason,
                    **(
                        {"ring_chunk_mib": enabled.staging.chunk_bytes / 2**20}
                        if isinstance(enabled.staging, StagingRing)
                        else {}
                    ),
                    "pack_threads": enabled.packer.threads,
                    "slot_gib": round(enabled.slots.device_bytes / 2**30, 3),
                    "setup_s": round(time.perf_counter() - started, 3),
                }
            },
        )
        return self

    def _enable(self, model_or_pipeline: object, plan: OffloadPlan, setup: StreamSetup) -> Enabled:
        """The steps of ``enable``, in order; each pushes the release of what it acquired,
        so a failing step unwinds the earlier ones (the ``with`` block) and a finished
        enable hands the whole stack to :class:`Enabled`."""
        with ExitStack() as releases:
            # Pushed first, so they run last: what freed memory and closed mappings leave.
            releases.callback(self._return_freed_memory)
            if self.host_weights is not None:
                releases.callback(self.host_weights.close)
            for dit in plan.dits:
                ownership.mark(dit.module, self)
                releases.callback(ownership.unmark, dit.module, self)
            blocks = self._streamed_blocks(model_or_pipeline, plan, setup)
            releases.callback(_forget_host_sides, blocks)
            self._check_streams_something(plan, blocks)
            shard_buffers = self.config.allgather_shard_buffers if self._shards > 1 else 0
            by_module = {id(block.module): block for block in blocks}
            schedule = Schedule.in_attribute_order(
                {
                    id(dit.module): [by_module[id(m)] for _, m in dit.blocks if id(m) in by_module]
                    for dit in plan.dits
                },
                # The two slots hold the next two blocks; the shard buffers or the staging
                # buffers the ones after.
                lookahead=max(shard_buffers + 1, self.config.staging_buffers),
                keeping_resident=frozenset(
                    id(dit.module)
                    for dit in plan.dits
                    if any(id(block) not in by_module for _, block in dit.blocks)
                ),
            )
            packer = Packer(self.config.pack_threads)
            releases.callback(packer.close)
            arena = setup.arena_for(blocks)
            releases.callback(arena.close)
            setup.fill_host(blocks, arena, packer)
            release_freed_host_memory()

            mapped = [block for block in blocks if block.mapped]
            registered = None
            if mapped:
                registered, self._registration = setup.register(mapped)
            if registered is not None:
                # Released after the copies finished, before the mappings close.
                releases.callback(registered.release)
            slots = SlotPair(
                self.device,
                slot_capacity([block.layout for block in blocks], self._shards),
                process_group=self.config.process_group if self._shards > 1 else None,
                shards=self._shards,
                counters=self._counters,
                shard_buffers=shard_buffers,
            )
            releases.callback(slots.free)
            staging = None
            if mapped and registered is None:
                staging, self._staging_reason = setup.stage(mapped, slots, packer, self._counters)
                self._staging_kind = "ring" if isinstance(staging, StagingRing) else "buffers"
                # Before the slots go: a chunk ring still enqueues the fills it was handed.
                releases.callback(staging.close)
            # Everything enqueued on the device finishes before anything above is freed.
            releases.callback(slots.synchronize)
            for block in blocks:
                block.feed = (
                    (DIRECT if registered is not None else staging) if block.mapped else ARENA
                )
            hooks = self._hook_up(plan, blocks, slots, schedule, releases)
            compilation = BlockCompilation()
            releases.callback(compilation.remove)
            compilation.install(blocks, {id(dit.module): dit.module for dit in plan.dits})
            streamed_ids = {id(block.module) for block in blocks}
            streamed_dits = [
                dit.module
                for dit in plan.dits
                if any(id(module) in streamed_ids for _, module in dit.blocks)
            ]
            adapters.refuse_fusing(streamed_dits)
            releases.callback(adapters.allow_fusing, streamed_dits)
            return Enabled(
                plan=plan,
                blocks=blocks,
                schedule=schedule,
                packer=packer,
                arena=arena,
                slots=slots,
                hooks=hooks,
                compilation=compilation,
                staging=staging,
                registered=registered,
                releases=releases.pop_all(),
            )

    def _streamed_blocks(
        self, model_or_pipeline: object, plan: OffloadPlan, setup: StreamSetup
    ) -> list[StreamedBlock]:
        """Choose the resident blocks, check the streamed ones can be taken, move everything
        else to the device and describe each streamed block."""
        resident = choose_resident(plan, self.config)
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
        ownership.check_parameters_are_not_shared(
            model_or_pipeline, named_streamed, resident_parameter_ids
        )
        streamed_ids = {id(block) for _, block in named_streamed}
        setup.materialize_unstreamed(plan, streamed, resident_parameter_ids)
        for module in modules_of(model_or_pipeline):
            # Non-block weights, buffers, resident blocks, encoders and the VAE.
            move_module_except(module, streamed_ids, self.device)
        for module in resident_modules:
            module.to(self.device)
        # LoRA adapters loaded before enable live on the device, outside every layout.
        kept_ids = set(resident_parameter_ids)
        for _dit, _name, block in streamed:
            for parameter in adapters.adapter_parameters(block):
                if parameter.device != self.device:
                    parameter.data = parameter.data.to(self.device)
                kept_ids.add(id(parameter))
        return [setup.describe(dit, name, block, kept_ids) for dit, name, block in streamed]

    def _hook_up(
        self,
        plan: OffloadPlan,
        blocks: list[StreamedBlock],
        slots: SlotPair,
        schedule: Schedule,
        releases: ExitStack,
    ) -> BlockHooks:
        """Point every block at the slots and placeholders, install the hooks and start
        loading the first block."""
        anchors = {
            dtype: torch.zeros(1, dtype=dtype, device=self.device)
            for dtype in {dtype for block in blocks for dtype in block.layout.by_dtype}
        }
        for block in blocks:
            for index, slot in enumerate(slots.slots):
                block.bind_slot_views(index, slot.buffers)
            block.bind_placeholders(anchors)
            block.to_placeholders()
        hooks = BlockHooks(slots, schedule)
        releases.callback(hooks.remove)
        hooks.install(blocks, {id(dit.module): dit.module for dit in plan.dits})
        first = schedule.first()
        if first.successor is not None:
            slots.load(first.successor, 0, upcoming=first.following)
            slots.last_used = 1
        return hooks

    def _return_freed_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        release_freed_host_memory()

    def _check_streams_something(self, plan: OffloadPlan, blocks: list[StreamedBlock]) -> None:
        """Blocks that hold no weights would make DLO a silent no-op."""
        if self._resident_blocks or any(block.layout.nbytes for block in blocks):
            return
        names = ", ".join(f"{dit.name} ({type(dit.module).__name__})" for dit in plan.dits)
        paths = sorted({path for dit in plan.dits for path in dit.block_paths})
        raise OffloadSetupError(
            f"DLO would stream no weights for {names}: the blocks at {paths} hold no "
            "parameters (or were already released by an earlier disable()); name the DiT's "
            "block lists with block_paths (--dlo-block-paths), or load the model again"
        )

    @property
    def _host_backing(self) -> str:
        host_weights = self.host_weights
        return str(host_weights.backing) if host_weights is not None else "ordinary"

    def disable(self) -> None:
        """Synchronize, remove hooks, free slots and host memory. Idempotent.

        Streamed blocks keep empty placeholder parameters afterwards: the model
        must be loaded again to run. Call this before destroying process groups.
        """
        enabled = self._enabled
        if enabled is None:
            return
        self._enabled = None
        self.state = BackendState.DISABLED
        enabled.release()
        logger.info("dlo disabled")

    def stats(self) -> OffloadStats:
        """Counters so far; synchronizes the device to read pending timings (not a hot path)."""
        enabled = self._enabled
        if enabled is not None:
            enabled.slots.synchronize()
        counters = self._counters
        waits = max(counters.waits, 1)
        blocks = enabled.blocks if enabled is not None else []
        staging = enabled.staging if enabled is not None else None
        registered = enabled.registered if enabled is not None else None
        ring = self.ring_counters()
        return OffloadStats(
            transfer_mode="allgather" if self._shards > 1 else "rank-local",
            host_backing=self._host_backing,
            shards=self._shards,
            streamed_blocks=len(blocks),
            resident_blocks=self._resident_blocks,
            blocks_loaded=counters.blocks_loaded,
            on_demand_loads=counters.on_demand_loads,
            order_changes=enabled.schedule.relearned if enabled is not None else 0,
            bytes_streamed=counters.h2d_bytes,
            allgather_bytes=counters.allgather_bytes,
            exposed_wait_seconds=counters.exposed_wait_seconds,
            exposed_wait_seconds_per_block=counters.exposed_wait_seconds / waits,
            h2d_seconds=counters.h2d_seconds,
            h2d_gbps=counters.h2d_bytes / counters.h2d_seconds / 1e9
            if counters.h2d_seconds
            else 0.0,
            host_bytes=enabled.arena.nbytes if enabled is not None else 0,
            staging_bytes=staging.nbytes if staging is not None else 0,
            host_registration=self._registration,
            staging=self._staging_kind,
            staging_reason=self._staging_reason,
            ring_chunk_bytes=staging.chunk_bytes if isinstance(staging, StagingRing) else 0,
            ring_idle_seconds=ring.idle_seconds if ring is not None else 0.0,
            ring_full_wait_seconds=ring.ring_full_wait_seconds if ring is not None else 0.0,
            ring_copy_wait_seconds=ring.copy_wait_seconds if ring is not None else 0.0,
            ring_feeder_wait_seconds=ring.feeder_wait_seconds if ring is not None else 0.0,
            ring_feeder_enqueue_seconds=ring.feeder_enqueue_seconds if ring is not None else 0.0,
            ring_chunks=ring.chunks if ring is not None else 0,
            ring_runqueue_wait_seconds=ring.runqueue_wait_seconds if ring is not None else None,
            registered_bytes=registered.nbytes if registered is not None else 0,
            pack_gbps=self._pack_gbps(staging),
            pack_wait_seconds=counters.pack_wait_seconds,
            host_page_locked=enabled is not None and enabled.arena.page_locked,
            device_slot_bytes=enabled.slots.device_bytes if enabled is not None else 0,
            largest_block_bytes=max((b.layout.nbytes for b in blocks), default=0),
            compiled_blocks=enabled.compilation.compiled_blocks if enabled is not None else 0,
            recompiles=enabled.compilation.recompiles if enabled is not None else 0,
        )

    @property
    def pack_wait_seconds(self) -> float:
        """Host time the model's thread waited for staging so far (no device sync)."""
        return self._counters.pack_wait_seconds

    def ring_counters(self) -> RingCounters | None:
        """The staging ring's counters so far, read without synchronizing the device (a
        metrics scrape may call it mid-request); ``None`` without a ring."""
        staging = self._enabled.staging if self._enabled is not None else None
        return staging.counters() if isinstance(staging, StagingRing) else None

    def _pack_gbps(self, staging: HostStaging | StagingRing | None) -> float:
        """Bytes packed per second of packing: wall time of the buffers' packs, or the
        ring's packers' busy time divided among them."""
        if isinstance(staging, StagingRing):
            ring = staging.counters()
            busy = ring.pack_seconds / staging.lanes
            return ring.packed_bytes / busy / 1e9 if busy else 0.0
        counters = self._counters
        return counters.pack_bytes / counters.pack_seconds / 1e9 if counters.pack_seconds else 0.0

    def block_layouts(self) -> list[BlockLayout]:
        blocks = self._enabled.blocks if self._enabled is not None else []
        return [block.layout for block in blocks]


def _forget_host_sides(blocks: list[StreamedBlock]) -> None:
    """Drop every block's host views, feed and slot views (the memory they point at is
    released by the steps that own it)."""
    for block in blocks:
        block.to_empty()
        block.arena_views.clear()
        block.mapped.clear()
        block.feed = None
        block.slot_views[0].clear()
        block.slot_views[1].clear()
