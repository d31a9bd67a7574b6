"""``dlo-worker serve`` on two GPUs: NCCL AllGather inside lockstep waves, gloo control.

Concurrent requests to a DP=2 engine must return the bytes a one-GPU resident
``generate`` writes for the same seed, and SIGTERM must drain and exit cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.support.ports import free_port

ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
SEEDS = (3, 4, 5)


def post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(
        f"{url}/v1/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return response.read()


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_dp2_allgather_engine_serves_resident_bytes(demo_model_dir: Path, tmp_path: Path) -> None:
    expected = {}
    for seed in SEEDS:
        out = tmp_path / f"{seed}.png"
        generate = ["generate", "--model", str(demo_model_dir), "--steps", "4"]
        subprocess.run(
            [sys.executable, "-m", "dlo_worker", *generate, "--seed", str(seed), "--out", str(out)],
            env=ENV,
            check=True,
            capture_output=True,
            timeout=600,
        )
        expected[seed] = out.read_bytes()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    serve = ["serve", "--model", str(demo_model_dir), "--port", str(port), "--log-level", "info"]
    server = subprocess.Popen(
        [
            *launcher,
            "--nproc-per-node",
            "2",
            "-m",
            "dlo_worker",
            *serve,
            "--enable-distributed-layerwise-offload",
            "--data-parallel-size",
            "2",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not ready(url):
            assert server.poll() is None, server.communicate()[0]
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.5)
        with ThreadPoolExecutor(len(SEEDS)) as pool:
            images = list(pool.map(lambda seed: post(url, {"seed": seed, "steps": 4}), SEEDS))
        for seed, image in zip(SEEDS, images, strict=True):
            assert image == expected[seed], seed
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=120)[0]
    # torchrun itself exits 1 on SIGTERM (SignalException) even when its ranks drained.
    assert output.count('msg="engine drained"') == 2, output
    assert output.count('msg="process groups destroyed"') == 2, output
