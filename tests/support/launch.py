"""Starting worker ranks the way torchrun does: its command line, its environment, its logs."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def torchrun_arguments(arguments: list[str], processes: int = 2) -> list[str]:
    """torchrun's arguments for ``dlo-worker <arguments>`` as ``processes`` local ranks."""
    return ["--standalone", "--nproc-per-node", str(processes), "-m", "dlo_worker", *arguments]


def torchrun_command(arguments: list[str], log_dir: Path, processes: int = 2) -> list[str]:
    """``dlo-worker <arguments>`` as ``processes`` torchrun ranks logging under ``log_dir``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--log-dir",
        str(log_dir),
        "--redirects",
        "3",
        *torchrun_arguments(arguments, processes),
    ]


def launch_command(arguments: list[str], processes: int = 2) -> list[str]:
    """``dlo-worker <arguments>`` as ``processes`` ranks under ``dlo-worker launch``, the
    command a worker Pod runs."""
    return [
        sys.executable,
        "-m",
        "dlo_worker",
        "launch",
        "--",
        *torchrun_arguments(arguments, processes),
    ]


def rank_logs(log_dir: Path) -> dict[int, str]:
    """Each rank's stderr, by local rank, from a ``torchrun_command`` run."""
    return {int(path.parent.name): path.read_text() for path in log_dir.rglob("stderr.log")}


def join_world_as(rank: int, world_size: int, port: int) -> None:
    """Set the launcher environment a worker rank reads (for ranks started by mp.spawn)."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
        }
    )


def wait_for_ranks(pid: int, processes: int = 2, timeout: float = 120) -> None:
    """Wait until the launcher ``pid`` has started ``processes`` ranks.

    torchrun installs its SIGTERM handler before it starts the ranks, so a signal sent
    after this returns is forwarded to them; one sent earlier (while the launcher still
    imports torch) simply ends it.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                children += (task / "children").read_text().split()
            except FileNotFoundError:  # the thread ended
                continue
        if len(children) >= processes:
            return
        time.sleep(0.05)
    raise TimeoutError(f"launcher {pid} started no {processes} ranks in {timeout} s")
