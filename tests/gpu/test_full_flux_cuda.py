"""A full-size Flux pipeline (FLUX.1-dev's shapes, random bf16 weights written by
``dlo-worker demo-model --size full``) served by ``dlo-worker serve`` under a 24 GB and a
12 GB device budget: the plan streams what it must, 1024x1024 requests through the
OpenAI route answer 1024x1024 PNGs, the allocator's peak stays under the budget, and at
24 GB the copy-bound DiT's waits advise streaming T5 too.

The model is 31.6 GiB on disk; ``DLO_FULL_FLUX_DIR`` names one written before (the
benchmark's), otherwise it is written into the test's temporary directory.
"""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
import torch
from PIL import Image

from tests.support.ports import free_port

ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
GIB = 2**30
MODEL_DISK_GIB = 32
BUILD_DEVICE_GIB = 40


@pytest.fixture(scope="module")
def full_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    named = os.environ.get("DLO_FULL_FLUX_DIR")
    if named and (Path(named) / "model_index.json").is_file():
        return Path(named)
    target = Path(named) if named else tmp_path_factory.mktemp("full") / "flux-dev"
    free = shutil.disk_usage(target.parent if target.parent.exists() else tempfile.gettempdir())
    if free.free < MODEL_DISK_GIB * GIB:
        pytest.skip(f"writing the full-size model needs {MODEL_DISK_GIB} GiB of disk")
    if torch.cuda.get_device_properties(0).total_memory < BUILD_DEVICE_GIB * GIB:
        pytest.skip(f"drawing the full-size weights needs a {BUILD_DEVICE_GIB} GiB GPU")
    command = ["demo-model", str(target), "--kind", "flux", "--size", "full"]
    subprocess.run([sys.executable, "-m", "dlo_worker", *command], env=ENV, check=True)
    return target


def metric(text: str, name: str, label: str) -> float:
    found = re.search(rf'^{name}\{{kind="{label}"\}} ([0-9.e+-]+)$', text, re.MULTILINE)
    assert found is not None, f"{name}{{kind={label}}} missing from /metrics"
    return float(found.group(1))


@pytest.mark.parametrize(
    ("budget_gib", "streamed", "advised"),
    [(24, {"transformer"}, True), (12, {"transformer", "text_encoder_2"}, False)],
)
def test_full_size_flux_serves_within_the_budget(
    full_flux_dir: Path, tmp_path: Path, budget_gib: int, streamed: set[str], advised: bool
) -> None:
    """At 24 GiB the DiT's copies outlast its compute on an H100 or H200, so the second
    (steady) request advises streaming the resident T5 too; at 12 GiB it streams already."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "dlo_worker", "serve", "--model", str(full_flux_dir),
        "--device", "cuda", "--port", str(port), "--log-level", "info",
        "--max-gpu-memory-gib", str(budget_gib),
    ]  # fmt: skip
    with log_path.open("w") as log:
        server = subprocess.Popen(command, env=ENV, stderr=log)
        try:
            deadline = time.monotonic() + 900
            while not _ready(url):
                assert server.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "not ready in 15 minutes"
                time.sleep(1)
            body = {"prompt": "a red circle on a blue background", "size": "1024x1024"}
            response = requests.post(
                f"{url}/v1/images/generations", json={**body, "steps": 4, "seed": 1}, timeout=600
            )
            assert response.status_code == 200, response.text
            png = base64.b64decode(response.json()["data"][0]["b64_json"])
            assert Image.open(io.BytesIO(png)).size == (1024, 1024)
            steady = requests.post(
                f"{url}/v1/images/generations", json={**body, "steps": 4, "seed": 2}, timeout=600
            )
            assert steady.status_code == 200, steady.text
            metrics = requests.get(f"{url}/metrics", timeout=10).text
        finally:
            server.terminate()
            server.wait(timeout=120)
    assert server.returncode == 0, log_path.read_text()[-3000:]
    plan = next(line for line in log_path.read_text().splitlines() if "device memory plan" in line)
    placed = dict(re.findall(r"placement\.(\w+)=(\w+)", plan))
    assert {name for name, where in placed.items() if where == "streamed"} == streamed, plan
    assert metric(metrics, "dlo_device_memory_peak_bytes", "reserved") <= budget_gib * GIB
    advice = re.search(r'^dlo_streaming_advised\{component="text_encoder_2"\} 1\.0$', metrics, re.M)
    assert (advice is not None) == advised, log_path.read_text()[-3000:]


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/health/ready", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False
