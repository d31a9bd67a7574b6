"""Run ``dlo-worker generate`` on the CPU as a user would, and compare images by digest."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.support.in_process import CliRun, run_dlo_worker

STEPS = "4"
# One thread everywhere: torchrun's default, and a fixed reduction order for the CPU kernels.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def generate_command(model: Path, out: Path, seed: int, *flags: str) -> list[str]:
    """The ``generate`` arguments (without the interpreter), logging at info."""
    return [
        "generate",
        "--model",
        str(model),
        "--steps",
        STEPS,
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--log-level",
        "info",
        *flags,
    ]


def generate_argv(model: Path, out: Path, seed: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "dlo_worker", *generate_command(model, out, seed, *flags)]


def run_generate_process(
    model: Path, out: Path, seed: int, *flags: str
) -> subprocess.CompletedProcess[str]:
    """``dlo-worker generate`` in a process of its own, for what only a new process shows
    (a restart that must find its compiled graphs on disk, not in memory)."""
    return subprocess.run(
        generate_argv(model, out, seed, *flags),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def run_generate(model: Path, out: Path, seed: int, *flags: str) -> CliRun:
    """``dlo-worker generate`` in this process (:mod:`tests.support.in_process`), its
    output captured, whatever it exits with."""
    return run_dlo_worker(generate_command(model, out, seed, *flags))


def refused_generate(model: Path, out: Path, *flags: str) -> str:
    """Run ``generate`` that must be refused: exit 2, no traceback, no image; its stderr."""
    result = run_generate(model, out, 0, *flags)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
    return result.stderr


DEMO_REQUEST = {"seed": 0, "steps": 4, "class_label": 207}
"""One request to the demo model, as JSON for ``/v1/generate`` (see :func:`demo_flags`)."""


def demo_flags() -> list[str]:
    """:data:`DEMO_REQUEST` as ``dlo-worker generate`` flags, on the CPU."""
    flags = ["--device", "cpu"]
    for key, value in DEMO_REQUEST.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def host_generate(model: Path, out: Path, *flags: str) -> bytes:
    """``dlo-worker generate`` of :data:`DEMO_REQUEST` (and ``flags``) on the host, run as a
    user runs it: the installed command, default threads (as in a container), no test
    paths. Returns the PNG bytes that images, Pods and Services must reproduce."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run(
        ["dlo-worker", "generate", "--model", str(model), *demo_flags(), *flags, "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
        env={**env, "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stderr
    return out.read_bytes()


class HostReference:
    """The demo model as ``dlo-worker demo-model DIR`` writes it (its defaults: the trained
    tiny DiT), and the PNG bytes ``dlo-worker generate`` writes from it on the host for the
    demo request (:func:`host_generate`): what every image, Pod and Service of the
    real-node tier must reproduce."""

    def __init__(self, directory: Path) -> None:
        self.model = directory / "model"
        written = run_dlo_worker(["demo-model", str(self.model)])
        assert written.returncode == 0, written.stderr
        self._made: dict[tuple[str, ...], bytes] = {}

    def png(self, *flags: str) -> bytes:
        """The host's bytes with ``flags``, generated once per set of flags (a compiled
        run compiles for a minute)."""
        if flags not in self._made:
            out = self.model.parent / f"{len(self._made)}.png"
            self._made[flags] = host_generate(self.model, out, *flags)
        return self._made[flags]
