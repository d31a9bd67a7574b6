"""Where ``generate --out`` may write, checked before any model is loaded (no torch here).

A path the worker cannot or must not write fails in a second with one line naming it and
the fix, not after minutes of loading and generating. The image then replaces the file
atomically (a reader sees the old or the whole new file) with the permissions a shell
redirection would give: an existing file keeps its mode, a new one gets ``0666 & ~umask``.
A path that is not a regular file (a FIFO, a device, a socket) is never replaced.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dlo_worker.errors import UserFixableError


class OutputPathError(ValueError, UserFixableError):
    """``--out`` names something the image cannot be written to."""


TEMPORARY_NAME_EXTRA = len(".") + len(".") + 8
"""The atomic write's temporary file beside the image is ``.<name>.<8 random characters>``
(:func:`dlo_worker.engine.generation.write_png`), so the name must leave room for it."""


def check_output_path(path: Path, *, make_parents: bool) -> None:
    """Raise :class:`OutputPathError` unless ``path`` can take the image."""
    try:
        _check_output_path(path, make_parents=make_parents)
    except OSError as error:
        raise OutputPathError(f"--out {path}: {error.strerror or error}") from None


def _check_output_path(path: Path, *, make_parents: bool) -> None:
    _check_name_lengths(path)
    if path.exists() or path.is_symlink():
        mode = path.stat().st_mode if path.exists() else 0
        if stat.S_ISDIR(mode):
            raise OutputPathError(f"--out {path} is a directory; name a file inside it")
        if not stat.S_ISREG(mode):
            raise OutputPathError(
                f"--out {path} exists and is not a regular file (a FIFO, device or socket, or a "
                "dangling link); it is never replaced: choose another path"
            )
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise OutputPathError(f"--out {path}: {parent} is not a directory")
    if parent != path.parent.resolve() and not make_parents:
        raise OutputPathError(
            f"--out {path}: the directory {path.parent} does not exist; create it, or add "
            "--make-parents"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"--out {path}: the directory {parent} is not writable")


def _check_name_lengths(path: Path) -> None:
    """Every name of ``path`` (and the temporary file's) fits the file system's limits, so
    the write after generation cannot fail with ``ENAMETOOLONG``."""
    nearest = _nearest_existing(path.parent)
    name_max = os.pathconf(nearest, "PC_NAME_MAX")
    path_max = os.pathconf(nearest, "PC_PATH_MAX")
    resolved = path.resolve()
    *directories, name = resolved.relative_to(nearest).parts  # the names still to create
    too_long = len(os.fsencode(name)) + TEMPORARY_NAME_EXTRA > name_max or any(
        len(os.fsencode(directory)) > name_max for directory in directories
    )
    if too_long or len(os.fsencode(resolved)) + TEMPORARY_NAME_EXTRA >= path_max:
        limit = f"names of at most {name_max - TEMPORARY_NAME_EXTRA} bytes for the image"
        raise OutputPathError(
            f"--out {path}: the path is too long for its file system ({limit}, "
            f"{name_max} for directories, {path_max} in all); choose a shorter name"
        )


def new_file_mode(path: Path) -> int:
    """The mode the image gets: an existing file's own, else ``0666`` less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _nearest_existing(directory: Path) -> Path:
    directory = directory.resolve()
    while not directory.exists():
        directory = directory.parent
    return directory
