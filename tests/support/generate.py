"""Run ``dlo-worker generate`` on the CPU as a user would, and compare images by digest."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

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
