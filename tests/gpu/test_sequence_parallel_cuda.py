"""Sequence parallelism (Ulysses) with DLO on two GPUs over NCCL: bf16 tiny Flux and Wan,
and ``dlo-worker generate`` on the Flux demo, bitwise equal to the same SP run without DLO.

Run on the accelerator machine (nvidia-h200-x2): ``pytest tests/gpu``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlo_worker.config import ParallelOptions
from dlo_worker.offload import enable_dlo
from dlo_worker.pipeline import sequence_parallel
from tests.support.generate import ENV, digest
from tests.support.tiny_models import tiny_flux, tiny_wan

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
BUILDERS = {"flux": tiny_flux, "wan": tiny_wan}


def _forward(name: str, device: torch.device, **dlo) -> torch.Tensor:
    case = BUILDERS[name](0)
    case.model.to(torch.bfloat16)
    if not dlo:
        case.model.to(device)
    inputs = {
        key: value.to(device, torch.bfloat16) if value.is_floating_point() else value.to(device)
        for key, value in case.inputs.items()
    }
    backend = enable_dlo(case.model, device=device, **dlo) if dlo else None
    sequence_parallel.apply(
        SimpleNamespace(components={"transformer": case.model}),
        ParallelOptions(sequence_parallel_size=2),
        device,
        ("transformer",),
    )
    try:
        with torch.inference_mode():
            return [case.model(**inputs, return_dict=False)[0] for _ in range(2)][-1].cpu()
    finally:
        if backend is not None:
            backend.disable()


def _rank(rank: int, store: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=2, device_id=device
    )
    try:
        for name in BUILDERS:
            expected = _forward(name, device)
            rank_local = _forward(name, device, use_allgather=False)
            allgather = _forward(name, device, use_allgather=True, process_group=dist.group.WORLD)
            assert torch.equal(rank_local, expected), name
            assert torch.equal(allgather, expected), name
    finally:
        dist.destroy_process_group()


def test_sp_with_dlo_over_nccl_is_bitwise_equal_to_sp_without_dlo(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def _generate(model: Path, out: Path, *flags: str) -> str:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "dlo_worker",
        "generate",
        "--model",
        str(model),
        "--prompt",
        "a red fox",
        "--width",
        "128",
        "--height",
        "128",
        "--steps",
        "4",
        "--seed",
        "7",
        "--sequence-parallel-size",
        "2",
        "--log-level",
        "info",
        "--out",
        str(out),
        *flags,
    ]
    result = subprocess.run(
        command, env=ENV, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_generate_with_sp_on_two_gpus_writes_the_same_bytes_with_and_without_dlo(
    flux_model_dir: Path, tmp_path: Path
) -> None:
    _generate(flux_model_dir, tmp_path / "sp.png")
    output = _generate(
        flux_model_dir, tmp_path / "dlo.png", "--enable-distributed-layerwise-offload"
    )
    assert digest(tmp_path / "dlo.png") == digest(tmp_path / "sp.png")
    assert output.count("transfer_mode=allgather") == 2, output
