"""Streamed text encoders and ``--max-gpu-memory-gib`` on a CUDA device: the Flux demo with
its DiT and T5 streamed writes the resident image bitwise, also within a budget (its peak
under it); the allocator is capped at the budget (going over is an out-of-memory error),
and a budget larger than the GPU is refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from dlo_worker.loader.component_bytes import component_bytes
from dlo_worker.loader.device_plan import GIB
from tests.support.generate import digest

ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
REQUEST = ["--prompt", "a red cat", "--seed", "3", "--steps", "4"]


def run(model: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    command = ["generate", "--model", str(model), "--out", str(out), "--device", "cuda"]
    return subprocess.run(
        [sys.executable, "-m", "dlo_worker", *command, "--log-level", "info", *REQUEST, *flags],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def field(stderr: str, message: str, name: str) -> str:
    line = next(line for line in stderr.splitlines() if f'msg="{message}"' in line)
    found = re.search(rf"\b{re.escape(name)}=(\S+)", line)
    assert found is not None, line
    return found.group(1)


def test_t5_streamed_with_the_dit_draws_the_resident_image(
    flux_model_dir: Path, tmp_path: Path
) -> None:
    resident = run(flux_model_dir, tmp_path / "resident.png")
    assert resident.returncode == 0, resident.stderr[-3000:]
    sizes = component_bytes(flux_model_dir, torch.bfloat16, dits=("transformer",))
    blocks = sum(len(c.blocks) for c in sizes if c.name in ("transformer", "text_encoder_2"))
    dlo = ["--enable-distributed-layerwise-offload", "--dlo-stream-text-encoders", "text_encoder_2"]
    streamed = run(flux_model_dir, tmp_path / "streamed.png", *dlo)
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    assert field(streamed.stderr, "dlo enabled", "streamed_blocks") == str(blocks)
    assert digest(tmp_path / "streamed.png") == digest(tmp_path / "resident.png")
    # Within a budget the demo's blocks all fit beside the slots: planned as streamed
    # components, every block resident, the peak under the budget.
    budgeted = run(flux_model_dir, tmp_path / "budgeted.png", *dlo, "--max-gpu-memory-gib", "1")
    assert budgeted.returncode == 0, budgeted.stderr[-3000:]
    assert field(budgeted.stderr, "device memory plan", "placement.text_encoder_2") == "streamed"
    assert field(budgeted.stderr, "device memory plan", "placement.transformer") == "streamed"
    assert field(budgeted.stderr, "dlo enabled", "resident_blocks") == str(blocks)
    assert float(field(budgeted.stderr, "device memory", "peak_reserved_gib")) <= 1
    assert digest(tmp_path / "budgeted.png") == digest(tmp_path / "resident.png")


def test_the_allocator_is_capped_at_the_budget_and_a_larger_one_is_refused(
    flux_model_dir: Path, tmp_path: Path
) -> None:
    probe = (
        "import torch\n"
        "from dlo_worker.process.device_budget import cap_device_memory\n"
        "device = torch.device('cuda')\n"
        "cap_device_memory(device, 1.0)\n"
        "kept = torch.empty(2**29, dtype=torch.uint8, device=device)\n"
        "try:\n"
        "    torch.empty(2**30, dtype=torch.uint8, device=device)\n"
        "except torch.OutOfMemoryError:\n"
        "    print('capped')\n"
    )
    capped = subprocess.run(
        [sys.executable, "-c", probe], env=ENV, capture_output=True, text=True, check=False
    )
    assert capped.returncode == 0, capped.stderr[-3000:]
    assert capped.stdout.strip() == "capped"
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    refused = run(flux_model_dir, tmp_path / "x.png", "--max-gpu-memory-gib", f"{total + 8:.0f}")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "is more than cuda" in refused.stderr
    assert "lower it, or leave it unset" in refused.stderr
    assert not (tmp_path / "x.png").exists()
