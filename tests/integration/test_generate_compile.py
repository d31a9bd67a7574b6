"""``dlo-worker generate --compile`` (inductor's CPU backend): DLO writes the bytes of the
resident model compiled the same way, rank-local and with DLO AllGather over DP=2, on the
DiT and Flux demos; combinations that cannot run are refused before torch loads."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.integration.test_generate_dlo import run_single, torchrun
from tests.support.generate import (
    digest,
    generate_argv,
    refused_generate,
    run_generate_process,
)
from tests.support.launch import rank_logs
from tests.support.runtime_cache import in_private_mount

DLO = ("--enable-distributed-layerwise-offload",)
RANK_LOCAL = (*DLO, "--dlo-no-use-allgather")
PROMPT = ("--prompt", "a red cat", "--width", "32", "--height", "32")


@pytest.fixture(scope="module")
def models(demo_model_dir: Path, flux_model_dir: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    return {"dit": (demo_model_dir, ()), "flux": (flux_model_dir, PROMPT)}


@pytest.fixture(scope="module")
def resident_compiled(
    models: dict[str, tuple[Path, tuple[str, ...]]], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], str]:
    """Digests of the resident model compiled with --compile: the DiT demo at seeds 11 and
    12 (the two DP ranks' seeds), the Flux demo at 11; and the DiT demo's eager image at 11
    (``dit-eager``)."""
    out = tmp_path_factory.mktemp("resident-compiled")
    images = {}
    for name, seed in (("dit", 11), ("dit", 12), ("flux", 11)):
        model, flags = models[name]
        path = out / f"{name}-{seed}.png"
        result = run_single(model, path, seed, "--compile", *flags)
        assert re.search(r"blocks compiled lazily.* blocks=[1-9]", result.stderr), result.stderr
        images[(name, seed)] = digest(path)
    eager = out / "dit-eager.png"
    run_single(models["dit"][0], eager, 11)
    # Inductor's kernels round differently from eager ones: the option took effect.
    images[("dit-eager", 11)] = digest(eager)
    assert images[("dit-eager", 11)] != images[("dit", 11)]
    return images


@pytest.mark.parametrize("name", ["dit", "flux"])
def test_rank_local_dlo_compiled_writes_the_resident_compiled_bytes(
    name: str,
    models: dict[str, tuple[Path, tuple[str, ...]]],
    resident_compiled: dict[tuple[str, int], str],
    tmp_path: Path,
) -> None:
    model, flags = models[name]
    out = tmp_path / "dlo.png"
    result = run_single(model, out, 11, "--compile", *RANK_LOCAL, *flags)
    assert digest(out) == resident_compiled[(name, 11)]
    stats = re.search(
        r"streamed_blocks=(\d+) .*compiled_blocks=(\d+) recompiles=(\d+)", result.stderr
    )
    assert stats, result.stderr
    streamed, compiled, recompiles = map(int, stats.groups())
    assert compiled == streamed > 0
    assert recompiles == 0


def test_allgather_dlo_compiled_writes_each_ranks_resident_compiled_bytes(
    demo_model_dir: Path, resident_compiled: dict[tuple[str, int], str], tmp_path: Path
) -> None:
    out = tmp_path / "dp.png"
    process = torchrun(
        demo_model_dir, out, tmp_path / "logs", 11, "--compile", *DLO, "--data-parallel-size", "2"
    )
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    assert digest(out) == resident_compiled[("dit", 11)]
    assert digest(tmp_path / "dp.dp1.png") == resident_compiled[("dit", 12)]
    for log in rank_logs(tmp_path / "logs").values():
        assert "transfer_mode=allgather" in log
        assert "recompiles=0" in log


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--compile-mode", "max-autotune-no-cudagraphs"),
            "--compile-mode max-autotune-no-cudagraphs requires --compile; add it",
        ),
        (
            ("--compile", "--enable-layerwise-offload"),
            "--compile with --enable-layerwise-offload: diffusers' group offloading",
        ),
        (
            ("--compile", "--compile-mode", "reduce-overhead", "--device", "cpu", *RANK_LOCAL),
            "--compile-mode reduce-overhead with --device cpu: CUDA graphs need a CUDA device",
        ),
        (
            # --device auto resolves to the CPU on this machine: refused at start.
            ("--compile", "--compile-mode", "reduce-overhead", "--device", "auto", *RANK_LOCAL),
            "--compile-mode reduce-overhead on cpu: CUDA graphs need a CUDA device",
        ),
        (
            ("--compile-cache-dir", "/tmp/graphs"),
            "--compile-cache-dir requires --compile; add it or drop the directory",
        ),
    ],
)
def test_compile_combinations_that_cannot_run_exit_2_in_one_line(
    flags: tuple[str, ...], message: str, demo_model_dir: Path, tmp_path: Path
) -> None:
    assert message in refused_generate(demo_model_dir, tmp_path / "x.png", *flags)


def test_a_restarted_worker_loads_its_graphs_from_the_compile_cache_dir(
    demo_model_dir: Path, resident_compiled: dict[tuple[str, int], str], tmp_path: Path
) -> None:
    """The first run compiles into the directory; a second process (a restarted Pod) loads
    every graph from it, compiles none, and writes the same bytes. Each run is a process of
    its own: this process's in-memory caches hold every graph the tests above compiled."""
    cache = tmp_path / "graphs"
    lookups = {}
    for attempt in ("cold", "warm"):
        out = tmp_path / f"{attempt}.png"
        result = run_generate_process(
            demo_model_dir, out, 11, "--compile", "--compile-cache-dir", str(cache), *RANK_LOCAL
        )
        assert result.returncode == 0, result.stderr
        assert digest(out) == resident_compiled[("dit", 11)]
        stats = re.search(
            r'msg="compile stats" .*first_forward_seconds=([0-9.]+) recompiles=0 '
            r"cache_hits=(\d+) cache_misses=(\d+)",
            result.stderr,
        )
        assert stats, result.stderr
        lookups[attempt] = (int(stats.group(2)), int(stats.group(3)))
    assert lookups["cold"][1] > 0
    assert lookups["warm"] == (lookups["cold"][1], 0)
    assert (cache / "fxgraph").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_compile_cache_runs_each_graph_eagerly_after_one_warning(
    demo_model_dir: Path, resident_compiled: dict[tuple[str, int], str], tmp_path: Path
) -> None:
    """--compile-cache-dir on a 64 KiB tmpfs: inductor cannot write the graph it must
    import, so the block graph falls back to the eager path, with one warning, for the
    streamed blocks (DLO compiles their forward) and the one kept resident (its compiled
    call) alike: the image is the eager one."""
    cache, out = tmp_path / "graphs", tmp_path / "full.png"
    flags = ("--compile", "--compile-cache-dir", str(cache), *RANK_LOCAL)
    argv = generate_argv(demo_model_dir, out, 11, *flags, "--dlo-resident-layers", "1")
    result = in_private_mount(cache, "size=64k", argv)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "resident_blocks=1" in result.stderr
    assert result.stderr.count('msg="compile cache full') == 1, result.stderr
    assert f"cache_dir={cache}" in result.stderr
    assert re.search(r'msg="compile stats" .*eager_fallbacks=1', result.stderr), result.stderr
    assert digest(out) == resident_compiled[("dit-eager", 11)]
