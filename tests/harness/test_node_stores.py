"""The real nodes' image stores (tests/harness/node_stores.py), on real files: a store's
copy shares what containerd never writes and owns what it does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.harness import node_stores

BLOB = "io.containerd.content.v1.content/blobs/sha256/ab12"
LAYER = "io.containerd.snapshotter.v1.overlayfs/snapshots/7/fs/usr/lib/libtorch.so"
OPAQUE = "io.containerd.snapshotter.v1.overlayfs/snapshots/7/fs/etc"
DATABASES = (
    "io.containerd.metadata.v1.bolt/meta.db",
    "io.containerd.snapshotter.v1.overlayfs/metadata.db",
)


@pytest.fixture
def first_store(tmp_path: Path) -> Path:
    """A store shaped like containerd's: a content blob, a layer file, a directory with
    an overlay xattr, a symlink, and its two bolt databases."""
    store = tmp_path / "0"
    for relative in (BLOB, LAYER, *DATABASES):
        (store / relative).parent.mkdir(parents=True, exist_ok=True)
        (store / relative).write_bytes(relative.encode())
    (store / OPAQUE).mkdir(parents=True)
    os.setxattr(store / OPAQUE, "user.overlay.opaque", b"y")
    (store / LAYER).with_name("libtorch.so.2").symlink_to("libtorch.so")
    return store


def test_a_copy_hard_links_blobs_and_layers_and_copies_the_databases(
    first_store: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "1"
    (copy / "stale").mkdir(parents=True)  # an earlier store is replaced, not merged
    node_stores._replace_with_copy(first_store, copy)
    for shared in (BLOB, LAYER):
        assert (copy / shared).stat().st_ino == (first_store / shared).stat().st_ino
    for database in DATABASES:
        assert (copy / database).read_bytes() == (first_store / database).read_bytes()
        assert (copy / database).stat().st_ino != (first_store / database).stat().st_ino
    assert os.getxattr(copy / OPAQUE, "user.overlay.opaque") == b"y"
    assert os.readlink(copy / LAYER.replace("libtorch.so", "libtorch.so.2")) == "libtorch.so"
    assert not (copy / "stale").exists()
    assert not copy.with_name("1.partial").exists()


def test_a_store_held_open_is_not_replaced(first_store: Path, tmp_path: Path) -> None:
    copy = tmp_path / "1"
    node_stores._replace_with_copy(first_store, copy)
    with (copy / DATABASES[0]).open("rb"), pytest.raises(node_stores.StoreInUseError) as error:
        node_stores._replace_with_copy(first_store, copy)
    assert f"node store {copy} is in use (process {os.getpid()} has" in str(error.value)
    assert "python -m tests.cluster down" in str(error.value)


def test_the_import_containerd_runs_nothing_and_keeps_its_state_apart(tmp_path: Path) -> None:
    text = node_stores.containerd_config(tmp_path / "0", Path("/run/x"))
    assert f'root = "{tmp_path / "0"}"' in text
    assert 'state = "/run/x/state"' in text
    assert 'address = "/run/x/containerd.sock"' in text
    assert 'disabled_plugins = ["io.containerd.grpc.v1.cri"]' in text


def test_stamps_say_which_images_a_store_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLO_CLUSTER_CACHE", str(tmp_path))
    assert not node_stores.ready(2, ["localhost/dlo-worker:a"])
    for index in range(2):
        node_stores.store_path(index).mkdir(parents=True)
        node_stores._write_stamp(node_stores.store_path(index), ["localhost/dlo-worker:a"])
    assert node_stores.ready(2, ["localhost/dlo-worker:a"])
    assert not node_stores.ready(2, ["localhost/dlo-worker:b"])
    assert not node_stores.ready(3, ["localhost/dlo-worker:a"])
