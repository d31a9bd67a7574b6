"""``dlo-worker generate --lora`` on the Flux demo (CPU): adapters loaded at start write
the resident bytes under DLO, rank-local and with AllGather over DP=2; each adapter and
scale changes the image; adapters fused at start (``--fuse-lora``) write the resident
fused bytes from a private host copy or a runtime-cache entry of their own; an adapter
that cannot do what it says exits 2 in one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_generate_dlo import run_single, torchrun
from tests.support.generate import digest, refused_generate
from tests.support.lora import write_flux_lora
from tests.support.runtime_cache import attached, cache_warm, run_cached
from tests.support.tiny_models import tiny_flux

DLO = ("--enable-distributed-layerwise-offload",)
RANK_LOCAL = (*DLO, "--dlo-no-use-allgather")
PROMPT = ("--prompt", "a red cat", "--width", "32", "--height", "32")


@pytest.fixture(scope="module")
def loras(flux_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter ``a`` as a directory, ``b`` as the file itself (both forms users give)."""
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(flux_model_dir / "transformer")
    root = tmp_path_factory.mktemp("loras")
    a = write_flux_lora(transformer, root / "a", seed=1)
    b = write_flux_lora(transformer, root / "b", seed=2) / "pytorch_lora_weights.safetensors"
    return {"a": a, "b": b}


def _adapter_flags(loras: dict[str, Path], spec: str) -> tuple[str, ...]:
    return {
        "none": (),
        "a": ("--lora", f"a={loras['a']}"),
        # Comma-separated and repeated: both take several adapters.
        "a+b": ("--lora", f"a={loras['a']}:0.7", "--lora", f"b={loras['b']}:-0.5"),
    }[spec]


@pytest.fixture(scope="module")
def resident(
    flux_model_dir: Path, loras: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], str]:
    out = tmp_path_factory.mktemp("resident-lora")
    images = {}
    for spec, seed in (("none", 11), ("a", 11), ("a+b", 11), ("a", 12)):
        path = out / f"{spec}-{seed}.png"
        run_single(flux_model_dir, path, seed, *PROMPT, *_adapter_flags(loras, spec))
        images[(spec, seed)] = digest(path)
    # Each adapter set changes the image: the option took effect.
    assert len({images[(spec, 11)] for spec in ("none", "a", "a+b")}) == 3
    return images


@pytest.mark.parametrize("spec", ["a", "a+b"])
def test_rank_local_dlo_with_adapters_writes_the_resident_bytes(
    spec: str,
    flux_model_dir: Path,
    loras: dict[str, Path],
    resident: dict[tuple[str, int], str],
    tmp_path: Path,
) -> None:
    out = tmp_path / "dlo.png"
    result = run_single(flux_model_dir, out, 11, *PROMPT, *RANK_LOCAL, *_adapter_flags(loras, spec))
    assert digest(out) == resident[(spec, 11)]
    assert result.stderr.count('msg="lora adapter loaded"') == len(spec.split("+"))
    # Adapters kept beside the weights leave the checkpoint mapping shared and untouched.
    assert "host_backing=checkpoint-mmap" in result.stderr
    assert "safe to ignore" not in result.stderr  # diffusers' normal events stay quiet


def test_allgather_dlo_with_an_adapter_writes_each_ranks_resident_bytes(
    flux_model_dir: Path,
    loras: dict[str, Path],
    resident: dict[tuple[str, int], str],
    tmp_path: Path,
) -> None:
    out = tmp_path / "dp.png"
    flags = (*PROMPT, *DLO, "--data-parallel-size", "2", *_adapter_flags(loras, "a"))
    process = torchrun(flux_model_dir, out, tmp_path / "logs", 11, *flags)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    assert digest(out) == resident[("a", 11)]
    assert digest(tmp_path / "dp.dp1.png") == resident[("a", 12)]


def _other_flux_lora(directory: Path, **shape: int) -> Path:
    """An adapter written for a tiny Flux shaped by ``shape`` (the demo's otherwise)."""
    return write_flux_lora(tiny_flux(0, **shape).model, directory, seed=3)


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        ("missing", "does not exist; give a LoRA safetensors file"),
        ("truncated", "cannot load it (OSError: Unable to load weights"),
        ("more blocks", "has no layer for"),
        ("another width", "but FluxPipeline's transformer."),
    ],
)
def test_an_adapter_that_cannot_apply_exits_2_naming_it(
    adapter: str, message: str, flux_model_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    if adapter == "missing":
        path = tmp_path / "nowhere.safetensors"
    elif adapter == "truncated":
        path = tmp_path / "truncated.safetensors"
        path.write_bytes(loras["b"].read_bytes()[:200])
    elif adapter == "more blocks":
        # A Flux of the demo's width with 6 single blocks: its last two have no layer here.
        path = _other_flux_lora(tmp_path / "more", single_blocks=6)
    else:
        # Another model's shapes: twice the demo's attention width.
        path = _other_flux_lora(tmp_path / "wider", single_blocks=4, attention_head_dim=32)
    stderr = refused_generate(
        flux_model_dir, tmp_path / "x.png", *PROMPT, *RANK_LOCAL, "--lora", f"x={path}"
    )
    assert f"--lora x={path}" in stderr
    assert message in stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--quantization", "fp8"), "--lora with --quantization fp8: LoRA adapters wrap"),
        (("--lora", "a=/x:11"), "the scale must be a number from -10 to 10"),
        (("--lora", "a=/y"), "--lora names a more than once; one each"),
    ],
)
def test_lora_options_that_cannot_run_exit_2_before_loading(
    flags: tuple[str, ...],
    message: str,
    flux_model_dir: Path,
    loras: dict[str, Path],
    tmp_path: Path,
) -> None:
    stderr = refused_generate(
        flux_model_dir,
        tmp_path / "x.png",
        *PROMPT,
        *RANK_LOCAL,
        "--lora",
        f"a={loras['a']}",
        *flags,
    )
    assert message in stderr


def test_a_pipeline_without_a_lora_loader_exits_2(
    demo_model_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    stderr = refused_generate(
        demo_model_dir, tmp_path / "x.png", *RANK_LOCAL, "--lora", f"a={loras['a']}"
    )
    assert "--lora: DiTPipeline has no LoRA loader in diffusers; drop --lora" in stderr


def test_use_lora_chooses_the_adapters_of_the_image(
    flux_model_dir: Path,
    loras: dict[str, Path],
    resident: dict[tuple[str, int], str],
    tmp_path: Path,
) -> None:
    """Both adapters loaded; ``--use-lora a`` draws what loading ``a`` alone draws."""
    out = tmp_path / "a.png"
    both = _adapter_flags(loras, "a+b")
    run_single(flux_model_dir, out, 11, *PROMPT, *RANK_LOCAL, *both, "--use-lora", "a:1")
    assert digest(out) == resident[("a", 11)]
    stderr = refused_generate(
        flux_model_dir, tmp_path / "x.png", *PROMPT, *both, "--use-lora", "zzz"
    )
    assert "loras: zzz not loaded; choose from a, b" in stderr


def _fused(loras: dict[str, Path], scale: float = 0.8) -> tuple[str, ...]:
    """Adapter ``a`` fused at ``scale``, ``b`` loaded beside the weights."""
    return ("--lora", f"a={loras['a']}:{scale:g},b={loras['b']}", "--fuse-lora", "a")


@pytest.fixture(scope="module")
def resident_fused(
    flux_model_dir: Path,
    loras: dict[str, Path],
    resident: dict[tuple[str, int], str],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[int, str]:
    """The resident worker's images with ``a`` fused, ``b`` not chosen."""
    out = tmp_path_factory.mktemp("resident-fused")
    images = {}
    for seed in (11, 12):
        path = out / f"{seed}.png"
        run_single(flux_model_dir, path, seed, *PROMPT, *_fused(loras), "--use-lora", "b:0")
        images[seed] = digest(path)
    assert images[11] != resident[("none", 11)]  # the fused adapter took effect
    return images


def test_rank_local_dlo_streams_a_fused_adapter_from_a_private_copy(
    flux_model_dir: Path, loras: dict[str, Path], resident_fused: dict[int, str], tmp_path: Path
) -> None:
    out = tmp_path / "fused.png"
    flags = (*PROMPT, *RANK_LOCAL, *_fused(loras), "--use-lora", "b:0")
    result = run_single(flux_model_dir, out, 11, *flags)
    assert digest(out) == resident_fused[11]
    assert 'msg="lora adapter fused" name=a scale=0.8' in result.stderr
    # The demo's checkpoint maps without --fuse-lora; fusing needs a private copy.
    assert "host_backing=ordinary" in result.stderr


def test_allgather_dlo_streams_a_fused_adapter(
    flux_model_dir: Path, loras: dict[str, Path], resident_fused: dict[int, str], tmp_path: Path
) -> None:
    out = tmp_path / "dp.png"
    flags = (*PROMPT, *DLO, "--data-parallel-size", "2", *_fused(loras), "--use-lora", "b:0")
    process = torchrun(flux_model_dir, out, tmp_path / "logs", 11, *flags)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    assert digest(out) == resident_fused[11]
    assert digest(tmp_path / "dp.dp1.png") == resident_fused[12]


def test_the_runtime_cache_keeps_fused_weights_under_an_identity_of_their_own(
    flux_model_dir: Path,
    loras: dict[str, Path],
    resident_fused: dict[int, str],
    tmp_path: Path,
) -> None:
    """Built from the fused weights (here by a warm Job's ``cache warm``), found again by
    skip-load, and never mapped by a start that fuses another adapter or another scale.
    (Without --fuse-lora the demo's DiT maps its checkpoint, which a fused start never
    does.)"""
    root = tmp_path / "cache"
    chosen = ("--use-lora", "b:0")
    warmed = cache_warm(flux_model_dir, root, *_fused(loras))
    assert warmed.returncode == 0, warmed.stderr
    key = json.loads(warmed.stdout)["key"]
    assert json.loads(warmed.stdout)["result"] == "built"
    warm = run_cached(flux_model_dir, tmp_path / "warm.png", root, *PROMPT, *_fused(loras), *chosen)
    assert attached(warm) == (key, "hit")
    assert "host_backing=runtime-cache" in warm
    # The entry holds it: the DiT is not fused again.
    assert 'msg="lora adapter fused" name=a scale=0.8 layers=0 fused_in_cache=transformer' in warm
    assert digest(tmp_path / "warm.png") == resident_fused[11]
    rescaled = run_cached(
        flux_model_dir, tmp_path / "rescaled.png", root, *PROMPT, *_fused(loras, 0.5), *chosen
    )
    other = (*_fused(loras)[:2], "--fuse-lora", "b", "--use-lora", "a:0")
    other_adapter = run_cached(flux_model_dir, tmp_path / "other.png", root, *PROMPT, *other)
    starts = [attached(log) for log in (rescaled, other_adapter)]
    assert [result for _, result in starts] == ["built", "built"]
    assert len({key, *(other_key for other_key, _ in starts)}) == 3
    assert len({digest(tmp_path / f"{name}.png") for name in ("warm", "rescaled", "other")}) == 3


def test_an_adapter_above_the_rank_limit_exits_2_unless_fused(
    flux_model_dir: Path, loras: dict[str, Path], resident_fused: dict[int, str], tmp_path: Path
) -> None:
    """The demo adapters have rank 4: a limit of 2 refuses them beside the weights, and
    leaves fusing (which costs nothing per step) alone."""
    limit = ("--max-lora-rank", "2")
    stderr = refused_generate(
        flux_model_dir, tmp_path / "x.png", *PROMPT, *RANK_LOCAL, *_fused(loras), *limit
    )
    assert f"--lora b={loras['b']}:1: its rank is 4, above --max-lora-rank 2" in stderr
    out = tmp_path / "fused.png"
    only_fused = ("--lora", f"a={loras['a']}:0.8", "--fuse-lora", "a")
    run_single(flux_model_dir, out, 11, *PROMPT, *RANK_LOCAL, *only_fused, *limit)
    assert digest(out) == resident_fused[11]


def test_requests_cannot_choose_a_fused_adapter_nor_fuse_one_not_loaded(
    flux_model_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    stderr = refused_generate(
        flux_model_dir, tmp_path / "x.png", *PROMPT, *_fused(loras), "--use-lora", "a"
    )
    assert "loras: a fused into the weights at start (--fuse-lora) and always applied" in stderr
    stderr = refused_generate(
        flux_model_dir, tmp_path / "x.png", *PROMPT, "--lora", f"a={loras['a']}", "--fuse-lora", "b"
    )
    assert "--fuse-lora b: no --lora adapter has that name" in stderr
