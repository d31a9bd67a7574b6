"""What DLO did so far, as one frozen record (the metrics endpoint exports it)."""

from __future__ import annotations

from dataclasses import dataclass


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
    staging_reason: str
    """Why this staging: ``default`` (the ring), ``configured`` (``staging`` named it),
    ``not-built`` (block buffers: the native ring is missing); ``none`` without staging."""
    ring_chunk_bytes: int
    ring_idle_seconds: float
    """Summed over the ring's packers: nothing submitted to pack."""
    ring_full_wait_seconds: float
    """Summed over the ring's packers: a chunk to pack, its ring slot not free yet (split
    by ``ring_copy_wait_seconds``)."""
    ring_copy_wait_seconds: float
    """The part of ``ring_full_wait_seconds`` spent waiting for the slot's copy itself;
    the rest waited for the feeder to put the slot's previous chunk on the stream (the
    feeder is the bottleneck)."""
    ring_feeder_wait_seconds: float
    """The ring's copy feeder waiting for the next chunk's pack (the packers are the
    bottleneck: the copy engine may idle)."""
    ring_feeder_enqueue_seconds: float
    """The ring's copy feeder in CUDA calls, putting copies on the stream."""
    ring_chunks: int
    """Chunks the ring handed to the copy stream."""
    ring_runqueue_wait_seconds: float | None
    """Summed over the ring's packers and feeder: ready to run, waiting for a CPU (the
    kernel's schedstat); ``None`` without a ring or where the kernel does not report it."""
    host_registration: str
    """Mapped blocks: ``registered`` (direct copies), ``off`` (no budget), or why staging
    is used (``budget``, ``unsupported``, ``cpu``, ``adapter``, ``not-mapped``, ``failed``,
    ``timeout``, ``not-pinned``); ``none`` without mapped blocks."""
    registered_bytes: int
    """Host bytes registered with the driver for direct copies (page-locked, shared)."""
    pack_gbps: float
    """Staging pack rate (bytes packed / pack wall time)."""
    pack_wait_seconds: float
    """Host time the model's thread waited for staging: a buffer's pack, or the ring
    enqueuing a block's last chunk."""
    host_page_locked: bool
    device_slot_bytes: int
    largest_block_bytes: int
    compiled_blocks: int
    """Streamed blocks whose ``forward`` is compiled (``block.compile()``, ``--compile``)."""
    recompiles: int
    """Graphs Dynamo compiled (process-wide) after every DiT's first compiled forward: a
    new input size or a failed guard; 0 in steady state."""
