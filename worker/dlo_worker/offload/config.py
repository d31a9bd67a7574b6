"""OffloadConfig: how the backend streams, with live process groups.

It knows nothing of pipelines or of the worker's configuration (as diffusers'
``GroupOffloadingConfig``); the worker builds one from its configuration and topology
(:func:`dlo_worker.process.worker.offload_config`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch.distributed as dist

MAX_PACK_THREADS = 8
"""Packers per process at most. Eight pack 54-61 GB/s, just above the copy engine's 52 GB/s:
on a quiet host they stepped as fast as twelve on leases 4, 5 and 7 and were a few percent
slower on lease 21 (docs/benchmarks.md). Beside other work they are far more robust: with
four threads of another process copying host memory, twelve packers went to 1.20-1.24x
private pinned and eight stayed within 1.04-1.08x, on a 300 MiB and on a 105 MiB
last-level cache (leases 19 and 20); with four busy CPU-only processes, 1.11-1.15x against
1.05-1.07x on the first. Twelve packers burst at 75-92 GB/s, taking memory bandwidth from
the copy engine's reads, and with the other work they oversubscribe the CPUs, so a woken
packer waits for a CPU while the copies already queued run out."""
BUSY_THREADS_PER_RANK = 2
"""Threads of a rank that run beside its packers all the time: the one that launches the
model's kernels and the staging ring's feeder. The packers leave them a CPU each."""
RING_CACHE_SHARE = 3
"""The staging ring takes at most 1/RING_CACHE_SHARE of the CPU's last-level cache: the
packers' reads of the mapping and the other threads' data share it with the ring (a
96 MiB ring ran as fast as a 64 MiB one on a 300 MiB L3; a 256 MiB one was slower)."""
RING_CHUNK_BOUNDS = (4 * 2**20, 8 * 2**20)
"""Smaller chunks are copied out of the ring far slower than their size alone explains: on
an H100 host with 2 MiB of L2 per core, 12 packers' 2 MiB chunks went to the GPU at
24-48 GB/s and 1 MiB chunks at 18-21 GB/s (1.8-2.0x private pinned), where chunks of the
same sizes from idle pinned memory copy at 48-52 GB/s and 4 MiB ring chunks at 49-52 GB/s.
The copy engine is slowed most by lines the CPU has just written (the ``--beside`` probe of
``bench/staging_ring_probe.py``), and a chunk that fits its packer's L2 is likely still
dirty there when its copy starts. So the floor holds even where the ring then takes more
than its share of a small last-level cache. Above 8 MiB the ring no longer fits the cache
of the machines measured (docs/benchmarks.md)."""

StagingChoice = Literal["auto", "ring", "buffers"]


def default_pack_threads() -> int:
    """This process's share of its :func:`usable_cpus` (ranks of a node split them), less
    its :data:`BUSY_THREADS_PER_RANK`, up to :data:`MAX_PACK_THREADS`.

    Packing is memory-bound: past a margin over the copy engine's rate, more threads only
    compete with the other ranks and with the device copies for memory bandwidth, and a
    packer that has to wait for a CPU holds back the copies behind its chunk.
    """
    return pack_threads_for(usable_cpus(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def usable_cpus(
    cgroup_root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int:
    """The CPUs this process may keep busy: those it may run on, at most its cgroup's CPU
    limit rounded up.

    A container's ``--cpus`` or a Pod's CPU limit (one a LimitRange adds, too) leaves every
    CPU in the affinity mask but throttles the process past the limit: packers sized by the
    mask alone would oversubscribe it, the condition that took the ring from 1.05x to
    1.11-1.24x private pinned (docs/benchmarks.md, leases 19 and 20).
    """
    cpus = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(cgroup_root, membership)
    return cpus if limit is None else max(1, min(cpus, math.ceil(limit)))


def cgroup_cpu_limit(cgroup_root: Path, membership: Path) -> float | None:
    """The tightest CPU limit, in CPUs, on this process's cgroup and its ancestors
    (cgroup v2 ``cpu.max``; cgroup v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` of
    the hierarchy a container sees), or ``None`` where none is set or readable."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # the v2 hierarchy: every level may set cpu.max
            level = cgroup_root / path.lstrip("/")
            for directory in (level, *level.parents):
                limits += _cpu_max(directory / "cpu.max")
                if directory == cgroup_root:
                    break
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct"):
                limits += _cfs_quota(cgroup_root / mount)
    return min(limits) if limits else None


def _cpu_max(path: Path) -> list[float]:
    """``<quota> <period>`` in microseconds, or ``max <period>`` for no limit."""
    try:
        quota, period = path.read_text().split()
    except (OSError, ValueError):
        return []
    return [] if quota == "max" or int(period) <= 0 else [int(quota) / int(period)]


def _cfs_quota(directory: Path) -> list[float]:
    """A cgroup v1 CPU hierarchy's quota (-1 for none) over its period."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def pack_threads_for(cpus: int, ranks_here: int) -> int:
    """:func:`default_pack_threads` for ``cpus`` CPUs shared by ``ranks_here`` ranks (pure)."""
    share = cpus // max(ranks_here, 1)
    return max(1, min(MAX_PACK_THREADS, share - BUSY_THREADS_PER_RANK))


def ring_chunk_bytes(
    last_level_cache_bytes: int | None, pack_threads: int, chunks_per_thread: int
) -> int:
    """The staging ring's chunk size for a machine: the largest power of two whose ring
    (``chunks_per_thread`` per pack thread) takes at most a third of the last-level cache, within
    :data:`RING_CHUNK_BOUNDS`; the smallest bound when the cache size is unknown."""
    low, high = RING_CHUNK_BOUNDS
    if not last_level_cache_bytes:
        return low
    share = last_level_cache_bytes // (RING_CACHE_SHARE * chunks_per_thread * pack_threads)
    chunk = low
    while chunk * 2 <= min(share, high):
        chunk *= 2
    return chunk


def last_level_cache_bytes() -> int | None:
    """Size of the last-level cache of the first CPU this process may run on (sysfs), or
    ``None`` where the kernel does not say."""
    cpu = min(os.sched_getaffinity(0))
    caches = Path(f"/sys/devices/system/cpu/cpu{cpu}/cache")
    best: tuple[int, int] | None = None
    for index in caches.glob("index*"):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if kind == "Instruction" or not size[:-1].isdigit() or size[-1] not in units:
            continue
        found = (level, int(size[:-1]) * units[size[-1]])
        best = max(best, found) if best is not None else found
    return best[1] if best is not None else None


@dataclass(frozen=True)
class OffloadConfig:
    """How the backend streams: transfer protocol, group, resident layers, block lists."""

    use_allgather: bool = True
    process_group: dist.ProcessGroup | None = None
    """The DLO weight-sharding group; ``None`` (or size one) streams rank-locally."""
    resident_layers: int = 0
    gpu_memory_budget_bytes: int | None = None
    """Device bytes for the DiT weights (non-block weights, LoRA adapters, slots, resident
    blocks); the backend keeps as many blocks resident as fit. Excludes
    ``resident_layers``."""
    adapter_bytes: int = 0
    """Device bytes of LoRA adapters that will be loaded after enable (the worker's
    ``--lora``), counted in the budget like the adapters the blocks already hold."""
    block_paths: Sequence[str] | None = None
    """Attribute paths of the DiT's block lists, overriding discovery."""
    text_encoders: Sequence[str] = ()
    """Text encoder components streamed too (``text_encoder_2``: T5-XXL), through the
    same two slots, their blocks from ``TEXT_ENCODER_BLOCK_LISTS``."""
    allgather_shard_buffers: int = 4
    """Device buffers for this rank's shards (AllGather; each the largest block / group
    size): shards are copied up to this many blocks before their gather, so blocks whose
    copies outlast their compute borrow time from blocks whose compute outlasts theirs."""
    staging_buffers: int = 3
    """Page-locked staging buffers for checkpoint-backed blocks that are not registered
    (each the largest such block): packs run up to this many blocks ahead of the copies,
    so a pack that runs slow for one block does not leave the copy engine idle."""
    staging: StagingChoice = "auto"
    """How unregistered mapped blocks are packed: ``ring``, the native cache-sized chunk
    ring (:mod:`dlo_worker.offload.feeds.ring`; an error where it was not built),
    ``buffers``, block-sized staging buffers, or ``auto``: the ring where it was built,
    else buffers with one warning saying why."""
    pack_threads: int = field(default_factory=default_pack_threads)
    """Host threads that pack checkpoint-backed blocks into staging (and AllGather shards)."""
    staging_ring_chunks_per_thread: int = 2
    """Chunks of the staging ring per pack thread: packers run this many chunks per
    thread ahead of the copy engine, so one slow chunk (the feeder copies in order) does
    not stall the others at once."""
    staging_ring_chunk_bytes: int | None = None
    """Bytes per chunk of the staging ring (two chunks per pack thread); ``None`` chooses
    from the machine (:func:`ring_chunk_bytes`): small enough that the ring stays in the
    CPU's last-level cache, large enough that ordering a chunk's copy costs little."""
    pin_limit_bytes: int = 0
    """Host bytes this process may pin (register with the driver) so rank-local mapped
    blocks on CUDA are copied directly from their mapping (0: always stage)."""
    host_registration_timeout_s: float = 600.0
    """Registration taking longer falls back to staging (checked between ranges)."""

    def __post_init__(self) -> None:
        if self.resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {self.resident_layers}")
        if self.allgather_shard_buffers < 2:
            raise ValueError(
                f"allgather_shard_buffers must be >= 2, got {self.allgather_shard_buffers}"
            )
        if self.adapter_bytes < 0:
            raise ValueError(f"adapter_bytes must be >= 0, got {self.adapter_bytes}")
        if self.pin_limit_bytes < 0:
            raise ValueError(f"pin_limit_bytes must be >= 0, got {self.pin_limit_bytes}")
        if self.staging_buffers < 2:
            raise ValueError(f"staging_buffers must be >= 2, got {self.staging_buffers}")
        chunk = self.staging_ring_chunk_bytes
        if chunk is not None and (chunk < 4096 or chunk % 4096):
            raise ValueError(
                f"staging_ring_chunk_bytes must be a positive multiple of 4096, got {chunk}"
            )
        if self.staging_ring_chunks_per_thread < 1:
            raise ValueError(
                "staging_ring_chunks_per_thread must be >= 1, got "
                f"{self.staging_ring_chunks_per_thread}"
            )
        if self.staging not in ("auto", "ring", "buffers"):
            raise ValueError(f"staging must be 'auto', 'ring' or 'buffers', got {self.staging!r}")
        if self.pack_threads < 1:
            raise ValueError(f"pack_threads must be >= 1, got {self.pack_threads}")
        resident = self.resident_layers or self.gpu_memory_budget_bytes is not None
        if resident and self.use_allgather and self._group_size() > 1:
            raise ValueError(
                "resident blocks (resident_layers, gpu_memory_budget_bytes) require "
                "use_allgather=False (--dlo-no-use-allgather)"
            )
        if self.resident_layers and self.gpu_memory_budget_bytes is not None:
            raise ValueError("set resident_layers or gpu_memory_budget_bytes, not both")

    @property
    def ring_chunk_bytes(self) -> int:
        """The staging ring's chunk size: the configured one, else the machine's."""
        if self.staging_ring_chunk_bytes is not None:
            return self.staging_ring_chunk_bytes
        return ring_chunk_bytes(
            last_level_cache_bytes(), self.pack_threads, self.staging_ring_chunks_per_thread
        )

    def _group_size(self) -> int:
        return dist.get_world_size(self.process_group) if self.process_group is not None else 1
