"""A whole pipeline served end to end, per placement: seconds per image split by stage,
peak device memory, host memory and time to ready.

Each row starts ``dlo-worker serve`` on the directory with the row's flags in a process
of its own (so budgets and peaks do not leak between rows), times process start to
``/health/ready`` (``--cold`` first evicts the directory's files from the page cache with
``posix_fadvise``, no root needed), then sends ``--requests`` OpenAI image requests one
after another; the first warms up and is left out. Each request's split comes from the
server's ``/metrics`` (``dlo_request_stage_seconds`` sums before and after it): text
encoding, denoising, VAE decode, PNG, and HTTP as the client's time less the stages.
Peaks: ``dlo_device_memory_peak_bytes`` and the server process's ``VmHWM``.

Rows: ``resident`` (no flags), ``budget:<GiB>`` (``--max-gpu-memory-gib``), and
diffusers' own modes at a budget, ``cpu-offload:<GiB>`` (``--enable-cpu-offload``) and
``group-offload:<GiB>`` (``--enable-layerwise-offload``), the budget capping the allocator.

    dlo-worker demo-model /data/flux-dev --kind flux --size full
    python bench/flux_pipeline.py --model /data/flux-dev \\
        --rows resident budget:24 budget:12 cpu-offload:24 group-offload:24 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

GIB = 2**30


class RowFailedError(Exception):
    """A row that could not serve (e.g. out of memory at its budget): reported, not fatal."""


MODES = {
    "resident": [],
    "budget": [],
    "cpu-offload": ["--enable-cpu-offload"],
    "group-offload": ["--enable-layerwise-offload"],
}
STAGES = ("text_encoding", "denoising", "decode", "png")


def row_flags(row: str) -> list[str]:
    mode, _, budget = row.partition(":")
    if mode not in MODES or (mode == "resident") != (budget == ""):
        raise SystemExit(
            f"unknown row {row!r}: resident, budget:GIB, cpu-offload:GIB, group-offload:GIB"
        )
    return MODES[mode] + (["--max-gpu-memory-gib", budget] if budget else [])


def evict_page_cache(model: Path) -> None:
    for path in model.rglob("*"):
        if path.is_file():
            with path.open("rb") as stream:
                os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def metric_values(text: str, name: str) -> dict[str, float]:
    """``name``'s samples by their one label's value (``""`` without labels)."""
    found = re.findall(rf'^{name}(?:\{{\w+="([^"]*)"\}})? ([0-9.e+-]+)$', text, re.MULTILINE)
    return {label: float(value) for label, value in found}


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def measure(args: argparse.Namespace, row: str) -> dict:
    if args.cold:
        evict_page_cache(args.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "dlo_worker", "serve", "--model", str(args.model),
        "--port", str(port), "--device", args.device, *row_flags(row), *args.worker_flags,
    ]  # fmt: skip
    started = time.perf_counter()
    # A file, not a pipe: a pipe nobody reads would fill and stall the server.
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed with the server below
    server = subprocess.Popen(command, stderr=log, text=True)
    try:
        while True:
            if server.poll() is not None:
                log.seek(0)
                raise RowFailedError(f"the server exited {server.returncode}: {log.read()[-1500:]}")
            try:
                if requests.get(f"{url}/health/ready", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        ready_s = time.perf_counter() - started
        body = {"prompt": args.prompt, "size": f"{args.size}x{args.size}", "steps": args.steps}
        requests_s, splits = [], []
        for index in range(args.requests):
            before = metric_values(
                requests.get(f"{url}/metrics", timeout=5).text, "dlo_request_stage_seconds_sum"
            )
            sent = time.perf_counter()
            response = requests.post(
                f"{url}/v1/images/generations", json={**body, "seed": index}, timeout=3600
            )
            elapsed = time.perf_counter() - sent
            if response.status_code != 200:
                log.seek(0)
                raise RowFailedError(
                    f"request {index} answered {response.status_code}: {response.text[:500]} "
                    f"{log.read()[-1500:]}"
                )
            metrics = requests.get(f"{url}/metrics", timeout=5).text
            after = metric_values(metrics, "dlo_request_stage_seconds_sum")
            split = {stage: after.get(stage, 0.0) - before.get(stage, 0.0) for stage in STAGES}
            split["http"] = elapsed - sum(split.values())
            if index > 0:  # the first request warms up
                requests_s.append(elapsed)
                splits.append(split)
        peaks = metric_values(metrics, "dlo_device_memory_peak_bytes")
        status = Path(f"/proc/{server.pid}/status").read_text()
        host_peak = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()
    median = statistics.median(requests_s)
    return {
        "row": row,
        "cold": args.cold,
        "worker_flags": args.worker_flags,
        "ready_s": round(ready_s, 2),
        "seconds_per_image": round(median, 3),
        "spread_s": [round(min(requests_s), 3), round(max(requests_s), 3)],
        "split_s": {
            stage: round(statistics.median(split[stage] for split in splits), 3)
            for stage in (*STAGES, "http")
        },
        "device_peak_allocated_gib": round(peaks.get("allocated", 0.0) / GIB, 2),
        "device_peak_reserved_gib": round(peaks.get("reserved", 0.0) / GIB, 2),
        "host_peak_rss_gib": round(host_peak / GIB, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", nargs="+", default=["resident", "budget:24", "budget:12"])
    parser.add_argument("--requests", type=int, default=4, help="Per row, the first warming up.")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--prompt", default="a red circle on a blue background")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--cold", action="store_true", help="Evict the model from the page cache first."
    )
    parser.add_argument(
        "--worker-flags", nargs=argparse.REMAINDER, default=[], help="Passed to every row's serve."
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2: the first warms up")
    report = []
    for row in args.rows:
        try:
            measured = measure(args, row)
        except RowFailedError as failed:
            failure = {"row": row, "worker_flags": args.worker_flags, "failed": str(failed)}
            print(json.dumps(failure), flush=True)
            report.append(failure)
            continue
        budget = row.partition(":")[2]
        if budget and measured["device_peak_reserved_gib"] > float(budget):
            measured["over_budget"] = True
        print(json.dumps(measured), flush=True)
        report.append(measured)
    resident = next((r for r in report if r["row"] == "resident" and "failed" not in r), None)
    if resident is not None:
        for measured in (r for r in report if "failed" not in r):
            ratio = measured["seconds_per_image"] / resident["seconds_per_image"]
            print(
                f"{measured['row']}: {measured['seconds_per_image']} s/image, {ratio:.3f}x resident"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
