"""Checkpoint-backed staging and registration vs the pinned path, Flux-class DiT, one GPU,
same process.

The real FluxTransformer2DModel configuration with random bf16 weights is written as a
sharded safetensors checkpoint, then run four ways, rank-local:

- resident (all weights on the GPU), for the limit;
- DLO, ordinary tensors: blocks in a private page-locked arena (the pinned path);
- DLO, checkpoint mmap: the loader's checkpoint mapping; blocks stay in the page cache and are
  packed by ``--pack-threads`` threads through two pinned staging buffers;
- DLO, registered checkpoint mmap: the mapping registered read-only with the driver and
  copied directly (``--dlo-runtime-cache-pin-limit-gib``); registration is timed with
  the checkpoint in the page cache and after evicting it (cold file);
- DLO, runtime-cache entry (``--cache-entry``): the entry built from the loaded model,
  then registered (timed cold and warm, with the memory cgroup's usage and the process's
  pinned pages before and after) and, with registration off, staged (one copy per block
  into staging, no per-tensor packing).

Every DLO step is timed synchronized around each step and back to back (as
``bench/flux_dlo.py`` says); each is compared with the pinned path timed the same way.
With ``--paired-rounds N`` each staging run is also timed in N rounds that alternate
the pinned path and the staged one, both enabled at once, so a ratio compares two
measurements the host made moments apart: a slow staged round beside a fast pinned one
is the staging's own, not a slow host's. Each measurement of a round also records its
copy rate, the ring's waits and the host's steal time, so a slow round says which of
them moved.

Staging runs once per ``--staging-buffers`` depth (packs run up to depth - 1 blocks ahead
of the copies) and, with ``--staging ring``, once per ``--ring-chunk-mib`` through the
native chunk ring (the worker's default; 0 MiB: the chunk size the worker chooses for
this machine, run once where it equals a size also given). Each ring run records where
the ring's threads spent their time (packing, idle, waiting for a ring slot's copy, the
feeder waiting for packs, the model waiting for a block's last chunk), so a slow run
explains itself; every run and the pinned path also record the CPU time the hypervisor
gave other guests meanwhile (``host_steal_s``).

It also measures the pack rate from the mapping into pinned memory for 1..N threads,
against the single-thread host-copy anchor of docs/limits.md (30-34 GB/s).

    python bench/flux_staging.py --resolutions 1024 2048 --json out.json

``DLO_BENCH_DIR`` chooses where the 24 GB checkpoint is written (default: a temp dir);
``--checkpoint-dir`` keeps it, so repeated runs write it once.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from flux_dlo import (
    back_to_back_step_seconds,
    build_flux,
    flux_inputs,
    pinned_h2d_gbps,
    release,
    step_seconds,
)
from safetensors.torch import save_file

SHARD_BYTES = 5 * 2**30
ANCHOR_PACK_GBPS = (30.0, 34.0)


def write_checkpoint(model: torch.nn.Module, directory: Path) -> float:
    """config.json + sharded safetensors + index, as diffusers writes them; returns seconds."""
    started = time.perf_counter()
    model.save_config(str(directory))
    shard: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = []
    size = 0
    for name, tensor in model.state_dict().items():
        if size + tensor.nbytes > SHARD_BYTES and shard:
            shards.append(shard)
            shard, size = {}, 0
        shard[name] = tensor
        size += tensor.nbytes
    shards.append(shard)
    weight_map = {}
    for index, part in enumerate(shards):
        name = f"diffusion_pytorch_model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {k: v.cpu() for k, v in part.items()}, directory / name, metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(part, name))
    index_path = directory / "diffusion_pytorch_model.safetensors.index.json"
    index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return time.perf_counter() - started


def checkpoint_backed(
    directory: Path,
    device: torch.device,
    pack_threads: int,
    *,
    registration_bytes: int = 0,
    staging_buffers: int = 3,
    staging: str = "buffers",
    ring_chunk_mib: int = 0,
    ring_depth: int = 2,
):
    """The skeleton and backend the worker would build from this directory."""
    from diffusers import FluxTransformer2DModel

    from dlo_worker.config import HostBacking, build_config, load_settings
    from dlo_worker.loader.diffusers_loader import prepare_dit
    from dlo_worker.loader.mapped_checkpoint import MappedCheckpoint
    from dlo_worker.offload import DistributedLayerwiseOffloadBackend, OffloadConfig

    config = build_config(
        {
            "model": {"model": str(directory), "dtype": "bfloat16"},
            "parallel": {},
            "offload": {"enable_distributed_layerwise_offload": True, "dlo_use_allgather": False},
        }
    )
    prepared = prepare_dit(
        load_settings(config), directory, FluxTransformer2DModel, torch.bfloat16, component="model"
    )
    if prepared.bindings is None:
        raise SystemExit(f"preflight refused the checkpoint: {prepared.reason}")
    mapped = MappedCheckpoint(HostBacking.CHECKPOINT_MMAP, {"model": prepared.bindings})
    backend = DistributedLayerwiseOffloadBackend(
        OffloadConfig(
            use_allgather=False,
            pack_threads=pack_threads,
            pin_limit_bytes=registration_bytes,
            staging_buffers=staging_buffers,
            staging=staging,
            staging_ring_chunk_bytes=ring_chunk_mib * 2**20 or None,
            staging_ring_chunks_per_thread=ring_depth,
        ),
        device,
        mapped,
    )
    return prepared.module, backend


def cgroup_memory_bytes() -> int | None:
    """This process's memory cgroup usage (v2 ``memory.current`` or v1 usage), if readable."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.current"
        elif "memory" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.usage_in_bytes"
        else:
            continue
        for file in (candidate, candidate.parent.parent / candidate.name):
            if file.exists():
                return int(file.read_text())
    return None


def host_steal_seconds() -> float:
    """CPU time the hypervisor ran other guests on this machine's CPUs (``steal`` in
    /proc/stat, summed over its CPUs): it grows while a shared host is busy, so a slow run
    with steal beside it was the host's."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def pinned_kib() -> int:
    """``VmPin`` of this process: pages pinned by the kernel (e.g. registered ranges)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmPin:"):
            return int(line.split()[1])
    return 0


def memory_delta(before: tuple[int | None, int], after: tuple[int | None, int]) -> dict:
    cgroup = None if None in (before[0], after[0]) else (after[0] - before[0]) / 2**30
    return {"cgroup_delta_gib": cgroup, "vm_pin_delta_gib": (after[1] - before[1]) / 2**20}


def evict_files(paths) -> None:
    """Drop the files' clean pages from the page cache (a cold file), without root."""
    for path in paths:
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def cache_entry_runs(
    directory: Path, device: torch.device, inputs: dict, args, report: dict
) -> None:
    """Build the runtime-cache entry of the model, then stream it registered (cold and
    warm page cache) and staged, each from a fresh meta skeleton bound to the entry."""
    from diffusers import FluxTransformer2DModel

    from dlo_worker.loader.components import diffusers_skeleton
    from dlo_worker.offload import DistributedLayerwiseOffloadBackend, OffloadConfig
    from dlo_worker.runtime_cache import CacheRequest, attach_runtime_cache
    from dlo_worker.runtime_cache.entry import RuntimeCacheEntry, read_manifest

    model = build_flux(device).to("cpu")
    release(device)
    started = time.perf_counter()
    entry, built = attach_runtime_cache(
        CacheRequest(directory / "cache", 600.0), [("model", model)]
    )
    if entry is None:
        raise SystemExit(f"the runtime cache fell back: {built.reason}")
    report["cache_entry"] = {"build_s": time.perf_counter() - started, "gib": built.bytes / 2**30}
    entry_dir = entry.directory
    entry.close()
    del model, entry
    gc.collect()
    runs = [("registered", "cold"), ("registered", "warm")]
    runs += [("staged", depth) for depth in args.staging_buffers]
    for mode, detail in runs:
        if detail == "cold":
            evict_files(entry_dir.iterdir())
        memory_before = (cgroup_memory_bytes(), pinned_kib())
        started = time.perf_counter()
        entry = RuntimeCacheEntry(entry_dir, read_manifest(entry_dir, built.key), lambda: None)
        # Flux keeps no module in float32: the skeleton's dtypes are the entry's.
        skeleton = diffusers_skeleton(FluxTransformer2DModel, directory, torch.bfloat16)
        backend = DistributedLayerwiseOffloadBackend(
            OffloadConfig(
                use_allgather=False,
                pin_limit_bytes=2**40 if mode == "registered" else 0,
                staging_buffers=detail if mode == "staged" else 3,
            ),
            device,
            entry,
        )
        backend.enable(skeleton)
        stats = backend.stats()
        name = f"entry_{mode}_{detail}"
        report[name] = {
            "setup_s": time.perf_counter() - started,
            "registration": stats.host_registration,
            "registered_gib": stats.registered_bytes / 2**30,
            **memory_delta(memory_before, (cgroup_memory_bytes(), pinned_kib())),
        }
        if detail != "cold":
            for resolution in args.resolutions:
                release(device)
                row = report["results"][resolution]
                seconds = step_seconds(skeleton, inputs[resolution], args.repeats)
                row[f"{name}_s"] = seconds
                row[f"{name}_over_pinned"] = seconds / row["pinned_s"]
            stats = backend.stats()
            report[name] |= {
                "achieved_h2d_gbps": stats.h2d_gbps,
                "pack_gbps": stats.pack_gbps,
                "staging_gib": stats.staging_bytes / 2**30,
            }
        backend.disable()
        del skeleton, backend, entry
        gc.collect()
        release(device)


def pack_rates(directory: Path, threads: list[int], blocks: int = 6) -> dict[int, float]:
    """GB/s packing the first ``blocks`` double blocks from the mapping into pinned memory."""
    from safetensors import safe_open

    from dlo_worker.offload.feeds.staging import MappedPiece, Packer, wait_all

    index = json.loads((directory / "diffusion_pytorch_model.safetensors.index.json").read_text())
    views = []
    handles = {}
    for key, file in sorted(index["weight_map"].items()):
        if key.startswith(tuple(f"transformer_blocks.{i}." for i in range(blocks))):
            handle = handles.setdefault(file, safe_open(str(directory / file), framework="pt"))
            views.append(handle.get_tensor(key).reshape(-1))
    pieces, offset = [], 0
    for view in views:
        pieces.append(MappedPiece(offset, view.numel(), view))
        offset += view.numel()
    target = torch.empty(offset, dtype=torch.bfloat16, pin_memory=True)
    rates = {}
    for count in threads:
        packer = Packer(count)
        wait_all(packer.pack(pieces, 0, offset, target))  # warm: pages in cache, threads up
        seconds = min(wait_all(packer.pack(pieces, 0, offset, target)) for _ in range(3))
        rates[count] = target.nbytes / seconds / 1e9
        packer.close()
    return rates


def registered_runs(directory: Path, device: torch.device, inputs: dict, args, report) -> None:
    """The registered checkpoint path: registration time (cold file, then warm) and steps."""
    for cache in ("cold", "warm") if args.cold else ("warm",):
        if cache == "cold":
            evict_files(directory.glob("*.safetensors"))
        memory_before = (cgroup_memory_bytes(), pinned_kib())
        started = time.perf_counter()
        skeleton, backend = checkpoint_backed(directory, device, 1, registration_bytes=2**40)
        backend.enable(skeleton)
        stats = backend.stats()
        report[f"registered_{cache}"] = {
            "setup_s": time.perf_counter() - started,
            "registration": stats.host_registration,
            "registered_gib": stats.registered_bytes / 2**30,
            **memory_delta(memory_before, (cgroup_memory_bytes(), pinned_kib())),
        }
        if cache == "warm":
            for resolution in args.resolutions:
                release(device)
                row = report["results"][resolution]
                registered_s = step_seconds(skeleton, inputs[resolution], args.repeats)
                row["registered_s"] = registered_s
                row["registered_over_pinned"] = registered_s / row["pinned_s"]
                back_to_back = back_to_back_step_seconds(skeleton, inputs[resolution], args.repeats)
                row["registered_back_to_back_s"] = back_to_back
                row["registered_back_to_back_over_pinned"] = (
                    back_to_back / row["pinned_back_to_back_s"]
                )
            report["registered_warm"]["achieved_h2d_gbps"] = backend.stats().h2d_gbps
        backend.disable()
        del skeleton, backend
        gc.collect()
        release(device)


def counters(backend) -> dict[str, float | None]:
    """The backend's cumulative counters and the host's steal time, for deltas around one
    measurement: a slow round then says whether its copies, its packers or the host were
    slow."""
    stats = backend.stats()
    return {
        "bytes_streamed": stats.bytes_streamed,
        "h2d_s": stats.h2d_seconds,
        "pack_wait_s": stats.pack_wait_seconds,
        "ring_full_wait_s": stats.ring_full_wait_seconds,
        "ring_copy_wait_s": stats.ring_copy_wait_seconds,
        "ring_feeder_wait_s": stats.ring_feeder_wait_seconds,
        "ring_feeder_enqueue_s": stats.ring_feeder_enqueue_seconds,
        "ring_runqueue_wait_s": stats.ring_runqueue_wait_seconds,
        "host_steal_s": host_steal_seconds(),
    }


def measured(module: torch.nn.Module, backend, timing, inputs: dict, repeats: int):
    """Step seconds of one measurement and what the counters did meanwhile: the copy rate
    (bytes over the copies' own time), the waits and the host's steal time."""
    before = counters(backend)
    seconds = timing(module, inputs, repeats)
    delta = {
        key: None if value is None or before[key] is None else value - before[key]
        for key, value in counters(backend).items()
    }
    copied = delta.pop("bytes_streamed")
    copy_s = delta.pop("h2d_s")
    return seconds, {"h2d_gbps": copied / copy_s / 1e9 if copy_s else 0.0, **delta}


def fmt_seconds(value: float | None) -> str:
    """Seconds to print, or why there are none (the kernel keeps no scheduler statistics)."""
    return "unknown (no schedstat)" if value is None else f"{value:.2f} s"


def paired_rounds(pinned: tuple, staged: tuple, inputs: dict, rounds: int, repeats: int) -> dict:
    """Staged over pinned step time, per round of one pinned then one staged measurement
    (synchronized, then back to back), the median and worst over the rounds, and each
    measurement's counters (``pinned`` and ``staged``: each a module and its backend)."""
    ratios: dict[str, list[float]] = {"synchronized": [], "back_to_back": []}
    seen: dict[str, list[dict]] = {"synchronized": [], "back_to_back": []}
    for _ in range(rounds):
        for timing, seconds in (
            ("synchronized", step_seconds),
            ("back_to_back", back_to_back_step_seconds),
        ):
            pinned_s, pinned_counters = measured(pinned[0], pinned[1], seconds, inputs, repeats)
            staged_s, staged_counters = measured(staged[0], staged[1], seconds, inputs, repeats)
            ratios[timing].append(staged_s / pinned_s)
            seen[timing].append({"pinned": pinned_counters, "staged": staged_counters})
    summary: dict = {"rounds": ratios, "counters": seen}
    for timing, values in ratios.items():
        summary[f"{timing}_median"] = statistics.median(values)
        summary[f"{timing}_max"] = max(values)
    return summary


def worker_chunk_mib(threads: int, depth: int) -> int:
    """The ring chunk size (MiB) the worker chooses on this machine for ``threads`` packers
    with ``depth`` chunks each, so a ``--ring-chunk-mib 0`` run is named by its size and
    not run twice beside the same size given explicitly."""
    from dlo_worker.offload import OffloadConfig

    config = OffloadConfig(pack_threads=threads, staging_ring_chunks_per_thread=depth)
    return config.ring_chunk_bytes // 2**20


def staging_runs(
    directory: Path,
    device: torch.device,
    inputs: dict,
    args,
    report: dict,
    *,
    bound_s: float,
    pinned: tuple | None,
) -> None:
    """The checkpoint-mmap staging path for each ``--pack-threads`` and ``--staging`` kind
    (each ``--staging-buffers`` depth, each ``--ring-chunk-mib``); with ``pinned`` (the
    pinned path's module and backend, still enabled) also ``--paired-rounds`` against it."""
    runs = list(
        dict.fromkeys(
            (threads, kind, size, depth)
            for threads in args.pack_threads
            for kind in args.staging
            for depth in (args.ring_depth if kind == "ring" else [0])
            for size in (
                [size or worker_chunk_mib(threads, depth) for size in args.ring_chunk_mib]
                if kind == "ring"
                else args.staging_buffers
            )
        )
    )
    for threads, kind, size, depth in runs:
        started = time.perf_counter()
        skeleton, backend = checkpoint_backed(
            directory,
            device,
            threads,
            staging_buffers=size if kind == "buffers" else 3,
            staging=kind,
            ring_chunk_mib=size if kind == "ring" else 0,
            ring_depth=depth or 2,
        )
        backend.enable(skeleton)
        setup_s = time.perf_counter() - started
        chunk_mib = backend.stats().ring_chunk_bytes // 2**20
        steal_before, timed_from = host_steal_seconds(), time.perf_counter()
        run = (
            f"ring_{threads}t_{chunk_mib}mib_{depth}d" if kind == "ring" else f"{threads}t_{size}b"
        )
        for resolution in args.resolutions:
            release(device)
            row = report["results"][resolution]
            staged_s = step_seconds(skeleton, inputs[resolution], args.repeats)
            limit = max(row["resident_s"], bound_s)
            row[f"staging_{run}_s"] = staged_s
            row[f"staging_{run}_over_pinned"] = staged_s / row["pinned_s"]
            row[f"staging_{run}_over_limit"] = staged_s / limit
            back_to_back = back_to_back_step_seconds(skeleton, inputs[resolution], args.repeats)
            row[f"staging_{run}_back_to_back_s"] = back_to_back
            row[f"staging_{run}_back_to_back_over_pinned"] = (
                back_to_back / row["pinned_back_to_back_s"]
            )
            if pinned is not None:
                row[f"staging_{run}_paired"] = paired_rounds(
                    pinned,
                    (skeleton, backend),
                    inputs[resolution],
                    args.paired_rounds,
                    args.repeats,
                )
        stats = backend.stats()
        report[f"staging_{run}"] = {
            "worker_default": kind == "ring" and size == worker_chunk_mib(threads, depth),
            "setup_s": setup_s,
            "pack_gbps": stats.pack_gbps,
            "pack_wait_s": stats.pack_wait_seconds,
            "achieved_h2d_gbps": stats.h2d_gbps,
            "staging_gib": stats.staging_bytes / 2**30,
            "host_private_gib": stats.host_bytes / 2**30,
            "exposed_wait_ms_per_block": stats.exposed_wait_seconds_per_block * 1e3,
            "staging": stats.staging,
            "ring_chunk_mib": stats.ring_chunk_bytes / 2**20,
            "ring_chunks": stats.ring_chunks,
            "ring_idle_s": stats.ring_idle_seconds,
            "ring_full_wait_s": stats.ring_full_wait_seconds,
            "ring_copy_wait_s": stats.ring_copy_wait_seconds,
            "ring_feeder_wait_s": stats.ring_feeder_wait_seconds,
            "ring_feeder_enqueue_s": stats.ring_feeder_enqueue_seconds,
            "ring_runqueue_wait_s": stats.ring_runqueue_wait_seconds,
            "compute_wait_s": stats.pack_wait_seconds,
            "timed_s": time.perf_counter() - timed_from,
            "host_steal_s": host_steal_seconds() - steal_before,
        }
        backend.disable()
        del skeleton, backend
        gc.collect()
        release(device)


def print_report(report: dict) -> None:
    print(
        f"{report['gpu']}, {report['cpus']} CPUs, last-level cache "
        f"{report['last_level_cache_mib']:.0f} MiB, pinned H2D {report['pinned_h2d_gbps']:.1f} GB/s"
    )
    for threads, rate in report["pack_gbps_by_threads"].items():
        print(
            f"pack {threads:>2} thread(s): {rate:6.1f} GB/s = {rate / ANCHOR_PACK_GBPS[1]:.2f}x "
            f"the one-thread anchor's top ({ANCHOR_PACK_GBPS[1]} GB/s)"
        )
    for resolution, row in report["results"].items():
        print(
            f"{resolution}: resident {row['resident_s']:.3f} s, bound "
            f"{row['transfer_bound_s']:.3f} s, pinned {row['pinned_s']:.3f} s"
        )
        for key in sorted(k for k in row if k.endswith("_over_pinned")):
            name = key.removesuffix("_over_pinned")
            print(f"{resolution}: {name} {row[f'{name}_s']:.3f} s = {row[key]:.3f}x pinned")
        for key in sorted(k for k in row if k.endswith("_paired")):
            paired = row[key]
            print(
                f"{resolution}: {key.removesuffix('_paired')} paired with pinned over "
                f"{len(paired['rounds']['synchronized'])} rounds: median "
                f"{paired['synchronized_median']:.3f} / {paired['back_to_back_median']:.3f}x, "
                f"worst {paired['synchronized_max']:.3f} / {paired['back_to_back_max']:.3f}x "
                "(synchronized / back to back)"
            )
            for timing, rounds in paired["counters"].items():
                for index, seen in enumerate(rounds):
                    pinned, staged = seen["pinned"], seen["staged"]
                    print(
                        f"  {timing} round {index + 1}: "
                        f"{paired['rounds'][timing][index]:.3f}x, copies "
                        f"{staged['h2d_gbps']:.1f} GB/s (pinned {pinned['h2d_gbps']:.1f}), "
                        f"ring full {staged['ring_full_wait_s']:.2f} s (copies "
                        f"{staged['ring_copy_wait_s']:.2f} s), feeder waited "
                        f"{staged['ring_feeder_wait_s']:.2f} s and enqueued "
                        f"{staged['ring_feeder_enqueue_s']:.2f} s, ring threads waited "
                        f"{fmt_seconds(staged['ring_runqueue_wait_s'])} for a CPU, steal "
                        f"{staged['host_steal_s']:.2f} s (pinned {pinned['host_steal_s']:.2f})"
                    )
    if "pinned_timed_s" in report:
        print(
            f"pinned path: timed {report['pinned_timed_s']:.1f} s, host steal "
            f"{report['pinned_host_steal_s']:.2f} s"
        )
    for name, run in report.items():
        if isinstance(run, dict) and "setup_s" in run:
            details = ", ".join(
                f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
                for key, value in run.items()
            )
            print(f"{name}: {details}")
    if (entry := report.get("cache_entry")) is not None:
        print(f"cache entry: {entry['gib']:.2f} GiB built in {entry['build_s']:.1f} s")


def parse_args() -> argparse.Namespace:
    from dlo_worker.offload import OffloadConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--pack-threads",
        type=int,
        nargs="+",
        default=[OffloadConfig().pack_threads],
        help="Default: the worker's (this process's share of the CPUs less 2, at most 8).",
    )
    parser.add_argument("--staging-buffers", type=int, nargs="+", default=[3])
    parser.add_argument(
        "--staging",
        nargs="+",
        choices=["ring", "buffers"],
        default=["ring", "buffers"],
        help="Staging kinds: the native chunk ring, block-sized buffers.",
    )
    parser.add_argument(
        "--ring-chunk-mib",
        type=int,
        nargs="+",
        default=[0],
        help="Ring chunk sizes; 0: the worker's choice for this machine.",
    )
    parser.add_argument(
        "--ring-depth",
        type=int,
        nargs="+",
        default=[2],
        help="Ring chunks per pack thread (staging_ring_chunks_per_thread).",
    )
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=0,
        help="Also time each staging run in this many rounds alternating with the pinned "
        "path (both enabled at once), a staged-over-pinned ratio per round.",
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="Write the checkpoint here once and reuse it (default: a temporary directory).",
    )
    parser.add_argument(
        "--skip-registered", action="store_true", help="Skip the registered checkpoint runs."
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--skip-staging", action="store_true", help="Skip the checkpoint staging runs."
    )
    parser.add_argument("--skip-pack-rates", action="store_true")
    parser.add_argument(
        "--cold", action="store_true", help="Also time registration after evicting the file."
    )
    parser.add_argument(
        "--cache-entry", action="store_true", help="Also stream a runtime-cache entry."
    )
    return parser.parse_args()


def main() -> None:
    from dlo_worker.offload import enable_dlo
    from dlo_worker.offload.config import last_level_cache_bytes

    args = parse_args()
    device = torch.device("cuda", 0)
    report: dict = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "last_level_cache_mib": (last_level_cache_bytes() or 0) / 2**20,
        "pinned_h2d_gbps": pinned_h2d_gbps(device),
        "results": {},
    }
    inputs = {r: flux_inputs(r, device) for r in args.resolutions}
    with tempfile.TemporaryDirectory(dir=os.environ.get("DLO_BENCH_DIR")) as root:
        directory = args.checkpoint_dir or Path(root)
        model = build_flux(device)
        index = directory / "diffusion_pytorch_model.safetensors.index.json"
        if not index.exists():
            directory.mkdir(parents=True, exist_ok=True)
            report["write_s"] = write_checkpoint(model, directory)
        for resolution in args.resolutions:
            release(device)
            report["results"][resolution] = {
                "resident_s": step_seconds(model, inputs[resolution], args.repeats)
            }
        backend = enable_dlo(model, device=device, use_allgather=False)
        block_bytes = sum(layout.nbytes for layout in backend.block_layouts())
        report["block_gib"] = block_bytes / 2**30
        bound_s = block_bytes / (report["pinned_h2d_gbps"] * 1e9)
        steal_before, timed_from = host_steal_seconds(), time.perf_counter()
        for resolution in args.resolutions:
            release(device)
            row = report["results"][resolution]
            row["transfer_bound_s"] = bound_s
            row["pinned_s"] = step_seconds(model, inputs[resolution], args.repeats)
            row["pinned_back_to_back_s"] = back_to_back_step_seconds(
                model, inputs[resolution], args.repeats
            )
        report["pinned_timed_s"] = time.perf_counter() - timed_from
        report["pinned_host_steal_s"] = host_steal_seconds() - steal_before
        if not args.paired_rounds:
            backend.disable()
            del model, backend
            gc.collect()
            release(device)

        if not args.skip_registered:
            registered_runs(directory, device, inputs, args, report)
        if args.cache_entry:
            cache_entry_runs(directory, device, inputs, args, report)
        report["pack_gbps_by_threads"] = (
            {} if args.skip_pack_rates else pack_rates(directory, sorted({1, 2, 4, 8, 16}))
        )
        if not args.skip_staging:
            staging_runs(
                directory,
                device,
                inputs,
                args,
                report,
                bound_s=bound_s,
                pinned=(model, backend) if args.paired_rounds else None,
            )
        if args.paired_rounds:
            backend.disable()
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
