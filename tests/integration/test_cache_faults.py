"""The runtime cache under careless and hostile hands: the ``cache`` commands never leave
their root, every entry a start trusts is verified, and a full disk at any moment of a
build is a fallback. Each case was a silent loss, a wrong image or a traceback before
(docs/runtime-cache.md, "Faults")."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from dlo_worker.runtime_cache.identity import FORMAT_VERSION
from tests.support.generate import digest
from tests.support.runtime_cache import (
    attached,
    cache_cli,
    cached_argv,
    generate_cached,
    hold_lock,
    in_private_mount,
    run_cached,
)

ROOT_NEEDED = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def tree_digest(directory: Path) -> str:
    """Names, kinds, modes, link targets and bytes of everything under ``directory``."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        status = path.lstat()
        digest.update(f"{path.relative_to(directory)}|{status.st_mode}|".encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the cache root that no cache command may touch."""
    directory = tmp_path / "precious"
    (directory / "sub").mkdir(parents=True)
    (directory / "data.bin").write_bytes(os.urandom(1000))
    (directory / "sub" / "notes.txt").write_text("keep me")
    return directory


def one_line_error(result, says: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert says in lines[0], lines[0]


def test_rm_refuses_every_name_that_is_not_a_key_and_touches_nothing(
    cache_root: tuple[Path, str], outside: Path
) -> None:
    """``cache rm --root R /some/dir`` deleted /some/dir; ``../locks`` deleted R/locks."""
    root, key = cache_root
    before_outside, before_root = tree_digest(outside), tree_digest(root)
    hostile = [
        str(outside),
        str(outside / "data.bin"),
        f"../../{outside.name}",
        "../locks",
        "..",
        ".",
        "",
        f"{key}/../../locks",
        f"{key}/manifest.json",
        key.upper(),
        key[:-1],
        f"{key}\n",
    ]
    for name in hostile:
        one_line_error(cache_cli("rm", "--root", str(root), name), "is not a runtime-cache key")
    for name in hostile[:3]:
        one_line_error(cache_cli("verify", "--root", str(root), name), "is not a runtime-cache key")
    assert tree_digest(outside) == before_outside
    assert tree_digest(root) == before_root


def test_rm_never_follows_a_symlink_out_of_the_root(
    cache_root: tuple[Path, str], outside: Path
) -> None:
    root, key = cache_root
    before = tree_digest(outside)
    link_key = "0" * 40
    (root / "entries" / link_key).symlink_to(outside)  # an "entry" that is a link outside
    one_line_error(cache_cli("rm", "--root", str(root), link_key), "is a symbolic link")
    one_line_error(cache_cli("verify", "--root", str(root), link_key), "is a symbolic link")
    assert (root / "entries" / link_key).is_symlink()
    # A lock file that links outside is neither created through nor touched (its mtime
    # records an entry's last use).
    (root / "locks" / f"{key}.use").unlink()
    (root / "locks" / f"{key}.use").symlink_to(outside / "data.bin")
    one_line_error(cache_cli("rm", "--root", str(root), key), "is a symbolic link")
    # The root's own directories must be directories: a linked tmp/ would move the entry
    # out of the root before it is deleted.
    (root / "locks" / f"{key}.use").unlink()
    shutil.rmtree(root / "tmp")
    (root / "tmp").symlink_to(outside)
    one_line_error(cache_cli("rm", "--root", str(root), key), "is a symbolic link")
    assert (root / "entries" / key / "manifest.json").is_file()
    # A file of an entry that links outside is corrupt, and removing the entry unlinks it.
    (root / "tmp").unlink()
    (root / "tmp").mkdir()
    others = root / "entries" / key / "others.safetensors"
    others.unlink()
    others.symlink_to(outside / "data.bin")
    verified = cache_cli("verify", "--root", str(root), key)
    assert verified.returncode == 1, verified.stderr
    assert f"{others}: is a symbolic link" in verified.stderr
    removed = cache_cli("rm", "--root", str(root), key)
    assert removed.returncode == 0, removed.stderr
    assert not (root / "entries" / key).exists()
    assert tree_digest(outside) == before


def test_commands_on_a_missing_root_answer_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    for arguments in (("ls",), ("verify",), ("rm", "a" * 40)):
        one_line_error(
            cache_cli(*arguments, "--root", str(missing)), f"no runtime cache at {missing}"
        )
    assert not missing.exists()


@ROOT_NEEDED
def test_a_read_only_root_lists_and_verifies_and_refuses_rm_in_one_line(
    warm_root: tuple[Path, str], tmp_path: Path
) -> None:
    source, key = warm_root
    root = tmp_path / "ro"
    setup = f'cp -a {source}/. "$1" && mount -o remount,ro "$1"'

    def run(*arguments: str):
        argv = ["dlo-worker", "cache", *arguments, "--root", str(root)]
        return in_private_mount(root, "size=64m", argv, setup)

    listed = run("ls")
    assert listed.returncode == 0, listed.stderr
    assert [entry["key"] for entry in json.loads(listed.stdout)] == [key]
    verified = run("verify")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout) == {"verified": 1, "corrupt": []}
    one_line_error(run("rm", key), "read-only")


def _edit_manifest(root: Path, key: str, edit) -> None:
    path = root / "entries" / key / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=1))


def _first_block(manifest: dict) -> dict:
    (component,) = manifest["components"].values()
    return next(iter(component["blocks"][0]["dtypes"].values()))


def _shift_an_offset(manifest: dict) -> None:
    _first_block(manifest)["spans"][1][1] += 64  # one flipped bit, as the issue found it


def _edit_a_shape(manifest: dict) -> None:
    span = next(s for s in _first_block(manifest)["spans"] if len(set(s[3])) == 2)
    span[3] = [span[3][1], span[3][0]]  # the same element count, another shape


def _swap_two_names(manifest: dict) -> None:
    """Two tensors of one shape trade places: a layout that still packs consistently."""
    spans = _first_block(manifest)["spans"]
    by_shape: dict[tuple, list] = {}
    for span in spans:
        by_shape.setdefault(tuple(span[3]), []).append(span)
    first, second = next(group for group in by_shape.values() if len(group) >= 2)[:2]
    first[0], second[0] = second[0], first[0]


def _change_the_content_digest(manifest: dict) -> None:
    manifest["identity"]["content_digest"] = "0" * 64


def _point_a_file_outside(manifest: dict) -> None:
    (component,) = manifest["components"].values()
    component["blocks"][0]["file"] = "../../precious/data.bin"


TAMPERING = {
    "offset": (_shift_an_offset, "packs at offset"),
    "shape": (_edit_a_shape, "in the model"),
    "swapped-names": (_swap_two_names, "packed block layout"),
    "content-digest": (_change_the_content_digest, "does not hash to the key"),
    "file-outside": (_point_a_file_outside, f"not a format {FORMAT_VERSION} manifest"),
}


@pytest.mark.parametrize("change", TAMPERING)
def test_a_changed_manifest_is_caught_quarantined_and_rebuilt(
    mixed_model: Path,
    resident_digest: str,
    cache_root: tuple[Path, str],
    tmp_path: Path,
    change: str,
) -> None:
    """A flipped offset gave a skip-load hit and another image with exit 0, and `cache
    verify` called the entry clean: the manifest was trusted, not verified."""
    root, key = cache_root
    edit, says = TAMPERING[change]
    _edit_manifest(root, key, edit)
    verified = cache_cli("verify", "--root", str(root), key)
    assert verified.returncode == 1, verified.stderr
    assert json.loads(verified.stdout) == {"verified": 1, "corrupt": [key]}
    assert "Traceback" not in verified.stderr
    required = generate_cached(
        mixed_model, tmp_path / "r.png", root, "--dlo-runtime-cache-skip-load", "required"
    )
    assert required.returncode == 2, required.stderr
    assert "Traceback" not in required.stderr
    (line,) = [x for x in required.stderr.splitlines() if x.startswith("dlo-worker generate:")]
    assert "--dlo-runtime-cache-skip-load required:" in line
    assert says in line
    assert "quarantined" in line
    assert len(list((root / "quarantine").iterdir())) == 1
    log = run_cached(mixed_model, tmp_path / "a.png", root)
    assert attached(log) == (key, "built")
    assert digest(tmp_path / "a.png") == resident_digest


def test_a_swapped_manifest_is_caught_by_the_content_digest_alone(
    cache_root: tuple[Path, str],
) -> None:
    """Without a model to derive the layout from (``cache verify``), the views' content
    digest still tells: the manifest's layout is consistent, its tensors are not the key's."""
    root, key = cache_root
    _edit_manifest(root, key, _swap_two_names)
    verified = cache_cli("verify", "--root", str(root), key)
    assert verified.returncode == 1
    assert "do not have the content digest its key was made from" in verified.stderr


def test_a_source_record_naming_another_models_entry_is_dropped(
    mixed_model: Path, resident_digest: str, cache_root: tuple[Path, str], tmp_path: Path
) -> None:
    root, key = cache_root
    other, _ = attached(run_cached(mixed_model, tmp_path / "b.png", root, "--dtype", "bfloat16"))
    assert other != key
    records = {json.loads(p.read_text())["key"]: p for p in (root / "sources").iterdir()}
    records[key].write_text(json.dumps({"key": other}))
    log = run_cached(mixed_model, tmp_path / "a.png", root)
    assert "runtime cache source record dropped" in log
    assert attached(log) == (key, "joined")
    assert digest(tmp_path / "a.png") == resident_digest
    assert (root / "entries" / other).is_dir()  # another model's entry is not corrupt


def test_a_killed_builders_temporary_is_reclaimed_by_the_next_start_a_live_ones_is_kept(
    mixed_model: Path, cache_root: tuple[Path, str], tmp_path: Path
) -> None:
    root, key = cache_root
    dead, live = "d" * 40, "e" * 40
    for name in (dead, live):
        (root / "tmp" / f"{name}.4242.0").mkdir()
        (root / "tmp" / f"{name}.4242.0" / "blocks-00000.safetensors").write_bytes(b"partial")
    holder = hold_lock(root / "locks" / f"{live}.build")
    try:
        log = run_cached(mixed_model, tmp_path / "a.png", root)
        assert attached(log) == (key, "hit")  # no build ran: the start reclaimed it
        assert sorted(p.name for p in (root / "tmp").iterdir()) == [f"{live}.4242.0"]
    finally:
        holder.kill()
        holder.wait()


def _fill_inodes_leaving(free: int) -> str:
    """Shell commands for :func:`in_private_mount`: the root's directories exist, then every
    inode of the file system is taken but ``free``."""
    return (
        'mkdir "$1/entries" "$1/locks" "$1/tmp" "$1/quarantine" "$1/sources" && '
        'i=0; while touch "$1/fill.$i" 2>/dev/null; do i=$((i+1)); done; '
        f'j=0; while [ $j -lt {free} ]; do rm "$1/fill.$j"; j=$((j+1)); done; true'
    )


@ROOT_NEEDED
@pytest.mark.parametrize("free_inodes", [1, 2, 3, 4, 5])
def test_a_disk_that_fills_at_any_moment_of_a_build_is_the_disk_full_fallback(
    mixed_model: Path, resident_digest: str, tmp_path: Path, free_inodes: int
) -> None:
    """The free-space check passes (bytes are plenty) and the disk runs out while the entry
    is written: at the build lock, the temporary directory, each safetensors file (where
    safetensors raised SafetensorError and the start failed), the manifest or the use lock."""
    root = tmp_path / "cache"
    generate_then_list = (
        '"$@"; rc=$?; printf "tmp=[%s]\\n" "$(ls -A ' + str(root / "tmp") + ')"; exit $rc'
    )
    argv = [
        "sh",
        "-c",
        generate_then_list,
        "sh",
        *cached_argv(mixed_model, tmp_path / "a.png", root),
    ]
    result = in_private_mount(
        root, "size=512m,nr_inodes=64", argv, _fill_inodes_leaving(free_inodes)
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "reason=cache-disk-full" in result.stderr
    assert "host_backing=ordinary" in result.stderr
    assert "tmp=[]" in result.stdout  # nothing half-written is left behind
    assert digest(tmp_path / "a.png") == resident_digest


WRITE_WHILE_THE_DISK_FILLS = """
import json, os, sys
from pathlib import Path
from diffusers import DiTTransformer2DModel
from dlo_worker.runtime_cache import CacheFallbackError, CacheRequest, identity_of
from dlo_worker.runtime_cache.entry import component_layout, entry_nbytes, write_entry
from dlo_worker.runtime_cache.store import RuntimeCacheStore

model, root = Path(sys.argv[1]), Path(sys.argv[2])
dit = DiTTransformer2DModel.from_pretrained(model / "transformer")
layouts = [component_layout("transformer", dit, None)]
identity = identity_of(CacheRequest(root, 5), [("transformer", dit)])

def write(directory):
    # Another user of the disk takes all but 64 KiB after the free-space check passed.
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    with open(root / "filler", "wb") as filler:
        os.posix_fallocate(filler.fileno(), 0, free - 64 * 1024)
    write_entry(directory, identity, layouts)

try:
    RuntimeCacheStore(root, 5).build_or_join(identity.key, entry_nbytes(layouts), write)
    print(json.dumps({"reason": None}))
except CacheFallbackError as error:
    print(json.dumps({"reason": error.reason, "message": str(error),
                      "tmp": os.listdir(root / "tmp"), "entries": os.listdir(root / "entries")}))
"""


@ROOT_NEEDED
def test_a_disk_that_fills_while_safetensors_writes_is_the_disk_full_fallback(
    mixed_model: Path, tmp_path: Path
) -> None:
    """The real writer, mid-file: safetensors reports ENOSPC as its own error type."""
    root = tmp_path / "cache"
    argv = ["python", "-c", WRITE_WHILE_THE_DISK_FILLS, str(mixed_model), str(root)]
    result = in_private_mount(root, "size=320m", argv)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["reason"] == "cache-disk-full", outcome
    assert "No space left on device" in outcome["message"]
    assert outcome["tmp"] == []
    assert outcome["entries"] == []


def test_the_size_budget_counts_every_byte_on_disk(
    mixed_model: Path, warm_root: tuple[Path, str], tmp_path: Path
) -> None:
    """Only the tensors' bytes were counted, so the budget was overshot by the safetensors
    headers and the manifest (74 KB in the issue)."""
    source, key = warm_root
    on_disk = sum(path.stat().st_size for path in (source / "entries" / key).iterdir())
    for budget, fits in ((on_disk - 1, False), (on_disk, True)):
        root = tmp_path / f"budget-{budget}"
        flags = ("--dlo-runtime-cache-size-budget-gib", f"{budget / 2**30:.12f}")
        log = run_cached(mixed_model, tmp_path / "a.png", root, *flags)
        published = list((root / "entries").iterdir())
        if fits:
            assert attached(log) == (key, "built")
            assert sum(path.stat().st_size for path in published[0].iterdir()) <= budget
        else:
            assert "reason=cache-budget" in log
            assert published == []
        assert list((root / "tmp").iterdir()) == []


@ROOT_NEEDED
def test_a_read_only_root_still_serves_a_verified_skip_load_hit(
    mixed_model: Path, resident_digest: str, warm_root: tuple[Path, str], tmp_path: Path
) -> None:
    """``required`` on a read-only root said "no entry recorded" next to a warm entry: the
    locks were opened for writing. Locks need no write access, and verifying none."""
    source, key = warm_root
    root = tmp_path / "ro"
    setup = f'cp -a {source}/. "$1" && mount -o remount,ro "$1"'
    argv = cached_argv(
        mixed_model, tmp_path / "a.png", root, "--dlo-runtime-cache-skip-load", "required"
    )
    result = in_private_mount(root, "size=64m", argv, setup)
    assert result.returncode == 0, result.stderr
    assert attached(result.stderr) == (key, "hit")
    assert digest(tmp_path / "a.png") == resident_digest


def test_required_says_when_the_recorded_entry_was_removed(
    mixed_model: Path, cache_root: tuple[Path, str], tmp_path: Path
) -> None:
    root, key = cache_root
    assert cache_cli("rm", "--root", str(root), key).returncode == 0
    required = generate_cached(
        mixed_model, tmp_path / "r.png", root, "--dlo-runtime-cache-skip-load", "required"
    )
    assert required.returncode == 2, required.stderr
    assert f"the entry recorded for this model ({key}) was evicted or removed" in required.stderr
    assert list((root / "quarantine").iterdir()) == []
