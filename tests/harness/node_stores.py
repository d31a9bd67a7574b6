"""The real nodes' image stores, made ready before any cluster starts.

Every real node runs a containerd of its own (a kubelet collects whatever its runtime
shows, so two kubelets never share one), and each containerd needs a root of its own:
``<cluster cache>/containerd/<index>``, kept across clusters so that a worker image of
several GB is not imported on every run. Importing that image is the slowest step of a
real node's start (decompressing and unpacking every layer), so it is done once:

- the first store imports the images through a containerd started for the import (its
  CRI plugin off: nothing runs), which also removes every other image and the content
  and layers only they used, so a store never keeps images of earlier keys;
- every other store becomes a copy of the first in which the immutable parts (content
  blobs and committed layers) are hard links, and containerd's databases real copies: a
  few seconds and no disk, against minutes and gigabytes per node.

A stamp in each store names the image references it holds, so an unchanged set is a
no-op; a store whose stamp is missing or different is brought to the current set. The
cluster's :func:`~tests.harness.control_plane.up` calls :func:`prepare` too, and finds it
done when ``python -m tests.cluster images --node-stores N`` (the test command) ran first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.harness.build import BuildError, Progress, cache_root
from tests.harness.nodes import (
    containerd_answers,
    ctr,
    ensure_runtime,
    remove_containers,
)

STAMP = ".dlo-images.json"
"""The image references a store holds, written after they were imported."""
IMMUTABLE = (
    "io.containerd.content.v1.content/blobs",
    "io.containerd.snapshotter.v1.overlayfs/snapshots",
)
"""What a store's copy shares by hard links: content blobs (read-only, addressed by their
digest) and committed layers (overlay lower directories, never written). Everything else,
containerd's bolt databases above all, is copied."""


class StoreInUseError(BuildError):
    """A store to change is in use: a cluster still runs on it."""


def store_root() -> Path:
    return cache_root() / "containerd"


def store_path(index: int) -> Path:
    """Node ``index``'s containerd root (:attr:`tests.harness.nodes.NodePlan.store`)."""
    return store_root() / str(index)


def stamp_of(store: Path) -> list[str]:
    try:
        return sorted(json.loads((store / STAMP).read_text()))
    except (OSError, ValueError):
        return []


def _write_stamp(store: Path, references: list[str]) -> None:
    partial = store / f"{STAMP}.partial"
    partial.write_text(json.dumps(sorted(references)))
    os.replace(partial, store / STAMP)


def ready(count: int, references: list[str]) -> bool:
    """Stores ``0 .. count-1`` hold exactly ``references``."""
    return all(stamp_of(store_path(index)) == sorted(references) for index in range(count))


def prepare(count: int, images: dict[str, Path], progress: Progress) -> list[Path]:
    """Stores ``0 .. count-1`` holding exactly ``images`` (reference -> OCI archive), ready
    for the nodes' containerds; idempotent, under a lock. Returns the stores."""
    wanted = sorted(images)
    stores = [store_path(index) for index in range(count)]
    if ready(count, wanted):
        return stores
    ensure_runtime(progress)
    store_root().mkdir(parents=True, exist_ok=True)
    with (store_root() / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        first = stores[0]
        if stamp_of(first) != wanted:
            _import(first, images, progress)
        for store in stores[1:]:
            if stamp_of(store) != wanted:
                started = time.monotonic()
                _refuse_if_in_use(first)  # its databases are copied as they are on disk
                _replace_with_copy(first, store)
                progress(
                    f"node store {store.name}: a hard-linked copy of store {first.name} "
                    f"in {time.monotonic() - started:.0f} s"
                )
    return stores


def _import(store: Path, images: dict[str, Path], progress: Progress) -> None:
    """Bring ``store`` to exactly ``images`` through a containerd of its own."""
    _refuse_if_in_use(store)
    with _containerd(store) as socket:
        remove_containers(socket)
        present = set(ctr(socket, "images", "ls", "-q").split())
        # The stamp goes first: a store interrupted from here on is brought back next time.
        (store / STAMP).unlink(missing_ok=True)
        if stale := sorted(present - set(images)):
            # --sync: wait until the garbage collector removed their content and layers.
            ctr(socket, "images", "rm", "--sync", *stale)
            progress(f"node store {store.name}: removed {len(stale)} images of earlier keys")
        for reference, archive in sorted(images.items()):
            if reference not in present:
                started = time.monotonic()
                progress(f"node store {store.name}: importing {reference} ...")
                ctr(socket, "images", "import", str(archive))
                progress(
                    f"node store {store.name}: {reference} imported in "
                    f"{time.monotonic() - started:.0f} s"
                )
    _write_stamp(store, list(images))


def _replace_with_copy(source: Path, store: Path) -> None:
    """``store`` replaced by a copy of ``source`` (see :data:`IMMUTABLE`)."""
    _refuse_if_in_use(store)
    partial = store.with_name(f"{store.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run(["cp", "-al", str(source), str(partial)], check=True, capture_output=True)
    for directory, _, files in os.walk(partial):
        relative = Path(directory).relative_to(partial)
        if any(relative.is_relative_to(shared) for shared in IMMUTABLE):
            continue
        for name in files:
            path = Path(directory) / name
            if path.is_symlink() or not path.is_file():
                continue
            # Break the link: containerd writes these in place.
            copy = path.with_name(f"{name}.copy")
            shutil.copy2(path, copy)
            os.chown(copy, path.stat().st_uid, path.stat().st_gid)
            os.replace(copy, path)
    shutil.rmtree(store, ignore_errors=True)
    os.replace(partial, store)


def _refuse_if_in_use(store: Path) -> None:
    """A store changes only while nothing has it mounted or open (a containerd of a running
    cluster, or one a killed run left behind)."""
    inside = f"{store}/"
    users = [
        f"{line.split()[1]} is mounted"
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith(inside)
    ]
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith(inside):
                users.append(f"process {fd.parts[2]} has {os.readlink(fd)} open")
    if users:
        raise StoreInUseError(
            f"node store {store} is in use ({users[0]}): a cluster still runs on it; "
            "stop it (python -m tests.cluster down) and try again"
        )


def containerd_config(store: Path, run_directory: Path) -> str:
    """The TOML of a containerd that only imports into ``store`` (pure)."""
    return "\n".join(
        [
            "version = 2",
            f'root = "{store}"',
            f'state = "{run_directory / "state"}"',
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
            "[grpc]",
            f'  address = "{run_directory / "containerd.sock"}"',
            "",
        ]
    )


@contextlib.contextmanager
def _containerd(store: Path) -> Iterator[Path]:
    """A containerd on ``store`` while the block runs; yields its socket."""
    run_directory = Path("/run") / f"dlo-store-{store.name}"
    shutil.rmtree(run_directory, ignore_errors=True)
    run_directory.mkdir(parents=True)
    store.mkdir(parents=True, exist_ok=True)
    config = run_directory / "containerd.toml"
    config.write_text(containerd_config(store, run_directory))
    log = store_root() / f"import-{store.name}.log"
    socket = run_directory / "containerd.sock"
    with log.open("wb") as stream:
        process = subprocess.Popen(
            [shutil.which("containerd") or "containerd", "--config", str(config)],
            stdout=stream,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not containerd_answers(socket):
            if process.poll() is not None or time.monotonic() > deadline:
                raise BuildError(f"containerd for node store {store} did not start; see {log}")
            time.sleep(0.2)
        yield socket
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(run_directory, ignore_errors=True)
