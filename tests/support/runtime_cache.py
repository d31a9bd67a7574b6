"""The runtime cache as a user drives it: ``dlo-worker generate`` with the cache flags, the
``cache`` commands, and the outside world's part (another process holding a lock, a small
or read-only file system in a private mount namespace)."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

from tests.support.generate import ENV, generate_command
from tests.support.in_process import CliRun, run_dlo_worker

SEED = 11
CACHE_FLAGS = ("--enable-distributed-layerwise-offload", "--dlo-no-use-allgather")
KEY = re.compile(r'msg="runtime cache attached" key=(?P<key>[0-9a-f]{40}) result=(?P<result>\w+)')


def cached_command(model: Path, out: Path, root: Path, *flags: str) -> list[str]:
    """``generate`` with the runtime cache: its arguments, without the interpreter."""
    return generate_command(
        model,
        out,
        SEED,
        *CACHE_FLAGS,
        "--dlo-enable-runtime-cache",
        "--dlo-runtime-cache-root",
        str(root),
        *flags,
    )


def cached_argv(model: Path, out: Path, root: Path, *flags: str) -> list[str]:
    """:func:`cached_command` as a process's command line (for a private mount namespace)."""
    return [sys.executable, "-m", "dlo_worker", *cached_command(model, out, root, *flags)]


def generate_cached(model: Path, out: Path, root: Path, *flags: str) -> CliRun:
    """Generate with the runtime cache, whatever the exit status (for refusals)."""
    return run_dlo_worker(cached_command(model, out, root, *flags))


def run_cached(model: Path, out: Path, root: Path, *flags: str) -> str:
    """Generate with the runtime cache, which must succeed; returns the log (stderr)."""
    result = generate_cached(model, out, root, *flags)
    assert result.returncode == 0, result.stderr
    return result.stderr


def attached(log: str) -> tuple[str, str]:
    match = KEY.search(log)
    assert match, log
    return match["key"], match["result"]


def cache_cli(*arguments: str) -> CliRun:
    """``dlo-worker cache <arguments>``, in this process."""
    return run_dlo_worker(["cache", *arguments])


def cache_warm(model: Path, root: Path, *flags: str) -> CliRun:
    """``dlo-worker cache warm`` with the cache flags (and ``flags``), as a per-node warm
    Job runs it."""
    return cache_cli(
        "warm",
        "--model",
        str(model),
        "--device",
        "cpu",
        *CACHE_FLAGS,
        "--dlo-enable-runtime-cache",
        "--dlo-runtime-cache-root",
        str(root),
        *flags,
    )


def hold_lock(path: Path, mode: str = "LOCK_EX") -> subprocess.Popen:
    """Another process that holds a ``flock`` on ``path`` until killed: exclusive (a builder)
    or ``LOCK_SH`` (a process that maps the entry)."""
    code = (
        "import fcntl, os, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)\n"
        f"fcntl.flock(fd, fcntl.{mode})\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def in_private_mount(
    root: Path, mount_options: str, argv: list[str], setup: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with ``root`` a fresh tmpfs mounted with ``mount_options`` (a private
    mount namespace: nothing outside the process sees it), after the shell commands
    ``setup`` ran on it (``"$1"`` is the root; e.g. fill it, then remount it read-only)."""
    root.mkdir(parents=True, exist_ok=True)
    prepare = f"{setup} && " if setup else ""
    script = f'mount -t tmpfs -o {mount_options} tmpfs "$1" && {prepare}shift && exec "$@"'
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            str(root),
            *argv,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )


def garble_tensor_data(checkpoint: Path) -> None:
    """Overwrite every tensor byte, keeping the header, the size and the mtime: a start
    that read any tensor of this file would compute another image."""
    status = checkpoint.stat()
    data = bytearray(checkpoint.read_bytes())
    (header_length,) = struct.unpack("<Q", data[:8])
    data[8 + header_length :] = bytes(len(data) - 8 - header_length)
    checkpoint.write_bytes(bytes(data))
    os.utime(checkpoint, ns=(status.st_atime_ns, status.st_mtime_ns))
