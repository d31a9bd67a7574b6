"""An installation without the native staging ring (``pip install`` where no C compiler
is present: the package's Python files, no ``_staging_ring`` library) still serves mapped
blocks, through block buffers: one warning says why, the configuration and the start-up
line say ``buffers``, a start that asks for the ring is refused, and the image is the
same bytes as the ring's and the resident worker's.

The installation is real: the package's files copied without the library, first on the
interpreter's path (the test environment's editable install is consulted after it)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import dlo_worker
from dlo_worker.offload import setup as offload_setup
from tests.support.checkpoints import run_worker, worker_config
from tests.support.generate import ENV, digest, generate_argv, generate_command

DLO = ("--enable-distributed-layerwise-offload", "--dlo-no-use-allgather")
WARNING = "staging through block buffers"


@pytest.fixture(scope="module")
def without_ring(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of an installation whose ring was not built."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(
        Path(dlo_worker.__file__).parent,
        site / "dlo_worker",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_without_the_ring_mapped_blocks_go_through_block_buffers(
    demo_model_dir: Path, without_ring: dict[str, str], tmp_path: Path
) -> None:
    locate = "import dlo_worker; print(dlo_worker.__file__)"
    located = run([sys.executable, "-c", locate], without_ring)
    assert located.stdout.startswith(without_ring["PYTHONPATH"].split(os.pathsep)[0])

    config = run([sys.executable, "-m", "dlo_worker", "config", *DLO], without_ring)
    assert config.returncode == 0, config.stderr
    assert json.loads(config.stdout)["effective"]["dlo_staging"] == "buffers"

    fallback = run(generate_argv(demo_model_dir, tmp_path / "buffers.png", 0, *DLO), without_ring)
    assert fallback.returncode == 0, fallback.stderr
    warnings = [line for line in fallback.stderr.splitlines() if WARNING in line]
    assert len(warnings) == 1, fallback.stderr
    assert "not built" in warnings[0]
    assert "install gcc" in warnings[0]
    assert "host_backing=checkpoint-mmap" in fallback.stderr
    assert "staging=buffers staging_reason=not-built" in fallback.stderr

    ring = run(generate_argv(demo_model_dir, tmp_path / "ring.png", 0, *DLO), ENV)
    assert ring.returncode == 0, ring.stderr
    assert "staging=ring staging_reason=default" in ring.stderr
    assert WARNING not in ring.stderr
    resident = run(generate_argv(demo_model_dir, tmp_path / "resident.png", 0), ENV)
    assert resident.returncode == 0, resident.stderr
    assert digest(tmp_path / "buffers.png") == digest(tmp_path / "ring.png")
    assert digest(tmp_path / "ring.png") == digest(tmp_path / "resident.png")


def test_asking_for_the_ring_where_it_was_not_built_is_refused_before_loading(
    demo_model_dir: Path, without_ring: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "image.png"
    argv = [
        sys.executable,
        "-m",
        "dlo_worker",
        *generate_command(demo_model_dir, out, 0, *DLO, "--dlo-staging", "ring"),
    ]
    refused = run(argv, without_ring)
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr
    assert "--dlo-staging ring: the native staging ring was not built" in refused.stderr
    assert "checkpoint" not in refused.stderr  # refused before the model was read
    assert not out.exists()


def test_the_fallback_is_counted_and_warned_once_per_start(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The metric, in this process (the ``generate`` command serves none)."""
    monkeypatch.setattr(offload_setup, "staging_ring_library", lambda: None)
    labels = {"staging": "buffers", "reason": "not-built"}
    before = REGISTRY.get_sample_value("dlo_staging_starts_total", labels) or 0
    with caplog.at_level(logging.WARNING):
        _, worker = run_worker(worker_config(demo_model_dir, dlo=True))
    assert (worker.stats.staging, worker.stats.staging_reason) == ("buffers", "not-built")
    assert REGISTRY.get_sample_value("dlo_staging_starts_total", labels) == before + 1
    assert [record.message for record in caplog.records].count(WARNING) == 1
