"""``dlo-worker`` run in the test's own process, where a subprocess adds nothing the test
asserts: the same ``main(argv)`` the console script calls, its stdout and stderr (logs and
progress bars included) captured, its exit status returned, and what it changes in the
process (log handlers, torch's thread count) put back.

A subprocess costs an interpreter and the imports of torch, diffusers and transformers,
several seconds of the two CPUs the suite shares, before the command does anything; the
in-process run costs only what the command does. Tests that assert what only a process
shows keep a subprocess: signals, exit under torchrun, mount namespaces, the environment
a process starts with, a process restart (compile caches), the installed console script.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

THREADS = 1
"""The CPU kernels' thread count: :data:`tests.support.generate.ENV`'s ``OMP_NUM_THREADS``,
so an image made here is bitwise the one a subprocess of those tests makes."""


@dataclass(frozen=True)
class CliRun:
    """What :class:`subprocess.CompletedProcess` holds, for the assertions tests make."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _process_state_restored(threads: int) -> Iterator[None]:
    import torch

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    previous_threads = torch.get_num_threads()
    environment = dict(os.environ)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous_threads)
        root.handlers[:] = handlers
        root.setLevel(level)
        for name in set(os.environ) - set(environment):
            del os.environ[name]
        os.environ.update(environment)


def _exit_status(code: object) -> int:
    """What the interpreter exits with for ``sys.exit(code)``: None is 0, a message is
    printed and is 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def run_dlo_worker(argv: Sequence[str], *, threads: int = THREADS) -> CliRun:
    """``dlo-worker <argv>`` in this process, whatever it exits with. An exception that
    escapes the command is printed as the interpreter prints it and exits 1, as in a
    subprocess; an argparse refusal exits 2."""
    from dlo_worker.cli.main import main

    arguments = list(argv)
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        _process_state_restored(threads),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        try:
            returncode = main(arguments)
        except SystemExit as exit_:
            returncode = _exit_status(exit_.code)
        except Exception:
            traceback.print_exc(file=sys.stderr)
            returncode = 1
    return CliRun(["dlo-worker", *arguments], returncode, stdout.getvalue(), stderr.getvalue())
