"""Can a mapping be registered a few blocks at a time, as it streams? One GPU.

Registering a whole checkpoint mapping (``runtimeCache.pinLimitGiB``) copies at 1.00x
private pinned, but pins the model's size of host memory; the staging ring pins only
96 MiB but moves every byte through the CPU, and that costs 1.05-2.4x depending on the
host (docs/benchmarks.md). This probe measures the middle way: register each block's
pages just before its copy and unregister them once the copy has finished, so only a
window of blocks is pinned at any time and no CPU touches the bytes.

On ``--gib`` GiB of a read-only shared file mapping (page cache warm), split into
``--block-mib`` blocks, it reports:

- the cost of ``cudaHostRegister`` and ``cudaHostUnregister`` per block, alone;
- copies of every block to the device from one pinned buffer (the bound) and through the
  window (a registrar thread runs ``--ahead`` blocks ahead of the copies, a releaser
  unregisters each block once its copy's event has passed), each alone, beside a chain of
  matrix multiplications on the compute stream (does a call stall the device?), and
  beside ``--hammer-threads`` CPU threads copying host memory (a busy host).

Run: ``python bench/windowed_registration.py --gib 8 --block-mib 384``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from dlo_worker.offload.feeds.cuda_registrar import HOST_REGISTER_READ_ONLY, loaded_cudart


def make_file(path: Path, nbytes: int) -> None:
    """``nbytes`` of random bytes (one random 64 MiB pattern repeated: content is irrelevant)."""
    pattern = os.urandom(64 * 2**20)
    with path.open("wb") as handle:
        for low in range(0, nbytes, len(pattern)):
            handle.write(pattern[: min(len(pattern), nbytes - low)])


class Cudart:
    def __init__(self) -> None:
        self.lib = loaded_cudart()
        self.lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]

    def register(self, address: int, nbytes: int) -> None:
        status = self.lib.cudaHostRegister(address, nbytes, HOST_REGISTER_READ_ONLY)
        if status:
            self.lib.cudaGetLastError()
            raise RuntimeError(f"cudaHostRegister failed: {status}")

    def unregister(self, address: int) -> None:
        status = self.lib.cudaHostUnregister(address)
        if status:
            self.lib.cudaGetLastError()
            raise RuntimeError(f"cudaHostUnregister failed: {status}")


def call_costs(cudart: Cudart, blocks: list[torch.Tensor]) -> dict[str, float]:
    registers, unregisters = [], []
    for block in blocks:
        started = time.perf_counter()
        cudart.register(block.data_ptr(), block.nbytes)
        registers.append(time.perf_counter() - started)
        started = time.perf_counter()
        cudart.unregister(block.data_ptr())
        unregisters.append(time.perf_counter() - started)
    nbytes = blocks[0].nbytes
    return {
        "register_gbps": nbytes / statistics.median(registers) / 1e9,
        "unregister_gbps": nbytes / statistics.median(unregisters) / 1e9,
        "register_ms_max": max(registers) * 1e3,
        "unregister_ms_max": max(unregisters) * 1e3,
    }


def copy_pinned(slots: list[torch.Tensor], pinned: torch.Tensor, count: int) -> None:
    for index in range(count):
        slots[index % 2].copy_(pinned, non_blocking=True)


def copy_windowed(
    cudart: Cudart, slots: list[torch.Tensor], blocks: list[torch.Tensor], count: int, ahead: int
) -> dict[str, float]:
    """Copies ``count`` blocks (cycling through ``blocks``) on the current stream, each
    registered by a registrar thread at most ``ahead`` blocks before its copy and
    unregistered by a releaser once its copy's event has passed."""
    registered: queue.Queue[int] = queue.Queue()
    released: queue.Queue[tuple[int, torch.cuda.Event] | None] = queue.Queue()
    window = threading.Semaphore(ahead)
    waits = {"copy_waits_s": 0.0}

    def registrar() -> None:
        for index in range(count):
            window.acquire()
            block = blocks[index % len(blocks)]
            cudart.register(block.data_ptr(), block.nbytes)
            registered.put(index)

    def releaser() -> None:
        while (item := released.get()) is not None:
            index, event = item
            event.synchronize()
            cudart.unregister(blocks[index % len(blocks)].data_ptr())
            window.release()

    threads = [threading.Thread(target=registrar), threading.Thread(target=releaser)]
    for thread in threads:
        thread.start()
    for index in range(count):
        started = time.perf_counter()
        assert registered.get() == index
        waits["copy_waits_s"] += time.perf_counter() - started
        slots[index % 2].copy_(blocks[index % len(blocks)], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        released.put((index, event))
    released.put(None)
    for thread in threads:
        thread.join()
    return waits


@contextmanager
def hammering(threads: int) -> Iterator[None]:
    """``threads`` CPU threads copying 256 MiB buffers of host memory back and forth."""
    if threads == 0:
        yield
        return
    stop = threading.Event()

    def hammer() -> None:
        source = torch.ones(256 * 2**20, dtype=torch.uint8)
        target = torch.empty_like(source)
        while not stop.is_set():
            target.copy_(source)

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(0.2)
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        torch.set_num_threads(previous)


class CopyRuns:
    """Copies of ``copies`` blocks on a copy stream, timed, optionally beside a chain of
    matrix multiplications (sized to the pinned copies' duration) and a busy host."""

    def __init__(self, block_bytes: int, copies: int, repeats: int) -> None:
        device = torch.device("cuda")
        self.slots = [torch.empty(block_bytes, dtype=torch.uint8, device=device) for _ in "ab"]
        self.pinned = torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream()
        self.lhs = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        self.copies, self.copied, self.repeats = copies, copies * block_bytes, repeats
        self.compute_seconds(20)
        per_matmul = self.compute_seconds(20) / 20
        started = time.perf_counter()
        with torch.cuda.stream(self.stream):
            copy_pinned(self.slots, self.pinned, copies)
        torch.cuda.synchronize()
        self.matmuls = max(1, round((time.perf_counter() - started) / per_matmul))
        self.compute_alone = self.compute_seconds(self.matmuls)

    def compute(self, matmuls: int) -> None:
        for _ in range(matmuls):
            torch.mm(self.lhs, self.lhs)

    def compute_seconds(self, matmuls: int) -> float:
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.compute(matmuls)
        done.record()
        done.synchronize()
        return start.elapsed_time(done) / 1e3

    def measure(
        self, copy: Callable[[], dict[str, float] | None], with_compute: bool, hammer: int
    ) -> list[dict[str, float]]:
        rows = []
        for _ in range(self.repeats):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            compute_start, compute_done, copy_start, copy_done = events
            with hammering(hammer):
                torch.cuda.synchronize()
                if with_compute:
                    compute_start.record()
                    self.compute(self.matmuls)
                    compute_done.record()
                started = time.perf_counter()
                with torch.cuda.stream(self.stream):
                    copy_start.record()
                    extra = copy() or {}
                    copy_done.record()
                torch.cuda.synchronize()
                wall = time.perf_counter() - started
            row = {
                "copy_gbps": self.copied / (copy_start.elapsed_time(copy_done) / 1e3) / 1e9,
                "wall_gbps": self.copied / wall / 1e9,
                **extra,
            }
            if with_compute:
                beside = compute_start.elapsed_time(compute_done) / 1e3
                row["compute_slowdown"] = beside / self.compute_alone
            rows.append(row)
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--block-mib", type=int, default=384)
    parser.add_argument("--ahead", type=int, nargs="+", default=[2, 3])
    parser.add_argument(
        "--passes", type=int, default=3, help="Times each copy run cycles the file."
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hammer-threads", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    block_bytes = args.block_mib * 2**20
    count = int(args.gib * 2**30) // block_bytes
    cudart = Cudart()
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "cpus": len(os.sched_getaffinity(0)),
        "block_mib": args.block_mib,
        "blocks": count,
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("DLO_BENCH_DIR")) as root:
        path = Path(root) / "weights.bin"
        make_file(path, count * block_bytes)
        with path.open("rb") as handle:
            mapping = mmap.mmap(handle.fileno(), count * block_bytes, access=mmap.ACCESS_READ)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        int(whole[:: mmap.PAGESIZE].sum())  # page cache warm, page tables filled
        blocks = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]
        results["calls"] = call_costs(cudart, blocks)
        print("calls", results["calls"])
        runs = CopyRuns(block_bytes, count * args.passes, args.repeats)
        runs.pinned.copy_(blocks[0])
        copies: dict[str, Callable[[], dict[str, float] | None]] = {
            "pinned": lambda: copy_pinned(runs.slots, runs.pinned, runs.copies)
        }
        for ahead in args.ahead:
            copies[f"windowed ahead={ahead}"] = partial(
                copy_windowed, cudart, runs.slots, blocks, runs.copies, ahead
            )
        for hammer in (0, args.hammer_threads):
            for with_compute in (False, True):
                for name, copy in copies.items():
                    label = name + ("+compute" if with_compute else "")
                    label += f"+hammer{hammer}" if hammer else ""
                    rows = runs.measure(copy, with_compute, hammer)
                    results[label] = rows
                    summary = {key: [round(row[key], 3) for row in rows] for key in rows[0]}
                    print(f"{label:40s} {summary}")
        blocks.clear()
        del whole
        mapping.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
