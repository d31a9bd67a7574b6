"""Prometheus metrics of one worker process, served at ``/metrics``.

One module owns every metric so names stay consistent (``dlo_`` prefix, base units)
and tests can read them from the default registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import PLATFORM_COLLECTOR, REGISTRY, Counter, Gauge, Histogram, Info

# ``/metrics`` is open without the API key: publish no interpreter or library versions
# (the default registry's ``python_info`` names the exact Python release).
REGISTRY.unregister(PLATFORM_COLLECTOR)

REQUESTS = Counter(
    "dlo_requests",
    "Generation requests by outcome (ok, failed, rejected_invalid, rejected_busy, "
    "rejected_unavailable, rejected_unauthorized, dropped_disconnected: the client left "
    "while queued, client_disconnected: the client left before its body arrived).",
    ["outcome"],
)
REQUEST_SECONDS = Histogram(
    "dlo_request_seconds",
    "Time from intake to the image, queueing included.",
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
REQUEST_STAGE_SECONDS = Histogram(
    "dlo_request_stage_seconds",
    "Time of one pipeline call by stage: text_encoding, denoising (first to last DiT "
    "forward), decode (the VAE), png (encoding the images).",
    ["stage"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
DEVICE_PEAK_BYTES = Gauge(
    "dlo_device_memory_peak_bytes",
    "This rank's CUDA allocator peak since start, by kind (allocated: tensors, reserved: "
    "what the allocator holds); what --max-gpu-memory-gib must hold.",
    ["kind"],
)
WAVE_SECONDS = Histogram(
    "dlo_wave_seconds",
    "Time to run one wave across the engine's data-parallel ranks.",
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
WAVE_OCCUPANCY = Histogram(
    "dlo_wave_occupancy_ratio",
    "Share of a wave's data-parallel slots that served a real request.",
    buckets=(0.125, 0.25, 0.5, 0.75, 1.0),
)
STREAMING_ADVISED = Gauge(
    "dlo_streaming_advised",
    "1 for a text encoder --max-gpu-memory-gib kept resident that a request's measured copy "
    "waits say to stream (--dlo-stream-text-encoders): the log line 'placement advice' "
    "gives the numbers.",
    ["component"],
)
QUEUE_DEPTH = Gauge("dlo_request_queue_depth", "Requests waiting for a wave.")
READY = Gauge("dlo_ready", "1 when the worker is loaded and accepting requests.")
HOST_BACKING_FALLBACKS = Counter(
    "dlo_host_backing_fallbacks",
    "DiT components whose checkpoint mmap preflight failed and that loaded ordinarily, "
    "and starts whose runtime cache fell back to the ordinary tensors, by reason "
    "(topology, runtime-cache-preferred, missing, ambiguous, mixed, dtype, keep-fp32, format, "
    "class; cache-lock-timeout, cache-corrupt, cache-disk-full, cache-read-only, cache-budget, "
    "cache-layout, cache-error).",
    ["reason"],
)
RUNTIME_CACHE_STARTS = Counter(
    "dlo_runtime_cache_starts",
    "Starts with the runtime cache enabled, by result (built, joined, hit: skip-load, fallback).",
    ["result"],
)
RUNTIME_CACHE_CORRUPT = Counter(
    "dlo_runtime_cache_corrupt",
    "Runtime-cache entries that failed verification and were quarantined (what=entry), and "
    "skip-load source records naming an entry of another model, dropped (what=source-record).",
    ["what"],
)
RUNTIME_CACHE_BUILD_SECONDS = Histogram(
    "dlo_runtime_cache_build_seconds",
    "Time to hash, write and publish a runtime-cache entry.",
    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1200),
)
RUNTIME_CACHE_BYTES = Counter(
    "dlo_runtime_cache_written_bytes", "Bytes of runtime-cache entries this process published."
)
HOST_REGISTRATIONS = Counter(
    "dlo_host_registrations",
    "Starts with mapped DiT blocks, by how they reach the device: registered (direct "
    "copies), off (no --dlo-runtime-cache-pin-limit-gib), or why registration fell back "
    "to staging (budget, unsupported, cpu, adapter, not-mapped, failed, timeout, not-pinned).",
    ["result"],
)
STAGING_STARTS = Counter(
    "dlo_staging_starts",
    "Starts whose mapped DiT blocks are packed for the copy engine (not registered), by "
    "staging (ring: the native chunk ring, buffers: block-sized buffers) and reason "
    "(default, configured: --dlo-staging, not-built: the native ring is missing from this "
    "installation, so block buffers).",
    ["staging", "reason"],
)
STAGING_RING_SECONDS = Gauge(
    "dlo_staging_ring_seconds",
    "Seconds so far of the native staging ring by activity, summed over its packers: pack, "
    "idle (nothing submitted), ring_full (a chunk to pack, its ring slot not yet free), "
    "copy_wait (the part of ring_full waiting for the slot's copy itself: the copy engine "
    "is the bottleneck; the rest waited for the feeder); feeder_wait (the copy feeder "
    "waiting for a pack: the packers are the bottleneck); feeder_enqueue (the feeder in "
    "CUDA calls putting copies on the stream); compute_wait (the model's thread waiting for "
    "a block's last chunk to be enqueued); runqueue_wait (the packers and the feeder ready "
    "to run but waiting for a CPU, from the kernel's schedstat; NaN where it keeps none).",
    ["activity"],
)
FP8_CASTS = Counter(
    "dlo_fp8_casts",
    "How FP8 layers cast their weights, one count per GPU and compute dtype, by cast "
    "(triton: the worker's kernel, torch: Tensor.to) and reason (checked: the kernel wrote "
    "Tensor.to's bits for every e4m3 code; capability: the GPU has no FP8 conversion "
    "instructions; not-cuda; failed: the kernel could not be imported, compiled or "
    "launched; differs: it wrote other bits).",
    ["cast", "reason"],
)
NONFINITE_OUTPUTS = Counter(
    "dlo_nonfinite_outputs",
    "Generations whose decoded image held NaN or infinity (refused, not written).",
)
HOST_BACKING = Info("dlo_host_backing", "Where the DiT's streamed weights live on the host.")
LORA_ADAPTERS = Gauge(
    "dlo_lora_adapters", "LoRA adapters loaded: --lora (fused or not) and loaded while serving."
)
LORA_CHANGES = Counter(
    "dlo_lora_changes_total",
    "Adapters loaded or unloaded while serving (serve --lora-load-dir), by outcome.",
    ["action", "outcome"],
)
COMPILED_BLOCKS = Gauge("dlo_compiled_blocks", "DiT blocks compiled by --compile.")
COMPILE_FIRST_FORWARD_SECONDS = Gauge(
    "dlo_compile_first_forward_seconds",
    "Wall time of each DiT's first forward after --compile (every block graph compiled or "
    "loaded from inductor's cache, plus one forward), summed; 0 until it ran.",
)
COMPILE_RECOMPILES = Gauge(
    "dlo_compile_recompiles",
    "Graphs Dynamo compiled after every DiT's first compiled forward (a new image size or "
    "a failed guard); 0 in steady state.",
)
COMPILE_CACHE_LOOKUPS = Gauge(
    "dlo_compile_cache_lookups",
    "Compiled graphs inductor loaded from its cache (hit) or had to compile (miss).",
    ["result"],
)

COMPILE_EAGER_FALLBACKS = Gauge(
    "dlo_compile_eager_fallbacks",
    "Block graphs running eagerly because the compile cache's file system was full when "
    "they compiled.",
)


class Compilation(Protocol):
    """What the compile gauges read (``pipeline.compilation.CompiledBlocks``)."""

    @property
    def blocks(self) -> int: ...
    @property
    def first_forward_seconds(self) -> float | None: ...
    @property
    def recompiles(self) -> int: ...
    @property
    def cache_hits(self) -> int: ...
    @property
    def cache_misses(self) -> int: ...
    @property
    def eager_fallbacks(self) -> int: ...


def watch_staging_ring(read: Callable[[], dict[str, float]]) -> None:
    """Point the staging ring gauge at ``read`` (activity -> seconds; empty without a ring):
    each scrape reads the ring's counters, without synchronizing the device."""

    def reader(activity: str) -> Callable[[], float]:
        return lambda: read().get(activity, 0.0)

    for activity in (
        "pack",
        "idle",
        "ring_full",
        "copy_wait",
        "feeder_wait",
        "feeder_enqueue",
        "compute_wait",
        "runqueue_wait",
    ):
        STAGING_RING_SECONDS.labels(activity=activity).set_function(reader(activity))


def watch_compilation(compiled: Compilation) -> None:
    """Point the compile gauges at ``compiled``: each scrape reads its current values."""
    COMPILED_BLOCKS.set_function(lambda: compiled.blocks)
    COMPILE_FIRST_FORWARD_SECONDS.set_function(lambda: compiled.first_forward_seconds or 0.0)
    COMPILE_RECOMPILES.set_function(lambda: compiled.recompiles)
    COMPILE_CACHE_LOOKUPS.labels(result="hit").set_function(lambda: compiled.cache_hits)
    COMPILE_CACHE_LOOKUPS.labels(result="miss").set_function(lambda: compiled.cache_misses)
    COMPILE_EAGER_FALLBACKS.set_function(lambda: compiled.eager_fallbacks)
