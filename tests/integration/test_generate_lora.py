"""``dlo-worker generate --lora`` on the Flux demo (CPU): adapters loaded at start write
the resident bytes under DLO, rank-local and with AllGather over DP=2; each adapter and
scale changes the image; an adapter that cannot do what it says exits 2 in one line
naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_generate_dlo import run_single, torchrun
from tests.support.generate import digest, refused_generate
from tests.support.lora import write_flux_lora
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
        ("another width", "cannot load it"),
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
        (("--compile",), "--lora with --compile is not run by this worker release"),
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
