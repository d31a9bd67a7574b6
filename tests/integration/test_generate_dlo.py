"""``dlo-worker generate`` with DLO writes the same bytes as resident, and shuts down in order.

The AllGather runs under torchrun with 2 gloo processes (DP=2): each DP rank draws
seed + rank, so its image must equal a resident run with that seed.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.generate import ENV, STEPS, digest, generate_command, run_generate
from tests.support.launch import rank_logs, torchrun_command


def run_single(model: Path, out: Path, seed: int, *flags: str) -> subprocess.CompletedProcess:
    result = run_generate(model, out, seed, *flags)
    assert result.returncode == 0, result.stderr
    return result


def torchrun(
    model: Path, out: Path, log_dir: Path, seed: int, *flags: str, steps: str = STEPS
) -> subprocess.Popen:
    command = generate_command(model, out, seed, *flags)
    command[command.index("--steps") + 1] = steps
    return subprocess.Popen(
        torchrun_command(command, log_dir),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def assert_disable_before_teardown(log: str) -> None:
    disabled = log.index('msg="dlo disabled"')
    destroyed = log.index('msg="process groups destroyed"')
    assert disabled < destroyed


@pytest.fixture(scope="module")
def resident_images(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("resident")
    images = {}
    for seed in (11, 12):
        run_single(demo_model_dir, out / f"{seed}.png", seed)
        images[seed] = digest(out / f"{seed}.png")
    return images


def test_rank_local_dlo_writes_the_resident_bytes(
    demo_model_dir: Path, tmp_path: Path, resident_images: dict
) -> None:
    out = tmp_path / "dlo.png"
    result = run_single(
        demo_model_dir, out, 11, "--enable-distributed-layerwise-offload", "--dlo-no-use-allgather"
    )
    assert digest(out) == resident_images[11]
    assert 'msg="dlo enabled"' in result.stderr
    assert "transfer_mode=rank-local" in result.stderr


def test_resident_layers_write_the_resident_bytes(
    demo_model_dir: Path, tmp_path: Path, resident_images: dict
) -> None:
    out = tmp_path / "dlo.png"
    run_single(
        demo_model_dir,
        out,
        11,
        "--enable-distributed-layerwise-offload",
        "--dlo-no-use-allgather",
        "--dlo-resident-layers",
        "3",
    )
    assert digest(out) == resident_images[11]


def test_allgather_under_torchrun_writes_each_ranks_resident_bytes(
    demo_model_dir: Path, tmp_path: Path, resident_images: dict
) -> None:
    out = tmp_path / "dp.png"
    process = torchrun(
        demo_model_dir,
        out,
        tmp_path / "logs",
        11,
        "--enable-distributed-layerwise-offload",
        "--data-parallel-size",
        "2",
    )
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    assert digest(out) == resident_images[11]
    assert digest(tmp_path / "dp.dp1.png") == resident_images[12]
    logs = rank_logs(tmp_path / "logs")
    assert sorted(logs) == [0, 1]
    for log in logs.values():
        assert "transfer_mode=allgather host_backing=checkpoint-mmap shards=2" in log
        assert_disable_before_teardown(log)


def test_sigterm_disables_dlo_before_destroying_process_groups(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    log_dir = tmp_path / "logs"
    process = torchrun(
        demo_model_dir,
        tmp_path / "never.png",
        log_dir,
        0,
        "--enable-distributed-layerwise-offload",
        "--data-parallel-size",
        "2",
        steps="1000",
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        logs = rank_logs(log_dir)
        if len(logs) == 2 and all('msg="dlo enabled"' in log for log in logs.values()):
            break
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.5)
    time.sleep(2)  # well inside the denoising loop
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0, output
    assert not (tmp_path / "never.png").exists()
    logs = rank_logs(log_dir)
    assert sorted(logs) == [0, 1]
    for log in logs.values():
        assert_disable_before_teardown(log)


def test_blocks_dlo_cannot_find_exit_2_before_weights_load(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """Discovery runs on the meta model: a wrong --dlo-block-paths is one line, exit 2."""
    out = tmp_path / "never.png"
    result = run_generate(
        demo_model_dir,
        out,
        0,
        "--enable-distributed-layerwise-offload",
        "--dlo-no-use-allgather",
        "--dlo-block-paths",
        "pos_embed",
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "pos_embed" in result.stderr
    assert "--dlo-block-paths" in result.stderr
    assert not out.exists()
