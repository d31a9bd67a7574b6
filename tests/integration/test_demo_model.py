"""The built-in demo model: a real diffusers DiT pipeline, deterministic and offline."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlo_worker.pipeline.demo_model import DemoModelExistsError, write_demo_model
from tests.support.in_process import run_dlo_worker


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_same_seed_writes_the_same_bytes(demo_model_dir: Path, tmp_path: Path) -> None:
    again = write_demo_model(tmp_path / "again", seed=0)
    assert tree_digest(again) == tree_digest(demo_model_dir)


def test_another_seed_writes_other_weights(demo_model_dir: Path, tmp_path: Path) -> None:
    other = tree_digest(write_demo_model(tmp_path / "other", seed=1))
    ours = tree_digest(demo_model_dir)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert other[weights] != ours[weights]
    assert other["transformer/config.json"] == ours["transformer/config.json"]


def test_is_a_diffusers_dit_pipeline_with_safetensors(demo_model_dir: Path) -> None:
    index = json.loads((demo_model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "DiTPipeline"
    assert index["transformer"] == ["diffusers", "DiTTransformer2DModel"]
    assert (demo_model_dir / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert not list(demo_model_dir.rglob("*.bin"))


def test_loads_with_no_network(demo_model_dir: Path) -> None:
    """from_pretrained in a process whose every connection goes to a closed local port."""
    probe = (
        "import sys\n"
        "from diffusers import DiffusionPipeline\n"
        "pipe = DiffusionPipeline.from_pretrained(sys.argv[1])\n"
        "print(type(pipe).__name__, len(pipe.transformer.transformer_blocks))\n"
    )
    dead_proxy = "http://127.0.0.1:9"
    env = {
        **os.environ,
        "HTTP_PROXY": dead_proxy,
        "HTTPS_PROXY": dead_proxy,
        "ALL_PROXY": dead_proxy,
        "http_proxy": dead_proxy,
        "https_proxy": dead_proxy,
        "NO_PROXY": "",
        "no_proxy": "",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run(
        [sys.executable, "-c", probe, str(demo_model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    pipeline_class, block_count = result.stdout.split()
    assert pipeline_class == "DiTPipeline"
    assert int(block_count) >= 8


def test_refuses_to_overwrite_a_non_empty_directory(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    with pytest.raises(DemoModelExistsError, match="--overwrite"):
        write_demo_model(target)
    assert (target / "keep.txt").read_text() == "user data"


def test_overwrite_replaces_the_directory_whole(tmp_path: Path, demo_model_dir: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    write_demo_model(target, overwrite=True)
    assert tree_digest(target) == tree_digest(demo_model_dir)


def test_leaves_no_staging_directory_behind(tmp_path: Path) -> None:
    write_demo_model(tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_the_full_size_flux_has_flux_dev_sizes() -> None:
    """FLUX.1-dev's parameter counts, built on the meta device (no memory)."""
    import torch

    from dlo_worker.pipeline.demo_model import FLUX_DEV_SHAPE, build_demo_flux_pipeline

    with torch.device("meta"):
        pipeline = build_demo_flux_pipeline(0, FLUX_DEV_SHAPE)
    counts = {
        name: sum(p.numel() for p in getattr(pipeline, name).parameters())
        for name in ("transformer", "text_encoder", "text_encoder_2", "vae")
    }
    assert round(counts["transformer"] / 1e9, 1) == 11.9
    assert round(counts["text_encoder_2"] / 1e9, 2) == 4.76
    assert round(counts["text_encoder"] / 1e6) == 123
    assert round(counts["vae"] / 1e6, 1) == 83.8
    assert len(pipeline.transformer.transformer_blocks) == 19
    assert len(pipeline.transformer.single_transformer_blocks) == 38
    assert len(pipeline.text_encoder_2.encoder.block) == 24


def test_sharded_checkpoints_with_index_files_draw_the_same_image(
    flux_model_dir: Path, tmp_path: Path
) -> None:
    """Every model component split into shards with an index (as published checkpoints
    are, text encoders included) loads, streams and draws what one file each draws."""
    from tests.support.generate import digest, run_generate

    sharded = tmp_path / "sharded"
    shards = ["--max-shard-size", "40KB", "--weights", "random"]  # the fixture's weights
    written = run_dlo_worker(["demo-model", str(sharded), "--kind", "flux", *shards])
    assert written.returncode == 0, written.stderr
    for component, name in (
        ("transformer", "diffusion_pytorch_model"),
        ("vae", "diffusion_pytorch_model"),
        ("text_encoder", "model"),
        ("text_encoder_2", "model"),
    ):
        index = json.loads((sharded / component / f"{name}.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2, component
        assert not (sharded / component / f"{name}.safetensors").exists()
    prompt = ["--prompt", "a red cat", "--width", "64", "--height", "64"]
    images = {}
    for label, model, flags in (
        ("one file", flux_model_dir, []),
        ("sharded", sharded, []),
        (
            "sharded, streamed",
            sharded,
            [
                "--enable-distributed-layerwise-offload",
                "--dlo-stream-text-encoders",
                "text_encoder_2",
            ],
        ),
    ):
        out = tmp_path / f"{label}.png"
        result = run_generate(model, out, 1, *prompt, *flags)
        assert result.returncode == 0, result.stderr
        images[label] = digest(out)
    assert len(set(images.values())) == 1, images


def test_sizes_a_kind_does_not_have_and_bad_shard_sizes_are_refused(tmp_path: Path) -> None:
    for flags, expected in (
        (["--kind", "dit", "--size", "full"], "--size full exists for --kind flux"),
        (["--kind", "flux", "--max-shard-size", "5 gigs"], "is not a size"),
    ):
        result = run_dlo_worker(["demo-model", str(tmp_path / "m"), *flags])
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "m").exists()
