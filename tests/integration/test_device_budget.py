"""``--max-gpu-memory-gib`` on the Flux demo (CLIP, T5, DiT, VAE) as a user runs
``generate``: the component sizes it plans with match the loaded pipeline; a budget that
holds everything runs resident, a smaller one streams the DiT, a smaller one T5 too, and
each image is bitwise the resident one; a budget nothing fits is refused naming the one
that would; ``--dlo-stream-text-encoders`` streams T5 on request and refuses CLIP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dlo_worker.loader.component_bytes import component_bytes
from dlo_worker.loader.device_plan import GIB, ComponentBytes, budget_holding
from tests.support.generate import digest, refused_generate, run_generate

PROMPT = ["--prompt", "a red cat", "--width", "64", "--height", "64"]
DITS = ("transformer", "transformer_2")


@pytest.fixture(scope="module")
def sizes(flux_model_dir: Path) -> dict[str, ComponentBytes]:
    return {c.name: c for c in component_bytes(flux_model_dir, torch.float32, dits=DITS)}


@pytest.fixture(scope="module")
def resident_digest(flux_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("resident") / "cat.png"
    result = run_generate(flux_model_dir, out, 1, *PROMPT)
    assert result.returncode == 0, result.stderr
    return digest(out)


def budget_flag(weights: int) -> list[str]:
    """The smallest budget holding ``weights`` beside the activation reserve."""
    return ["--max-gpu-memory-gib", f"{(budget_holding(weights) + 64) / GIB:.12f}"]


def log_fields(stderr: str, message: str) -> dict[str, str]:
    line = next(line for line in stderr.splitlines() if f'msg="{message}"' in line)
    return dict(re.findall(r"(\S+?)=(\"[^\"]*\"|\S+)", line))


def test_component_sizes_are_what_the_loaded_pipeline_holds(
    flux_model_dir: Path, sizes: dict[str, ComponentBytes]
) -> None:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(str(flux_model_dir), dtype=torch.float32)
    for name, size in sizes.items():
        module = getattr(pipeline, name)
        held = sum(t.nbytes for t in module.state_dict().values())
        # Tied weights (T5's shared embedding) appear twice in a state dict, once on disk.
        unique = {t.data_ptr(): t.nbytes for t in module.state_dict().values()}
        assert size.total in (held, sum(unique.values())), name
    t5 = pipeline.text_encoder_2
    assert len(sizes["text_encoder_2"].blocks) == len(t5.encoder.block)
    assert sizes["text_encoder_2"].blocks[0] == sum(
        p.nbytes for p in t5.encoder.block[0].parameters()
    )
    transformer = pipeline.transformer
    assert len(sizes["transformer"].blocks) == len(transformer.transformer_blocks) + len(
        transformer.single_transformer_blocks
    )
    assert sizes["text_encoder"].blocks == ()
    assert sizes["vae"].blocks == ()


def test_each_budget_places_what_fits_and_draws_the_resident_image(
    flux_model_dir: Path,
    sizes: dict[str, ComponentBytes],
    resident_digest: str,
    tmp_path: Path,
) -> None:
    dit, t5 = sizes["transformer"], sizes["text_encoder_2"]
    everything = sum(c.total for c in sizes.values())
    others = everything - dit.total
    dit_streamed = others + dit.non_block + 2 * max(dit.blocks)
    t5_streamed = dit_streamed - t5.total + t5.non_block
    assert t5_streamed < dit_streamed < everything
    expected = {
        "resident": (everything, None, "resident"),
        "dit": (dit_streamed, "streamed", "resident"),
        "dit-and-t5": (t5_streamed, "streamed", "streamed"),
    }
    for case, (weights, dit_placement, t5_placement) in expected.items():
        out = tmp_path / f"{case}.png"
        result = run_generate(flux_model_dir, out, 1, *PROMPT, *budget_flag(weights))
        assert result.returncode == 0, result.stderr
        assert digest(out) == resident_digest, case
        plan = log_fields(result.stderr, "device memory plan")
        assert plan["placement.text_encoder_2"] == t5_placement, case
        assert plan["placement.text_encoder"] == plan["placement.vae"] == "resident"
        if dit_placement is None:
            assert plan["placement.transformer"] == "resident"
            assert 'msg="dlo enabled"' not in result.stderr
            continue
        assert plan["placement.transformer"] == dit_placement
        enabled = log_fields(result.stderr, "dlo enabled")
        t5_blocks = len(t5.blocks) if t5_placement == "streamed" else 0
        total_blocks = len(dit.blocks) + t5_blocks
        streamed = int(enabled["streamed_blocks"])
        assert streamed + int(enabled["resident_blocks"]) == total_blocks, case
        assert streamed >= t5_blocks


def test_a_budget_nothing_fits_is_refused_naming_one_that_does(
    flux_model_dir: Path, sizes: dict[str, ComponentBytes], resident_digest: str, tmp_path: Path
) -> None:
    stderr = refused_generate(
        flux_model_dir, tmp_path / "none.png", *PROMPT, "--max-gpu-memory-gib", "0.001"
    )
    assert "--max-gpu-memory-gib 0.001: even with transformer, text_encoder_2 streamed" in stderr
    needed = re.search(r"raise it to at least ([0-9.]+) GiB", stderr)
    assert needed is not None, stderr
    out = tmp_path / "needed.png"
    result = run_generate(flux_model_dir, out, 1, *PROMPT, "--max-gpu-memory-gib", needed.group(1))
    assert result.returncode == 0, result.stderr
    assert digest(out) == resident_digest


def test_t5_streams_on_request_and_clip_is_refused(
    flux_model_dir: Path, sizes: dict[str, ComponentBytes], resident_digest: str, tmp_path: Path
) -> None:
    out = tmp_path / "t5.png"
    dlo = ["--enable-distributed-layerwise-offload", "--dlo-stream-text-encoders"]
    result = run_generate(flux_model_dir, out, 1, *PROMPT, *dlo, "text_encoder_2")
    assert result.returncode == 0, result.stderr
    assert digest(out) == resident_digest
    streamed = len(sizes["transformer"].blocks) + len(sizes["text_encoder_2"].blocks)
    assert log_fields(result.stderr, "dlo enabled")["streamed_blocks"] == str(streamed)
    stderr = refused_generate(flux_model_dir, tmp_path / "clip.png", *PROMPT, *dlo, "text_encoder")
    assert "--dlo-stream-text-encoders names 'text_encoder', a CLIPTextModel" in stderr
    assert "it streams T5EncoderModel" in stderr
