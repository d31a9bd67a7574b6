"""The runtime cache as users run it: real ``dlo-worker generate`` processes, real files,
real kernel locks. The demo checkpoint also holds a foreign tensor, so checkpoint mmap is
refused ("mixed") and the ordinary tensors go through the runtime cache."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import copy_pipeline
from tests.support.generate import ENV, digest, generate_command
from tests.support.launch import rank_logs, torchrun_command
from tests.support.runtime_cache import (
    CACHE_FLAGS,
    SEED,
    attached,
    cache_cli,
    cache_warm,
    cached_argv,
    garble_tensor_data,
    generate_cached,
    hold_lock,
    in_private_mount,
    run_cached,
)


def test_four_processes_on_one_root_build_once_and_all_write_the_resident_bytes(
    mixed_model: Path, resident_digest: str, tmp_path: Path
) -> None:
    root = tmp_path / "cache"
    processes = [
        subprocess.Popen(
            cached_argv(mixed_model, tmp_path / f"{index}.png", root),
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(4)
    ]
    logs = []
    for process in processes:
        _, log = process.communicate(timeout=600)
        assert process.returncode == 0, log
        logs.append(log)
    results = sorted(attached(log)[1] for log in logs)
    # One builds; the others join it, or skip loading if they looked after it was recorded.
    assert results[0] == "built"
    assert set(results[1:]) <= {"joined", "hit"}
    assert len({attached(log)[0] for log in logs}) == 1
    for index in range(4):
        assert digest(tmp_path / f"{index}.png") == resident_digest
    for log in logs:
        assert "host_backing=runtime-cache" in log
        # The entry's blocks (one packed tensor per dtype) stream through the native ring.
        assert "staging=ring staging_reason=default" in log
    (entry,) = (root / "entries").iterdir()
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["key"] == entry.name
    assert set(manifest["files"]) == {"blocks-00000.safetensors", "others.safetensors"}
    assert list((root / "tmp").iterdir()) == []


def test_a_packed_block_is_one_flat_tensor_per_dtype_readable_by_safetensors(
    cache_root: tuple[Path, str],
) -> None:
    from safetensors import safe_open

    root, key = cache_root
    manifest = json.loads((root / "entries" / key / "manifest.json").read_text())
    (component,) = manifest["components"].values()
    with safe_open(str(root / "entries" / key / "blocks-00000.safetensors"), "pt") as handle:
        for block in component["blocks"]:
            for record in block["dtypes"].values():
                flat = handle.get_tensor(record["tensor"])
                assert flat.dim() == 1
                assert flat.numel() == record["numel"]
                offsets = [offset for _, offset, _, _ in record["spans"]]
                assert offsets == sorted(offsets)
                assert all(offset * flat.element_size() % 256 == 0 for offset in offsets)


@pytest.mark.parametrize(
    ("keep_mtime", "flags"),
    [(False, ()), (True, ()), (True, ("--dlo-runtime-cache-skip-load", "off"))],
    ids=["rewritten", "bit-rot-skip-load", "bit-rot-join"],
)
def test_a_corrupt_block_file_is_quarantined_and_rebuilt(
    mixed_model: Path,
    resident_digest: str,
    cache_root: tuple[Path, str],
    tmp_path: Path,
    *,
    keep_mtime: bool,
    flags: tuple[str, ...],
) -> None:
    """Caught by the modification time (rewritten), by re-hashing the files (a skip-load
    start), or by comparing the mapped bytes with the loaded tensors (a join)."""
    root, key = cache_root
    blocks = root / "entries" / key / "blocks-00000.safetensors"
    status = blocks.stat()
    data = bytearray(blocks.read_bytes())
    data[-64:] = bytes(64 * [0x7F])  # same size, other bytes
    blocks.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(blocks, ns=(status.st_atime_ns, status.st_mtime_ns))
    log = run_cached(mixed_model, tmp_path / "b.png", root, *flags)
    assert "runtime cache entry quarantined" in log
    assert attached(log) == (key, "built")
    assert digest(tmp_path / "b.png") == resident_digest
    assert len(list((root / "quarantine").iterdir())) == 1


def test_a_truncated_manifest_is_quarantined_and_rebuilt(
    mixed_model: Path, resident_digest: str, cache_root: tuple[Path, str], tmp_path: Path
) -> None:
    root, key = cache_root
    manifest = root / "entries" / key / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    log = run_cached(mixed_model, tmp_path / "b.png", root)
    assert attached(log) == (key, "built")
    assert digest(tmp_path / "b.png") == resident_digest


def test_a_held_build_lock_falls_back_to_the_ordinary_tensors_after_the_timeout(
    mixed_model: Path, resident_digest: str, cache_root: tuple[Path, str], tmp_path: Path
) -> None:
    root, key = cache_root
    entry = root / "entries" / key
    for path in entry.iterdir():
        path.unlink()
    entry.rmdir()
    holder = hold_lock(root / "locks" / f"{key}.build")
    try:
        started = time.monotonic()
        log = run_cached(
            mixed_model, tmp_path / "b.png", root, "--dlo-runtime-cache-lock-timeout", "1"
        )
        assert time.monotonic() - started < 60
    finally:
        holder.kill()
        holder.wait()
    assert "reason=cache-lock-timeout" in log
    assert "host_backing=ordinary" in log
    assert digest(tmp_path / "b.png") == resident_digest


def _builder_killed_mid_publish(root: Path) -> None:
    """A process that takes the build lock, starts writing an entry, and is SIGKILLed."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from dlo_worker.runtime_cache.store import RuntimeCacheStore\n"
        "def write(directory):\n"
        "    (directory / 'blocks-00000.safetensors').write_bytes(b'partial')\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(600)\n"
        f"RuntimeCacheStore(Path({str(root)!r}), 5).build_or_join('c0' * 20, 0, write)\n"
    )
    builder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "writing"
    os.kill(builder.pid, signal.SIGKILL)
    builder.wait()


def test_a_builder_killed_mid_publish_leaves_no_entry_and_the_next_owner_cleans_up(
    tmp_path: Path,
) -> None:
    from dlo_worker.runtime_cache.store import RuntimeCacheStore

    root = tmp_path / "cache"
    _builder_killed_mid_publish(root)
    assert not (root / "entries" / ("c0" * 20)).exists()
    assert len(list((root / "tmp").iterdir())) == 1  # the dead writer's leftovers

    def write(directory: Path) -> None:
        (directory / "manifest.json").write_text(
            json.dumps({"format_version": 1, "key": "c0" * 20, "files": {}})
        )

    store = RuntimeCacheStore(root, 5)
    outcome = store.build_or_join("c0" * 20, 0, write)
    assert outcome.built
    assert list((root / "tmp").iterdir()) == []
    # The lock died with its holder: taking it again does not wait.
    fd = os.open(root / "locks" / f"{'c0' * 20}.build", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize(
    ("mount_options", "reason"),
    [("size=64k", "cache-disk-full"), ("ro", "cache-read-only")],
    ids=["full-disk", "read-only"],
)
def test_a_full_or_read_only_root_falls_back_with_the_reason(
    mixed_model: Path, resident_digest: str, tmp_path: Path, mount_options: str, reason: str
) -> None:
    root = tmp_path / "cache"
    result = in_private_mount(
        root, mount_options, cached_argv(mixed_model, tmp_path / "a.png", root)
    )
    assert result.returncode == 0, result.stderr
    assert f"reason={reason}" in result.stderr
    assert "host_backing=ordinary" in result.stderr
    assert digest(tmp_path / "a.png") == resident_digest


def test_data_parallel_ranks_share_one_entry_and_another_dtype_does_not(
    mixed_model: Path, resident_digest: str, tmp_path: Path
) -> None:
    root = tmp_path / "cache"
    command = generate_command(
        mixed_model,
        tmp_path / "dp.png",
        SEED,
        *CACHE_FLAGS,
        "--data-parallel-size",
        "2",
        "--dlo-enable-runtime-cache",
        "--dlo-runtime-cache-root",
        str(root),
    )
    result = subprocess.run(
        torchrun_command(command, tmp_path / "logs"),
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    logs = rank_logs(tmp_path / "logs")
    attachments = sorted(attached(log) for log in logs.values())
    assert attachments[0][1] == "built"
    assert attachments[1][1] in {"joined", "hit"}
    (key,) = {key for key, _ in attachments}
    assert digest(tmp_path / "dp.png") == resident_digest  # rank 0 draws the seed itself

    bfloat16_key, _ = attached(
        run_cached(mixed_model, tmp_path / "bf16.png", root, "--dtype", "bfloat16")
    )
    assert bfloat16_key != key
    assert sorted(path.name for path in (root / "entries").iterdir()) == sorted([key, bfloat16_key])


def _entry_bytes(entry: Path) -> int:
    return sum(path.stat().st_size for path in entry.iterdir())


@pytest.mark.parametrize("first_in_use", [False, True], ids=["idle", "in-use"])
def test_the_size_budget_evicts_the_least_recently_used_entry_no_process_maps(
    mixed_model: Path,
    resident_digest: str,
    cache_root: tuple[Path, str],
    tmp_path: Path,
    first_in_use: bool,
) -> None:
    root, first = cache_root
    # Room for the float32 entry and a bit more: not for the bfloat16 one beside it.
    budget = f"{_entry_bytes(root / 'entries' / first) * 1.2 / 2**30:.9f}"
    flags = ("--dlo-runtime-cache-size-budget-gib", budget)
    holder = hold_lock(root / "locks" / f"{first}.use", "LOCK_SH") if first_in_use else None
    try:
        log = run_cached(mixed_model, tmp_path / "b.png", root, "--dtype", "bfloat16", *flags)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    entries = {path.name for path in (root / "entries").iterdir()}
    if first_in_use:
        assert "reason=cache-budget" in log
        assert "host_backing=ordinary" in log
        assert entries == {first}
    else:
        second, result = attached(log)
        assert result == "built"
        assert "runtime cache entry evicted" in log
        assert entries == {second}
        # The evicted entry is rebuilt when it is needed again (and evicts in turn).
        third, result = attached(run_cached(mixed_model, tmp_path / "c.png", root, *flags))
        assert (third, result) == (first, "built")
        assert digest(tmp_path / "c.png") == resident_digest


def test_cache_commands_warm_list_verify_and_remove(mixed_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    warm = cache_warm(mixed_model, root)
    assert warm.returncode == 0, warm.stderr
    report = json.loads(warm.stdout)
    assert report["result"] == "built"
    key = report["key"]
    # A worker with the same flags binds to what the warm command built, loading nothing.
    assert attached(run_cached(mixed_model, tmp_path / "a.png", root)) == (key, "hit")

    (listed,) = json.loads(cache_cli("ls", "--root", str(root)).stdout)
    assert listed["key"] == key
    assert listed["components"] == {"transformer": "DiTTransformer2DModel"}
    assert listed["bytes"] == report["bytes"]
    assert listed["in_use_by"] == 0
    holder = hold_lock(root / "locks" / f"{key}.use", "LOCK_SH")
    try:
        (listed,) = json.loads(cache_cli("ls", "--root", str(root)).stdout)
        assert listed["in_use_by"] == 1
        refused = cache_cli("rm", "--root", str(root), key)
        assert refused.returncode == 2
        assert f"runtime-cache entry {key} is in use by 1 process(es)" in refused.stderr
    finally:
        holder.kill()
        holder.wait()

    verified = cache_cli("verify", "--root", str(root))
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout) == {"verified": 1, "corrupt": []}
    others = root / "entries" / key / "others.safetensors"
    status = others.stat()
    data = bytearray(others.read_bytes())
    data[-1] ^= 0xFF
    others.write_bytes(bytes(data))
    os.utime(others, ns=(status.st_atime_ns, status.st_mtime_ns))  # bit rot: only bytes change
    verified = cache_cli("verify", "--root", str(root), key)
    assert verified.returncode == 1
    assert f"{others}: its SHA-256 differs from the manifest's" in verified.stderr

    removed = cache_cli("rm", "--root", str(root), key)
    assert removed.returncode == 0, removed.stderr
    assert list((root / "entries").iterdir()) == []


def test_a_warm_start_skips_loading_and_reads_no_checkpoint_tensor(
    mixed_model: Path, resident_digest: str, tmp_path: Path
) -> None:
    model = copy_pipeline(mixed_model, tmp_path / "model")
    root = tmp_path / "cache"
    cold = run_cached(model, tmp_path / "cold.png", root)
    key, result = attached(cold)
    assert result == "built"
    garble_tensor_data(model / "transformer" / "diffusion_pytorch_model.safetensors")
    warm = run_cached(model, tmp_path / "warm.png", root)
    assert attached(warm) == (key, "hit")
    assert digest(tmp_path / "warm.png") == resident_digest


@pytest.mark.parametrize("change", ["touched-shard", "dtype"])
def test_a_changed_source_misses(mixed_model: Path, tmp_path: Path, change: str) -> None:
    model = copy_pipeline(mixed_model, tmp_path / "model")
    root = tmp_path / "cache"
    key, _ = attached(run_cached(model, tmp_path / "cold.png", root))
    flags: tuple[str, ...] = ()
    if change == "touched-shard":
        os.utime(model / "transformer" / "diffusion_pytorch_model.safetensors")
    else:
        flags = ("--dtype", "bfloat16")
    other_key, result = attached(run_cached(model, tmp_path / "again.png", root, *flags))
    assert result != "hit"
    # The same bytes (a touched shard) join the same entry; another dtype builds another.
    assert (other_key == key) == (change == "touched-shard")


def test_skip_load_required_refuses_a_cold_node_and_off_never_skips(
    mixed_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "cache"
    required = ("--dlo-runtime-cache-skip-load", "required")
    cold = generate_cached(mixed_model, tmp_path / "a.png", root, *required)
    assert cold.returncode == 2
    assert "--dlo-runtime-cache-skip-load required: no runtime-cache entry is recorded" in (
        cold.stderr
    )
    assert "dlo-worker cache warm" in cold.stderr
    run_cached(mixed_model, tmp_path / "b.png", root)
    assert attached(run_cached(mixed_model, tmp_path / "c.png", root, *required))[1] == "hit"
    off = ("--dlo-runtime-cache-skip-load", "off")
    assert attached(run_cached(mixed_model, tmp_path / "d.png", root, *off))[1] == "joined"
