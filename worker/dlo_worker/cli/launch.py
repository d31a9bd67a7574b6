"""``dlo-worker launch``: torchrun, exiting the way its ranks' drain ended.

torchrun forwards SIGTERM to its ranks, waits for them, and then raises the signal again
as ``SignalException``, so a Pod whose every rank drained cleanly ended ``Error`` with exit
1 and a traceback on every scale-down, roll, delete and drain. The ranks finish the
drain, so they report how it ended. Each rank's ``serve`` writes its exit status to
``$DLO_EXIT_DIR/<local rank>`` as its last act (:func:`record_exit`). After the signal,
``launch`` exits 0 when every local rank recorded 0. Otherwise it exits 128 + the signal
with one line naming the ranks that did not finish. A rank that fails on its own ends the
launch with exit 1 and one line per failed rank.

torchrun can lose track of its ranks: a SIGTERM that lands while it is still starting them
(after the last fork, before it records the handles) makes it shut down none of them, and
the ranks would run on after the launcher exited, still holding the port and the Pod's
logs. So ``launch`` stops every child still running when torchrun returns, as torchrun
would have (SIGTERM, then SIGKILL after the same grace), before it reads their exits.

A launcher that is killed outright (SIGKILL, the OOM killer) stops nothing. Each rank
watches it (:func:`watch_launcher`): once its launcher is gone, the rank removes the
launcher's exit directory (nobody is left to read it) and stops itself as the launcher
would have, SIGTERM (the drain) and, after the same grace, SIGKILL. In a Pod the
container's end stops the ranks anyway; on a host they would hold the port and the GPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from dlo_worker.process.termination import write_termination_message

EXIT_DIR_ENV = "DLO_EXIT_DIR"
LAUNCHER_PID_ENV = "DLO_LAUNCHER_PID"
LOCAL_RANK_ENV = "LOCAL_RANK"
STOP_GRACE_SECONDS = 30
"""How long a rank may drain after SIGTERM before SIGKILL: torchrun's own grace."""


def record_exit(status: int) -> None:
    """Under ``launch``: record this rank's exit status for the launcher (no-op elsewhere,
    and once the launcher is gone with its directory)."""
    directory = os.environ.get(EXIT_DIR_ENV)
    if directory and Path(directory).is_dir():
        rank = os.environ.get(LOCAL_RANK_ENV, "0")
        (Path(directory) / rank).write_text(f"{status}\n")


def watch_launcher(poll_seconds: float = 1.0, grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """Under ``launch`` (no-op elsewhere): stop this rank once its launcher is gone (see
    the module docstring). A daemon thread polls the parent's pid, which changes when the
    parent dies and the rank is handed to another reaper."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(poll_seconds)
        print(
            f"dlo-worker: warning: launcher {launcher} is gone; stopping this rank",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(os.environ.get(EXIT_DIR_ENV, ""), ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dlo-launcher-watch", daemon=True).start()


def unfinished_ranks(directory: Path, local_ranks: int) -> list[str]:
    """Local ranks that recorded no exit, or a non-zero one, each as a short reason."""
    problems = []
    for rank in range(local_ranks):
        path = directory / str(rank)
        status = path.read_text().strip() if path.is_file() else None
        if status is None:
            problems.append(f"local rank {rank} ended before its drain finished")
        elif status != "0":
            problems.append(f"local rank {rank} exited {status}")
    return problems


def stop_leftover_ranks(grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """Stop the children of this process that are still running (see the module docstring)."""
    import psutil

    leftovers = psutil.Process().children()
    if not leftovers:
        return
    pids = ", ".join(str(process.pid) for process in leftovers)
    print(
        f"dlo-worker launch: warning: torchrun ended with ranks still running (pids {pids}); "
        "stopping them",
        file=sys.stderr,
    )
    for process in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(leftovers, timeout=grace_seconds)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_seconds)


def _report(lines: list[str]) -> None:
    """Print each line; the first is the termination message unless a rank left its own."""
    for line in lines:
        print(line, file=sys.stderr)
    write_termination_message(lines[0], replace=False)


def launch(torchrun_arguments: list[str]) -> int:
    """Run torchrun with ``torchrun_arguments``; returns the exit status (see the module
    docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, main, parse_args

    local_ranks = determine_local_world_size(parse_args(torchrun_arguments).nproc_per_node)
    with tempfile.TemporaryDirectory(prefix="dlo-exit-") as directory:
        os.environ[EXIT_DIR_ENV] = directory
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        try:
            try:
                main(torchrun_arguments)
            finally:
                stop_leftover_ranks()
        except SignalException as error:
            problems = unfinished_ranks(Path(directory), local_ranks)
            if not problems:
                return 0
            _report([f"dlo-worker launch: error: {'; '.join(problems)}"])
            return 128 + int(error.sigval)
        except ChildFailedError as error:
            _report(
                [
                    f"dlo-worker launch: error: rank {rank} (local rank {failure.local_rank}) "
                    f"exited {failure.exitcode}"
                    for rank, failure in sorted(error.failures.items())
                ]
            )
            return 1
    return 0
