"""Where a pipeline call's time goes: the stages timed by forward hooks on the Flux demo,
which leave the image as it is and are gone after the call, and ``generate``'s log line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dlo_worker.engine.stages import timed_stages
from tests.support.generate import run_generate


def test_text_encoding_denoising_and_decode_are_timed_without_changing_the_image(
    flux_model_dir: Path,
) -> None:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(str(flux_model_dir), dtype=torch.float32)
    hooks_before = {
        name: (len(m._forward_pre_hooks), len(m._forward_hooks))
        for name, m in pipeline.transformer.named_modules()
    }

    def call() -> np.ndarray:
        generator = torch.Generator().manual_seed(0)
        arguments = {"num_inference_steps": 2, "height": 64, "width": 64, "output_type": "np"}
        return pipeline("a red cat", generator=generator, **arguments).images

    untimed = call()
    with timed_stages(pipeline) as seconds:
        timed = call()
    assert set(seconds) == {"text_encoding", "denoising", "decode"}
    assert all(value > 0 for value in seconds.values()), seconds
    assert np.array_equal(timed, untimed)
    assert hooks_before == {
        name: (len(m._forward_pre_hooks), len(m._forward_hooks))
        for name, m in pipeline.transformer.named_modules()
    }
    assert not pipeline.vae.decoder._forward_hooks
    assert not pipeline.text_encoder_2._forward_pre_hooks


def test_generate_logs_each_stage(flux_model_dir: Path, tmp_path: Path) -> None:
    prompt = ["--prompt", "a red cat", "--width", "64", "--height", "64"]
    result = run_generate(flux_model_dir, tmp_path / "cat.png", 0, *prompt)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if 'msg="request stages"' in line]
    for stage in ("text_encoding_s=", "denoising_s=", "decode_s="):
        assert stage in line
