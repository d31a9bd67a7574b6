"""What bounds staging? Streaming a page-cache file to the GPU through pinned buffers, one GPU.

Staging reads each byte from the page cache, writes it to a pinned buffer and has the copy
engine read it again. With block-sized buffers all three go to DRAM. This probe streams
``--gib`` GiB of a file (page cache warm, pages mapped) to the device and prints GB/s for:

- ``pinned``: the H2D limit (a pinned source, no pack);
- ``pack-only``: the host copy alone, into a big and into a small (cache-sized) buffer;
- ``blocks``: DLO's scheme today (a block-sized pack by a thread pool, then one copy);
- ``ring``: chunks of ``--chunk-mib`` packed by ``--threads`` threads into a small ring of
  pinned chunks, each copied to the device as soon as it is packed, so the copy engine may
  read it while it is still in the CPU's last-level cache.

Each is read with ``--copy``: a ``torch`` copy from the mapping (``torch1``: one intra-op
thread), the C library's ``memmove``, or ``pread`` from the file. ``--pinning`` chooses how
the pinned buffers are made, ``--busy`` repeats the streaming runs beside a thread
launching kernels from Python. No model runs: what DLO's hooks add is measured by
``bench/flux_staging.py``. Results and conclusions: docs/benchmarks.md.

``--beside`` asks why the copy engine reads the ring slower than private pinned memory on
some hosts. It times chunked H2D copies out of a big pinned buffer and out of a ring-sized
one, alone and while ``--threads`` threads pack the mapping with ``memmove`` into a buffer
of their own or into the very buffer being copied (the ring's pattern without its
synchronization). Slower copies beside packing into a buffer of their own mean the packers'
memory traffic is what slows the copies; slower copies only beside packing into the same
buffer mean the copy engine's reads of freshly written lines are.

Run: ``python bench/staging_ring_probe.py --gib 8``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dlo_worker.offload.feeds.arena import HostArena

MIB = 2**20


@contextlib.contextmanager
def busy_launcher(enabled: bool):
    """A thread launching small kernels from Python without pause, as a model's forward
    does on the hooks' thread: it competes with the packing threads for the GIL."""
    if not enabled:
        yield
        return
    stop = threading.Event()

    def launch() -> None:
        stream = torch.cuda.Stream()
        tensor = torch.zeros(1024, device="cuda")
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(100):
                    tensor.add_(1.0)
                stream.synchronize()

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


PINNING = {"alloc": "cudaHostAlloc (torch pin_memory)", "register": "DLO's host arena"}
_arenas: list[HostArena] = []


def pinned_buffer(nbytes: int, how: str) -> torch.Tensor:
    """Page-locked bytes allocated by the driver (``alloc``), or ordinary memory registered
    afterwards (``register``: DLO's own host arena)."""
    if how == "alloc":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    arena = HostArena({torch.uint8: nbytes}, page_lock=True)
    _arenas.append(arena)
    return arena.take(torch.uint8, nbytes)


def write_file(path: Path, nbytes: int) -> None:
    block = torch.randint(0, 255, (256 * MIB,), dtype=torch.uint8).numpy().tobytes()
    with path.open("wb") as handle:
        for low in range(0, nbytes, len(block)):
            handle.write(block[: min(len(block), nbytes - low)])


def host_copy(kind: str, fd: int):
    """``read(dst, source, low)``: bytes ``[low, low + dst.numel())`` of the file into the
    uint8 tensor ``dst``, releasing the GIL: from the mapping ``source`` by a ``torch`` copy
    (``torch``, ``torch1``: one thread) or the C library's ``memmove``, or with ``pread``
    from the file descriptor (the kernel copies from the page cache through its own
    mapping of memory, so the user page tables of the file are never walked)."""
    if kind == "memmove":
        return lambda dst, source, low: ctypes.memmove(
            dst.data_ptr(), source[low:].data_ptr(), dst.numel()
        )
    if kind == "pread":

        def pread(dst: torch.Tensor, _source: torch.Tensor, low: int) -> None:
            view, done = memoryview(dst.numpy()), 0
            while done < len(view):
                done += os.preadv(fd, [view[done:]], low + done)

        return pread
    return lambda dst, source, low: dst.copy_(source[low : low + dst.numel()])


def pack_only(source: torch.Tensor, target: torch.Tensor, threads: int, copy) -> float:
    """GB/s of copying ``source`` into ``target`` (reused cyclically) with ``threads``."""
    span = target.numel() // threads
    pieces = [(low, min(span, source.numel() - low)) for low in range(0, source.numel(), span)]

    def one(index: int) -> None:
        low, size = pieces[index]
        slot = (index % threads) * span
        copy(target[slot : slot + size], source, low)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(pieces))))
    return source.numel() / (time.perf_counter() - started) / 1e9


def pinned_rate(device_buffer: torch.Tensor, total: int) -> float:
    source = torch.empty(device_buffer.numel(), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(total // device_buffer.numel()):
            device_buffer.copy_(source, non_blocking=True)
    stream.synchronize()
    return total / (time.perf_counter() - started) / 1e9


def blocks_rate(
    source: torch.Tensor,
    device_buffer: torch.Tensor,
    *,
    block: int,
    threads: int,
    depth: int,
    copy,
    pinning: str = "alloc",
) -> float:
    """Today's scheme: pack a whole block into one of ``depth`` buffers, then copy it."""
    buffers = [pinned_buffer(block, pinning) for _ in range(depth)]
    copied: list[torch.cuda.Event | None] = [None] * depth
    pool = ThreadPoolExecutor(threads)
    stream = torch.cuda.Stream()
    blocks = [(low, min(block, source.numel() - low)) for low in range(0, source.numel(), block)]

    def pack(index: int):
        low, size = blocks[index]
        target = buffers[index % depth]
        event = copied[index % depth]
        part = -(-size // threads)

        def chunk(at: int) -> None:
            if event is not None:
                event.synchronize()
            copy(target[at : min(at + part, size)], source, low + at)

        return [pool.submit(chunk, at) for at in range(0, size, part)]

    torch.cuda.synchronize()
    started = time.perf_counter()
    pending = {index: pack(index) for index in range(min(depth - 1, len(blocks)))}
    for index, (_, size) in enumerate(blocks):
        for future in pending.pop(index):
            future.result()
        with torch.cuda.stream(stream):
            offset = (index * block) % (device_buffer.numel() - block + 1)
            device_buffer[offset : offset + size].copy_(
                buffers[index % depth][:size], non_blocking=True
            )
            event = torch.cuda.Event()
            event.record(stream)
        copied[index % depth] = event
        if index + depth - 1 < len(blocks):
            pending[index + depth - 1] = pack(index + depth - 1)
    stream.synchronize()
    seconds = time.perf_counter() - started
    pool.shutdown()
    return source.numel() / seconds / 1e9


def ring_rate(
    source: torch.Tensor,
    device_buffer: torch.Tensor,
    *,
    chunk: int,
    ring: int,
    threads: int,
    copy,
    pinning: str = "alloc",
) -> float:
    """Chunks packed into a small pinned ring and copied as soon as each is packed.

    Thread ``t`` owns chunks ``t, t + threads, ...`` and ``ring // threads`` ring slots of
    its own, so a slot is reused only by its owner, after the copy out of it finished.
    """
    per_thread = max(1, ring // threads)
    slots = [pinned_buffer(chunk, pinning) for _ in range(threads * per_thread)]
    stream = torch.cuda.Stream()
    total = source.numel()
    count = -(-total // chunk)
    lock = threading.Lock()
    wrap = device_buffer.numel() - chunk + 1

    def run(owner: int) -> None:
        events: list[torch.cuda.Event | None] = [None] * per_thread
        for turn, index in enumerate(range(owner, count, threads)):
            slot_index = turn % per_thread
            if events[slot_index] is not None:
                events[slot_index].synchronize()
            slot = slots[owner * per_thread + slot_index]
            low = index * chunk
            size = min(chunk, total - low)
            copy(slot[:size], source, low)
            offset = low % wrap
            with lock, torch.cuda.stream(stream):
                device_buffer[offset : offset + size].copy_(slot[:size], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            events[slot_index] = event

    torch.cuda.synchronize()
    started = time.perf_counter()
    workers = [threading.Thread(target=run, args=(owner,)) for owner in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stream.synchronize()
    return total / (time.perf_counter() - started) / 1e9


def copies_beside_packing(
    source: torch.Tensor,
    device_buffer: torch.Tensor,
    region: torch.Tensor,
    *,
    chunk: int,
    threads: int,
    pack_into: str,
    total: int,
) -> tuple[float, float]:
    """GB/s of ``total`` bytes copied to the device in ``chunk``-sized copies cycling through
    the pinned ``region``, and of the packing beside them: ``threads`` threads ``memmove``
    the mapping ``source`` chunk by chunk into ``region`` itself (``same``), into a buffer of
    the region's size of their own (``other``), or do not run (``none``)."""
    target = region if pack_into == "same" else torch.empty_like(region)
    stop, packed = threading.Event(), [0] * threads
    span = target.numel() // max(threads, 1) // chunk * chunk
    source_address, source_chunks = source.data_ptr(), source.numel() // chunk

    def pack(owner: int) -> None:
        # Integer addresses only: the loop holds the GIL for little more than the call.
        slot_address, index, offset = target.data_ptr() + owner * span, owner, 0
        while not stop.is_set():
            ctypes.memmove(
                slot_address + offset, source_address + index % source_chunks * chunk, chunk
            )
            packed[owner] += chunk
            index, offset = index + threads, (offset + chunk) % span

    copies = [
        (
            device_buffer[index * chunk % device_buffer.numel() :][:chunk],
            region[index * chunk % region.numel() :][:chunk],
        )
        for index in range(total // chunk)
    ]
    workers = [
        threading.Thread(target=pack, args=(owner,))
        for owner in range(threads if pack_into != "none" else 0)
    ]
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    for worker in workers:
        worker.start()
    time.sleep(0.2)  # packers at their steady rate before the copies start
    packed_before, started = sum(packed), time.perf_counter()
    with torch.cuda.stream(stream):
        for destination, chunk_source in copies:
            destination.copy_(chunk_source, non_blocking=True)
    stream.synchronize()
    elapsed = time.perf_counter() - started
    packed_during = sum(packed) - packed_before
    stop.set()
    for worker in workers:
        worker.join()
    return total / elapsed / 1e9, packed_during / elapsed / 1e9


def beside_runs(source, device_buffer, args, record) -> None:
    """``--beside``: chunked copies out of a big and a ring-sized pinned buffer, alone and
    beside packing (see the module's docstring)."""
    big = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    total = min(source.numel(), 8 * 2**30)
    for chunk_mib, threads in itertools.product(args.chunk_mib, args.threads):
        chunk = chunk_mib * MIB
        ring = torch.empty(threads * 2 * chunk, dtype=torch.uint8, pin_memory=True)
        ring_mib = ring.numel() // MIB
        cases = [
            ("1GiB", big, "none"),
            ("1GiB", big, "other"),
            (f"{ring_mib}MiB", ring, "none"),
            (f"{ring_mib}MiB", ring, "other"),
            (f"{ring_mib}MiB", ring, "same"),
        ]
        for name, region, pack_into in cases:
            copies, packs = copies_beside_packing(
                source,
                device_buffer,
                region,
                chunk=chunk,
                threads=threads,
                pack_into=pack_into,
                total=total,
            )
            label = f"beside {chunk_mib}MiB copies of {name}, {threads}t pack {pack_into}"
            record(label, copies)
            if pack_into != "none":
                record(f"{label}: packed", packs)


def machine() -> dict:
    info: dict = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    cache = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(cache.glob("index*")):
        level = (index / "level").read_text().strip()
        kind = (index / "type").read_text().strip()
        info[f"L{level}_{kind}"] = (index / "size").read_text().strip()
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    info["numa_nodes"] = len(nodes)
    model = [
        line for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line
    ]
    info["cpu_model"] = model[0].split(":", 1)[1].strip() if model else None
    return info


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--ring", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--copy", nargs="+", default=["torch", "torch1", "memmove", "pread"])
    parser.add_argument(
        "--busy", action="store_true", help="Also run each variant beside a busy launcher thread."
    )
    parser.add_argument("--skip-pack-only", action="store_true")
    parser.add_argument(
        "--beside",
        action="store_true",
        help="Only time chunked copies beside packing (see the module's docstring).",
    )
    parser.add_argument(
        "--pinning", nargs="+", choices=sorted(PINNING), default=["alloc"], help=str(PINNING)
    )
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    report: dict = {"machine": machine(), "torch": torch.__version__, "rates_gbps": {}}
    print(json.dumps(report["machine"]), flush=True)
    nbytes = int(args.gib * 2**30)
    directory = Path(os.environ.get("DLO_BENCH_DIR", tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        path = Path(scratch) / "blocks.bin"
        write_file(path, nbytes)
        source = torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)
        float(source[::4096].sum())  # fault every page in once, as a mapped checkpoint is

        device_buffer = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        rates = report["rates_gbps"]

        def record(name: str, rate: float) -> None:
            rates[name] = rate
            print(f"{name:<40} {rate:6.1f} GB/s", flush=True)

        record("pinned", pinned_rate(device_buffer, nbytes))
        if args.beside:
            beside_runs(source, device_buffer, args, record)
        streamed_copies = [] if args.beside else args.copy
        default_threads = torch.get_num_threads()
        fd = os.open(path, os.O_RDONLY)
        for kind in [] if args.skip_pack_only else streamed_copies:
            torch.set_num_threads(1 if kind == "torch1" else default_threads)
            for threads in args.threads:
                big = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
                small = torch.empty(threads * 4 * MIB, dtype=torch.uint8, pin_memory=True)
                copy = host_copy(kind, fd)
                record(f"pack-only {kind} {threads}t 1GiB", pack_only(source, big, threads, copy))
                record(
                    f"pack-only {kind} {threads}t 4MiB/t", pack_only(source, small, threads, copy)
                )
        for busy, pinning in itertools.product(
            (False, True) if args.busy else (False,), args.pinning
        ):
            suffix = (" +busy" if busy else "") + ("" if pinning == "alloc" else f" {pinning}")
            for kind in streamed_copies:
                torch.set_num_threads(1 if kind == "torch1" else default_threads)
                copy = host_copy(kind, fd)
                for threads in args.threads:
                    with busy_launcher(busy):
                        rate = blocks_rate(
                            source,
                            device_buffer,
                            block=640 * MIB,
                            threads=threads,
                            depth=3,
                            copy=copy,
                            pinning=pinning,
                        )
                    record(f"blocks {kind} 640MiB {threads}t 3buf{suffix}", rate)
                for chunk, ring, threads in itertools.product(
                    args.chunk_mib, args.ring, args.threads
                ):
                    with busy_launcher(busy):
                        rate = ring_rate(
                            source,
                            device_buffer,
                            chunk=chunk * MIB,
                            ring=ring,
                            threads=threads,
                            copy=copy,
                            pinning=pinning,
                        )
                    record(f"ring {kind} {chunk}MiB x{ring} {threads}t{suffix}", rate)
        os.close(fd)
        torch.cuda.synchronize()
        for arena in _arenas:
            arena.close()
        del source
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
