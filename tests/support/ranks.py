"""Ranks of a test's process group, started as processes of their own.

``torch.multiprocessing.spawn`` starts each rank as a new interpreter, which imports torch
and diffusers again (several seconds of the CPUs the suite shares, per rank, per test).
These ranks start from a fork server instead: one process per test worker that imported
them once and forks a rank on request, before any thread or tensor exists in it (so a
fork is as safe as a spawn). Each rank is still a process of its own, with its own gloo
group, memory and exit status: what the tests assert is unchanged.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOADED = ["torch", "torch.distributed", "diffusers", "dlo_worker.offload"]
"""What the fork server imports before it forks any rank (the costly imports the ranks'
functions share)."""


def spawn_ranks(function: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``function(rank, *args)`` in ``nprocs`` processes and wait for all of them; a
    rank that fails raises here, with its traceback (as ``mp.spawn`` does)."""
    multiprocessing.set_forkserver_preload(PRELOADED)  # read when the server first starts
    mp.start_processes(function, args=args, nprocs=nprocs, join=True, start_method="forkserver")
