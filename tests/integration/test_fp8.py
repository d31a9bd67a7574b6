"""FP8 weight streaming (``--quantization fp8``): DLO rank-local and AllGather over real
gloo groups are bitwise equal to the same FP8 model resident, the streamed bytes shrink
to one byte per linear weight, and ``generate`` writes the resident FP8 bytes."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dlo_worker.offload import enable_dlo
from dlo_worker.pipeline.quantization import (
    Float8Linear,
    quantize_blocks_fp8,
    quantized_skeleton,
    read_scales,
)
from tests.support.checkpoints import copy_pipeline
from tests.support.generate import ENV, digest, generate_argv
from tests.support.ranks import spawn_ranks
from tests.support.runtime_cache import (
    SEED,
    attached,
    cache_warm,
    garble_tensor_data,
    run_cached,
)
from tests.support.tiny_models import tiny_flux, tiny_wan

CPU = torch.device("cpu")
BUILDERS = {"flux": tiny_flux, "wan": tiny_wan}


def _quantized(name: str, dtype: torch.dtype = torch.float32):
    case = BUILDERS[name](0)
    case.model.to(dtype)
    case.inputs = {
        key: value.to(dtype) if value.is_floating_point() else value
        for key, value in case.inputs.items()
    }
    assert quantize_blocks_fp8(case.model) > 0
    return case


def _forward(case) -> torch.Tensor:
    with torch.no_grad():
        return [case.model(**case.inputs, return_dict=False)[0] for _ in range(2)][-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_rank_local_fp8_streaming_is_bitwise_equal_to_fp8_resident(
    name: str, dtype: torch.dtype
) -> None:
    expected = _forward(_quantized(name, dtype))
    case = _quantized(name, dtype)
    backend = enable_dlo(case.model, device=CPU, use_allgather=False)
    try:
        actual = _forward(case)
        layouts = backend.block_layouts()
    finally:
        backend.disable()
    assert torch.equal(actual, expected)
    # The blocks stream their linear weights as FP8 (one byte each) beside the rest.
    assert all(torch.float8_e4m3fn in layout.by_dtype for layout in layouts)


def test_fp8_halves_the_streamed_bytes_of_a_bf16_dit() -> None:
    def streamed_bytes(quantize: bool) -> int:
        case = BUILDERS["flux"](0)
        case.model.to(torch.bfloat16)
        if quantize:
            quantize_blocks_fp8(case.model)
        backend = enable_dlo(case.model, device=CPU, use_allgather=False)
        try:
            return sum(layout.nbytes for layout in backend.block_layouts())
        finally:
            backend.disable()

    full, fp8 = streamed_bytes(False), streamed_bytes(True)
    # Linear weights are nearly all of a block; biases and norms stay bf16 (and alignment).
    assert 0.45 < fp8 / full < 0.6, (fp8, full)


def test_fp8_output_stays_close_to_the_unquantized_output() -> None:
    """Per-tensor scales keep the tiny DiT's output within a few percent (the demo's PSNR
    is in docs/configuration.md); a wrong scale or a saturating cast would not."""
    reference = BUILDERS["flux"](0)
    with torch.no_grad():
        unquantized = reference.model(**reference.inputs, return_dict=False)[0]
    fp8 = _forward(_quantized("flux"))
    relative = (fp8 - unquantized).norm() / unquantized.norm()
    assert torch.isfinite(fp8).all()
    assert 0 < relative < 0.05, relative


def test_a_linear_is_quantized_per_tensor_and_never_overflows() -> None:
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight[0, 0] = 1000.0  # the amax sets the scale
        linear.weight[1] = 0.0
    fp8 = Float8Linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn
    assert isinstance(fp8.weight_scale, float)
    assert fp8.weight_scale == pytest.approx(1000.0 / 448, rel=0.01)
    dequantized = fp8.dequantized_weight(torch.float32)
    assert torch.isfinite(dequantized).all()
    assert dequantized[0, 0].item() == pytest.approx(1000.0, rel=0.01)
    assert torch.equal(dequantized[1], torch.zeros(64))
    zero = Float8Linear(nn.Linear(4, 4, bias=False).requires_grad_(False).apply(_zero))
    assert zero.weight_scale == 1.0
    assert torch.equal(zero(torch.ones(1, 4)), torch.zeros(1, 4))
    # The scale is also state (a runtime-cache entry holds it), exactly the same float32.
    assert fp8.state_dict()["scale"].dtype == torch.float32
    assert fp8.scale.item() == fp8.weight_scale


def test_a_skeleton_gets_the_fp8_structure_and_its_scales_once_bound() -> None:
    with torch.device("meta"):
        skeleton = Float8Linear(nn.Linear(64, 32))
    assert skeleton.weight.is_meta
    assert skeleton.weight.dtype == torch.float8_e4m3fn
    assert math.isnan(skeleton.weight_scale)  # a forward now could only give NaN
    case = _quantized("flux")
    expected = _forward(case)
    bound = BUILDERS["flux"](0).model.to("meta")
    quantized_skeleton(bound)
    scales = [layer for layer in bound.modules() if isinstance(layer, Float8Linear)]
    assert scales
    assert all(math.isnan(layer.weight_scale) for layer in scales)
    bound.load_state_dict(case.model.state_dict(), assign=True)
    read_scales(bound)
    case.model = bound
    assert torch.equal(_forward(case), expected)


def _zero(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.weight.zero_()


def _allgather_rank(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        for name in BUILDERS:
            expected = _forward(_quantized(name))
            case = _quantized(name)
            backend = enable_dlo(case.model, device=CPU, process_group=dist.group.WORLD)
            try:
                actual = _forward(case)
                stats = backend.stats()
            finally:
                backend.disable()
            assert stats.shards == 2, name
            assert torch.equal(actual, expected), name
    finally:
        dist.destroy_process_group()


def test_fp8_allgather_over_gloo_is_bitwise_equal_to_fp8_resident(tmp_path: Path) -> None:
    spawn_ranks(_allgather_rank, (str(tmp_path / "store"),), 2)


def test_generate_with_fp8_and_dlo_writes_the_fp8_resident_bytes(
    flux_model_dir: Path, tmp_path: Path
) -> None:
    fox = ["--prompt", "a red fox", "--width", "64", "--height", "64", "--quantization", "fp8"]

    def generate(out: Path, *flags: str) -> str:
        argv = generate_argv(flux_model_dir, out, 3, *fox, *flags)
        result = subprocess.run(
            argv, env=ENV, capture_output=True, text=True, timeout=600, check=False
        )
        assert result.returncode == 0, result.stderr
        return result.stdout + result.stderr

    resident = generate(tmp_path / "resident.png")
    streamed = generate(tmp_path / "dlo.png", "--enable-distributed-layerwise-offload")
    assert digest(tmp_path / "dlo.png") == digest(tmp_path / "resident.png")
    for log in (resident, streamed):
        assert 'msg="fp8 weights"' in log
    # FP8 weights are a transform of the checkpoint: DLO packs them, never maps the file.
    assert "host backing: ordinary" in streamed


def test_fp8_weights_stream_from_the_runtime_cache_and_a_warm_start_reads_no_checkpoint(
    mixed_model: Path, tmp_path: Path
) -> None:
    """The entry is built from the quantized DiT (FP8 block weights, their scales): DLO
    stages it through the ring and writes the resident FP8 bytes; the next start binds an
    FP8 skeleton to it without reading (or quantizing) the checkpoint; bf16 is another entry."""
    fp8 = ("--quantization", "fp8")
    resident = subprocess.run(
        generate_argv(mixed_model, tmp_path / "resident.png", SEED, *fp8),
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    assert resident.returncode == 0, resident.stderr
    model = copy_pipeline(mixed_model, tmp_path / "model")
    root = tmp_path / "cache"
    cold = run_cached(model, tmp_path / "cold.png", root, *fp8)
    key, result = attached(cold)
    assert result == "built"
    assert "host_backing=runtime-cache" in cold
    assert "staging=ring" in cold
    manifest = json.loads((root / "entries" / key / "manifest.json").read_text())
    stored = {
        dtype
        for component in manifest["components"].values()
        for block in component["blocks"]
        for dtype in block["dtypes"]
    }
    assert "float8_e4m3fn" in stored
    assert digest(tmp_path / "cold.png") == digest(tmp_path / "resident.png")

    garble_tensor_data(model / "transformer" / "diffusion_pytorch_model.safetensors")
    warm = run_cached(model, tmp_path / "warm.png", root, *fp8)
    assert attached(warm) == (key, "hit")
    assert 'msg="fp8 weights" linears=0' in warm  # bound to the entry's FP8 weights
    assert digest(tmp_path / "warm.png") == digest(tmp_path / "resident.png")

    # Unquantized (the foreign tensor keeps the checkpoint mapping out).
    bf16 = run_cached(mixed_model, tmp_path / "bf16.png", root)
    assert attached(bf16)[0] != key

    # A warm Job builds the FP8 entry; the worker's first start is then a hit.
    warmed = cache_warm(mixed_model, tmp_path / "warmed", *fp8)
    assert warmed.returncode == 0, warmed.stderr
    assert json.loads(warmed.stdout)["result"] == "built"
    hit = run_cached(mixed_model, tmp_path / "hit.png", tmp_path / "warmed", *fp8)
    assert attached(hit)[1] == "hit"
    assert digest(tmp_path / "hit.png") == digest(tmp_path / "resident.png")


def test_scales_are_read_from_the_blocks_under_the_configured_block_paths() -> None:
    """Issue 62: ``read_scales`` discovered the DiT without ``--dlo-block-paths``, so a DiT
    whose blocks only those paths name failed at start under ``--quantization fp8``
    (``DiscoveryError``)."""
    model = nn.Module()
    model.backbone = nn.Module()
    model.backbone.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8)) for _ in range(2)])
    paths = ["backbone.blocks"]
    assert quantize_blocks_fp8(model, paths) == 2
    layers = [layer for layer in model.modules() if isinstance(layer, Float8Linear)]
    expected = [layer.weight_scale for layer in layers]
    for layer in layers:  # as bound to a runtime-cache entry: the scale is only a buffer
        layer.weight_scale = math.nan
    read_scales(model, paths)
    assert [layer.weight_scale for layer in layers] == expected
