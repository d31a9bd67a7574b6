"""How fast can host memory be registered with CUDA? File-backed vs anonymous, one GPU.

Registering a 23.7 GiB checkpoint mapping did not finish in 300 s on an H200 host
(docs/benchmarks.md), so this measures the registration rate itself, per variant, on
``--gib`` GiB (page cache warm):

- anonymous: private memory, default flags (what the pinned arena does);
- file, one call: a read-only shared mapping of a file, ``cudaHostRegisterReadOnly``;
- file, prefaulted: the same after ``MADV_POPULATE_READ`` maps every page first;
- file, chunks: 256 MiB ranges registered one after another, then by 8 threads;
- with ``--private``: a private (copy-on-write) mapping, as safetensors maps checkpoints;
  a long-term pin makes Linux unshare every page of it (measured: over 100 s for 1 GiB).

It also prints the device attributes that decide whether pageable memory goes through
host page tables. Run: ``python bench/host_registration.py --gib 1``.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dlo_worker.offload.feeds.cuda_registrar import HOST_REGISTER_READ_ONLY, loaded_cudart

CHUNK = 256 * 2**20
ATTRIBUTES = {
    "pageableMemoryAccess": 88,
    "pageableMemoryAccessUsesHostPageTables": 100,
    "hostRegisterSupported": 99,
    "hostRegisterReadOnlySupported": 113,
}
MADV_POPULATE_READ = 22


def timed_register(cudart: ctypes.CDLL, ranges: list[tuple[int, int]], flags: int, threads: int):
    """Seconds to register ``ranges`` (then unregistered, untimed); raises on an error."""

    def one(address_size: tuple[int, int]) -> int:
        return cudart.cudaHostRegister(
            ctypes.c_void_p(address_size[0]), ctypes.c_size_t(address_size[1]), flags
        )

    started = time.perf_counter()
    if threads == 1:
        statuses = [one(item) for item in ranges]
    else:
        with ThreadPoolExecutor(threads) as pool:
            statuses = list(pool.map(one, ranges))
    seconds = time.perf_counter() - started
    for (address, _), status in zip(ranges, statuses, strict=True):
        if status == 0:
            cudart.cudaHostUnregister(ctypes.c_void_p(address))
    if any(statuses):
        cudart.cudaGetLastError()
        raise RuntimeError(f"cudaHostRegister failed: {sorted(set(statuses))}")
    return seconds


def chunks(address: int, nbytes: int) -> list[tuple[int, int]]:
    return [(address + low, min(CHUNK, nbytes - low)) for low in range(0, nbytes, CHUNK)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument(
        "--private",
        action="store_true",
        help="Also register a MAP_PRIVATE mapping (slow: the kernel unshares every page).",
    )
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30) // mmap.PAGESIZE * mmap.PAGESIZE
    cudart = loaded_cudart()
    cudart.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cudart.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    for name, attribute in ATTRIBUTES.items():
        value = ctypes.c_int(-1)
        cudart.cudaDeviceGetAttribute(ctypes.byref(value), attribute, 0)
        print(f"{name}: {value.value}")
    results = {}
    anonymous = torch.ones(nbytes, dtype=torch.uint8)
    results["anonymous, one call"] = timed_register(cudart, [(anonymous.data_ptr(), nbytes)], 0, 1)
    del anonymous
    with tempfile.TemporaryDirectory(dir=os.environ.get("DLO_BENCH_DIR")) as root:
        path = Path(root) / "weights.bin"
        with path.open("wb") as handle:
            handle.write(os.urandom(nbytes))
        with path.open("rb") as handle:
            mapping = mmap.mmap(handle.fileno(), nbytes, access=mmap.ACCESS_READ)
        view = torch.frombuffer(mapping, dtype=torch.uint8)
        address = view.data_ptr()
        int(view.sum())  # page cache warm, page tables of this process filled
        flags = HOST_REGISTER_READ_ONLY
        results["file, one call"] = timed_register(cudart, [(address, nbytes)], flags, 1)
        try:
            mapping.madvise(MADV_POPULATE_READ)
        except OSError as error:  # kernels before 5.14
            print(f"MADV_POPULATE_READ unavailable: {error}")
        else:
            results["file, prefaulted"] = timed_register(cudart, [(address, nbytes)], flags, 1)
        results["file, 256 MiB chunks"] = timed_register(cudart, chunks(address, nbytes), flags, 1)
        results["file, chunks, 8 threads"] = timed_register(
            cudart, chunks(address, nbytes), flags, 8
        )
        del view
        mapping.close()
        if args.private:
            with path.open("rb") as handle:  # how safetensors maps a checkpoint
                private = mmap.mmap(handle.fileno(), nbytes, flags=mmap.MAP_PRIVATE)
            view = torch.frombuffer(private, dtype=torch.uint8)
            int(view.sum())
            address = view.data_ptr()
            results["file, MAP_PRIVATE"] = timed_register(cudart, [(address, nbytes)], flags, 1)
            del view
            private.close()
    for name, seconds in results.items():
        print(f"{name:28s} {seconds:8.3f} s  {nbytes / seconds / 1e9:8.2f} GB/s")


if __name__ == "__main__":
    main()
