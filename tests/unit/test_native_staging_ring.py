"""The native staging ring (``_staging_ring.c`` through ``feeds.ring.StagingRing``) run
on the CPU, where the same packers and feeder copy chunks with memcpy: every fill holds
the block's exact packed bytes (gaps zeroed) whatever the chunk size, pieces split across
chunks and chunks spanning pieces, over more fills than the ring has chunks or its job
queue has entries; close lands fills nobody waited for."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from dlo_worker.offload import OffloadConfig
from dlo_worker.offload.block import MappedPiece, StreamedBlock
from dlo_worker.offload.config import (
    RING_CACHE_SHARE,
    RING_CHUNK_BOUNDS,
    cgroup_cpu_limit,
    last_level_cache_bytes,
    pack_threads_for,
    ring_chunk_bytes,
    usable_cpus,
)
from dlo_worker.offload.feeds import ring as ring_feed
from dlo_worker.offload.feeds.ring import StagingRing, StagingRingUnavailableError
from dlo_worker.offload.layout import layout_of, slot_capacity
from dlo_worker.offload.slots import TransferCounters

CPU = torch.device("cpu")


def make_block(index: int) -> StreamedBlock:
    """Two dtypes; float32 pieces of odd sizes (a 4 KiB chunk splits the large ones and
    spans several small ones), with the layout's alignment gaps between them."""
    generator = torch.Generator().manual_seed(index)
    named = [
        ("proj.weight", torch.randn(37, 29 + index, generator=generator)),
        ("proj.bias", torch.randn(3, generator=generator)),
        ("norm.weight", torch.randn(1500, generator=generator)),
        ("out.weight", torch.randn(5, 7, generator=generator).to(torch.bfloat16)),
    ]
    layout = layout_of(named)
    mapped: dict[torch.dtype, list[MappedPiece]] = {}
    for dtype, dtype_layout in layout.by_dtype.items():
        tensors = [tensor for _, tensor in named if tensor.dtype == dtype]
        mapped[dtype] = [
            MappedPiece(span.offset, span.numel, tensor.reshape(-1))
            for span, tensor in zip(dtype_layout.spans, tensors, strict=True)
        ]
    return StreamedBlock(
        name=f"blocks.{index}", module=nn.Identity(), layout=layout, parameters=[], mapped=mapped
    )


def packed(block: StreamedBlock, dtype: torch.dtype) -> torch.Tensor:
    expected = torch.zeros(block.layout.by_dtype[dtype].numel, dtype=dtype)
    for offset, numel, source in block.mapped[dtype]:
        expected[offset : offset + numel] = source
    return expected


def slot_buffers(blocks: list[StreamedBlock]) -> list[dict[torch.dtype, torch.Tensor]]:
    """Two host "slots", filled with a pattern the gaps must not keep."""
    capacity = slot_capacity([block.layout for block in blocks], 1)
    return [
        {dtype: torch.full((numel,), 7.0, dtype=dtype) for dtype, numel in capacity.items()}
        for _ in range(2)
    ]


def assert_holds(buffers: dict[torch.dtype, torch.Tensor], block: StreamedBlock) -> None:
    for dtype, dtype_layout in block.layout.by_dtype.items():
        assert torch.equal(buffers[dtype][: dtype_layout.numel], packed(block, dtype))


@pytest.fixture
def ring():
    ring = StagingRing(CPU, None, TransferCounters(), lanes=3, chunk_bytes=4096, chunks=6)
    yield ring
    ring.close()


def test_every_fill_holds_the_packed_block(ring: StagingRing) -> None:
    blocks = [make_block(index) for index in range(4)]
    slots = slot_buffers(blocks)
    for index, block in enumerate(blocks):
        ring.fill(block, index % 2, slots[index % 2], None, None)
        ring.wait_filled(index % 2)
        assert_holds(slots[index % 2], block)
    counters = ring.counters()
    assert counters.packed_bytes == sum(block.layout.nbytes for block in blocks)
    # No CUDA: no copy events to wait for and no CUDA calls, so neither is counted.
    assert counters.copy_wait_seconds == counters.feeder_enqueue_seconds == 0.0
    assert counters.chunks == sum(
        -(-layout.numel * dtype.itemsize // 4096)
        for block in blocks
        for dtype, layout in block.layout.by_dtype.items()
    )


def test_the_ring_names_its_threads_to_the_kernel(ring: StagingRing) -> None:
    """The feeder and each of the three packers: live threads of this process, none of
    them the caller's, so their scheduler statistics are the ring's own."""
    ids = ring.thread_ids
    assert len(ids) == len(set(ids)) == ring.lanes + 1
    assert threading.get_native_id() not in ids
    assert all(Path(f"/proc/self/task/{thread_id}").is_dir() for thread_id in ids)
    assert ring.counters().runqueue_wait_seconds == ring_feed.runqueue_wait_seconds(ids)


@pytest.mark.parametrize(
    ("schedstats", "waited"),
    [
        # run time, run-queue wait, timeslices (ns): 2.5 ms + 0.5 ms waiting for a CPU.
        ({11: "9000000 2500000 40\n", 12: "3000000 500000 7\n"}, 0.003),
        ({11: "9000000 0 40\n", 12: "3000000 0 7\n"}, 0.0),
        # A kernel without scheduler statistics: threads that ran report no run time.
        ({11: "0 0 1\n", 12: "0 0 1\n"}, None),
        # A thread gone, or a file the kernel does not have.
        ({11: "9000000 2500000 40\n"}, None),
    ],
)
def test_the_run_queue_wait_comes_from_each_threads_schedstat(tmp_path, schedstats, waited) -> None:
    for thread_id, text in schedstats.items():
        (tmp_path / str(thread_id)).mkdir()
        (tmp_path / str(thread_id) / "schedstat").write_text(text)
    assert ring_feed.runqueue_wait_seconds([11, 12], tmp_path) == waited


def test_more_fills_than_chunks_and_queue_entries_stay_in_order(ring: StagingRing) -> None:
    """300 blocks x 2 dtypes queued before any wait: 600 jobs through a queue of 256 and a
    ring of 6 chunks; each block lands in its own destination."""
    blocks = [make_block(index % 5) for index in range(300)]
    destinations = [slot_buffers(blocks)[0] for _ in blocks]
    for index, (block, buffers) in enumerate(zip(blocks, destinations, strict=True)):
        ring.fill(block, index, buffers, None, None)
    for index in range(len(blocks)):
        ring.wait_filled(index)
    for block, buffers in zip(blocks, destinations, strict=True):
        assert_holds(buffers, block)


def test_bytes_at_any_alignment_land_whole(ring: StagingRing) -> None:
    """Byte-sized pieces at odd source and destination offsets, short and long, across
    chunk boundaries, with gaps: an FP8 block's pieces are bytes."""
    numel = 30_000
    layout = layout_of([("w", torch.zeros(numel, dtype=torch.uint8))])
    source = torch.randint(
        0, 256, (numel + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    spans = [
        (3, 300),
        (310, 5000),
        (5317, 1),
        (5400, 4097),
        (9600, 255),
        (9856, 256),
        (10113, 257),
        (12000, 17_999),
    ]
    # Each view shifted differently, so no two coalesce into one copy.
    pieces = [
        MappedPiece(offset, length, source[offset + shift : offset + shift + length])
        for shift, (offset, length) in enumerate(spans, start=1)
    ]
    block = StreamedBlock(
        name="bytes",
        module=nn.Identity(),
        layout=layout,
        parameters=[],
        mapped={torch.uint8: pieces},
    )
    destination = {torch.uint8: torch.full((numel,), 0xA5, dtype=torch.uint8)}
    ring.fill(block, 0, destination, None, None)
    ring.wait_filled(0)
    assert torch.equal(destination[torch.uint8], packed(block, torch.uint8))


def test_close_lands_fills_nobody_waited_for() -> None:
    ring = StagingRing(CPU, None, TransferCounters(), lanes=2, chunk_bytes=4096, chunks=4)
    blocks = [make_block(index) for index in range(2)]
    slots = slot_buffers(blocks)
    for index, block in enumerate(blocks):
        ring.fill(block, index, slots[index], None, None)
    ring.close()
    ring.close()  # idempotent
    for index, block in enumerate(blocks):
        assert_holds(slots[index], block)


def test_a_ring_that_was_not_built_is_a_clear_error(monkeypatch) -> None:
    """Installing without a C compiler skips the optional extension (simulated here; the
    integration suite runs a real installation without it)."""
    monkeypatch.setattr(ring_feed, "staging_ring_library", lambda: None)
    with pytest.raises(StagingRingUnavailableError, match="C compiler"):
        StagingRing(CPU, None, TransferCounters(), lanes=1, chunk_bytes=4096, chunks=2)
    with pytest.raises(StagingRingUnavailableError, match=r"--dlo-staging ring: .*install gcc"):
        ring_feed.check_built()


@pytest.mark.parametrize("chunk_bytes", [0, 4095, 3 * 2**20 + 1])
def test_a_chunk_size_that_is_not_whole_pages_is_refused(chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match="staging_ring_chunk_bytes must be a positive multiple"):
        OffloadConfig(staging_ring_chunk_bytes=chunk_bytes)


def test_an_unknown_staging_is_refused() -> None:
    with pytest.raises(ValueError, match="staging must be 'auto', 'ring' or 'buffers'"):
        OffloadConfig(staging="chunks")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cache_mib", "threads", "chunk_mib"),
    [
        # The 16-CPU hosts (300 MiB L3): 8 packers (the default), 16 chunks in 64 MiB;
        # 12 (set by flag), 24 in 96 MiB.
        (300, 8, 4),
        (300, 12, 4),
        (300, 4, 8),
        # A 105 MiB L3 (lease 15's H100 host): 4 MiB chunks although a 96 MiB ring takes
        # more than a third of it; 1 MiB chunks copied out at 18-21 GB/s (lease 16).
        (105, 12, 4),
        (105, 8, 4),
        (105, 2, 8),
        (32, 1, 4),
        # Never below 4 MiB, never above 8 MiB.
        (8, 8, 4),
        (4096, 1, 8),
        # Unknown cache.
        (None, 8, 4),
    ],
)
def test_the_chunk_size_follows_the_last_level_cache(cache_mib, threads, chunk_mib) -> None:
    cache = cache_mib * 2**20 if cache_mib is not None else None
    chunk = ring_chunk_bytes(cache, threads, 2)
    assert chunk == chunk_mib * 2**20
    if cache is not None and chunk > RING_CHUNK_BOUNDS[0]:
        assert 2 * threads * chunk <= cache // RING_CACHE_SHARE


@pytest.mark.parametrize(
    ("cpus", "ranks", "threads"),
    [
        # The 16-CPU H100 and H200 hosts, one rank: 8 packers (12 went to 1.20-1.24x
        # private pinned beside another process's memory traffic, 8 stayed within 1.08x).
        (16, 1, 8),
        # Many CPUs: still 8, past the copy engine's rate more only compete for memory.
        (208, 8, 8),
        (32, 1, 8),
        # Two ranks on 16 CPUs: each keeps a CPU for its model thread and its feeder.
        (16, 2, 6),
        (8, 1, 6),
        (4, 1, 2),
        # Too few CPUs for the rule: one packer.
        (2, 1, 1),
        (1, 1, 1),
        (16, 16, 1),
    ],
)
def test_the_packers_leave_the_ranks_busy_threads_a_cpu_each(cpus, ranks, threads) -> None:
    assert pack_threads_for(cpus, ranks) == threads


def test_the_default_packers_follow_this_processs_cpus_and_ranks(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cpus = len(os.sched_getaffinity(0))
    assert OffloadConfig().pack_threads == pack_threads_for(cpus, 2)
    assert OffloadConfig().pack_threads <= max(1, cpus // 2)


def cgroups(root: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup tree on disk as the kernel shows it: ``files`` relative to ``root``."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "self-cgroup").write_text(membership)
    return root, root / "self-cgroup"


@pytest.mark.parametrize(
    ("membership", "files", "limit"),
    [
        # A container's own cgroup v2 view (cgroup namespace): docker run --cpus 4.
        ("0::/\n", {"cpu.max": "400000 100000\n"}, 4.0),
        # A Pod's container seen from the host's hierarchy: the Pod's limit is the tightest.
        (
            "0::/kubepods/burstable/pod1/worker\n",
            {
                "kubepods/cpu.max": "max 100000\n",
                "kubepods/burstable/pod1/cpu.max": "250000 100000\n",
                "kubepods/burstable/pod1/worker/cpu.max": "300000 100000\n",
            },
            2.5,
        ),
        # cgroup v1, as a container sees its CPU hierarchy.
        (
            "4:cpu,cpuacct:/docker/abc\n",
            {
                "cpu,cpuacct/cpu.cfs_quota_us": "150000\n",
                "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            },
            1.5,
        ),
        # No limit: v2 "max", v1 -1, the v2 root (no cpu.max at all), a hybrid host.
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        ("0::/\n", {}, None),
        (
            "1:cpu:/\n0::/\n",
            {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
            None,
        ),
    ],
)
def test_the_cgroup_cpu_limit_is_the_tightest_on_the_way_to_the_root(
    tmp_path, membership, files, limit
) -> None:
    assert cgroup_cpu_limit(*cgroups(tmp_path, membership, files)) == limit


def test_packers_are_sized_by_the_cgroup_cpu_limit_not_only_the_affinity_mask(tmp_path) -> None:
    """A CPU limit leaves every CPU in the affinity mask but throttles past it: sizing the
    packers by the mask alone oversubscribes the limit."""
    affinity = len(os.sched_getaffinity(0))
    half_a_cpu = cgroups(tmp_path / "half", "0::/\n", {"cpu.max": "50000 100000\n"})
    assert usable_cpus(*half_a_cpu) == 1  # rounded up, never zero
    unlimited = cgroups(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})
    assert usable_cpus(*unlimited) == affinity
    above = cgroups(tmp_path / "above", "0::/\n", {"cpu.max": f"{(affinity + 3) * 10**5} 100000"})
    assert usable_cpus(*above) == affinity
    assert usable_cpus(tmp_path / "absent", tmp_path / "absent" / "cgroup") == affinity


def test_the_configured_chunk_size_wins_over_the_machines() -> None:
    assert OffloadConfig(staging_ring_chunk_bytes=3 * 2**20).ring_chunk_bytes == 3 * 2**20
    machine = OffloadConfig(pack_threads=2).ring_chunk_bytes
    assert machine == ring_chunk_bytes(last_level_cache_bytes(), 2, 2)
