"""``dlo-worker serve`` on two GPUs: NCCL AllGather inside lockstep waves, gloo control.

Concurrent requests to a DP=2 engine must return the bytes a one-GPU resident
``generate`` writes for the same request, for the class-conditional DiT demo and for
the text-to-image Flux demo (prompts and sizes, raw and OpenAI routes), and SIGTERM
must drain and exit cleanly.
"""

from __future__ import annotations

import base64
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
DIT_REQUESTS = tuple({"seed": seed, "steps": 4} for seed in (3, 4, 5))
FLUX_REQUESTS = (
    {"prompt": "a red cat", "seed": 3, "steps": 4, "width": 128, "height": 128},
    {"prompt": "a blue dog", "seed": 4, "steps": 4, "width": 192, "height": 96},
    {"prompt": "a red cat", "seed": 5, "steps": 4},
)


def post(url: str, body: dict) -> bytes:
    """The PNG for ``body``; a body with ``size`` goes to the OpenAI route."""
    path = "/v1/images/generations" if "size" in body else "/v1/generate"
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        data = response.read()
    return base64.b64decode(json.loads(data)["data"][0]["b64_json"]) if "size" in body else data


def as_flags(body: dict) -> list[str]:
    """The ``generate`` flags of a request body."""
    return [item for name, value in body.items() for item in (f"--{name}", str(value))]


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kind", ["dit", "flux"])
def test_dp2_allgather_engine_serves_resident_bytes(
    kind: str, demo_model_dir: Path, flux_model_dir: Path, tmp_path: Path
) -> None:
    model, bodies = (
        (demo_model_dir, DIT_REQUESTS) if kind == "dit" else (flux_model_dir, FLUX_REQUESTS)
    )
    expected = []
    for index, body in enumerate(bodies):
        out = tmp_path / f"{index}.png"
        generate = ["generate", "--model", str(model), *as_flags(body), "--out", str(out)]
        subprocess.run(
            [sys.executable, "-m", "dlo_worker", *generate],
            env=ENV,
            check=True,
            capture_output=True,
            timeout=600,
        )
        expected.append(out.read_bytes())
    if kind == "flux":  # the first request again, through the OpenAI route
        first = dict(bodies[0])
        size = f"{first.pop('width')}x{first.pop('height')}"
        bodies = (*bodies, {**first, "size": size})
        expected.append(expected[0])

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    serve = ["serve", "--model", str(model), "--port", str(port), "--log-level", "info"]
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
        with ThreadPoolExecutor(len(bodies)) as pool:
            images = list(pool.map(lambda body: post(url, body), bodies))
        for body, image, reference in zip(bodies, images, expected, strict=True):
            assert image == reference, body
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=120)[0]
    # torchrun itself exits 1 on SIGTERM (SignalException) even when its ranks drained.
    assert output.count('msg="engine drained"') == 2, output
    assert output.count('msg="process groups destroyed"') == 2, output
