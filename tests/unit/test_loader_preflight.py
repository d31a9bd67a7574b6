"""Checkpoint mmap preflight and the fused-QKV adapter, over described checkpoints (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlo_worker.config import build_config
from dlo_worker.loader.adapters import FusedQKVAdapter, RowRange, TensorSpec
from dlo_worker.loader.checkpoint import CheckpointError, CheckpointIndex, CheckpointTensor
from dlo_worker.loader.preflight import rejection, resolve_sources

F32 = torch.float32
FILE = Path("/models/dit/transformer/diffusion_pytorch_model.safetensors")


def checkpoint(**tensors: tuple[tuple[int, ...], torch.dtype]) -> CheckpointIndex:
    described = {
        key.replace("__", "."): CheckpointTensor(key.replace("__", "."), FILE, dtype, shape)
        for key, (shape, dtype) in tensors.items()
    }
    return CheckpointIndex(FILE.parent, (FILE,), described)


def runtime(**specs: tuple[int, ...]) -> dict[str, TensorSpec]:
    return {key.replace("__", "."): TensorSpec(shape, F32) for key, shape in specs.items()}


def dlo_backings():
    """The host backings of a default DLO configuration, most preferred first."""
    config = build_config(
        {"model": {}, "parallel": {}, "offload": {"enable_distributed_layerwise_offload": True}}
    )
    return config.effective().host_backing_candidates


ATTENTION = runtime(
    attn__to_q__weight=(8, 8),
    attn__to_k__weight=(4, 8),
    attn__to_v__weight=(4, 8),
    attn__to_q__bias=(8,),
    attn__to_k__bias=(4,),
    attn__to_v__bias=(4,),
)


def test_matching_names_bind_directly_and_pass() -> None:
    found = checkpoint(norm__weight=((8,), F32), proj__weight=((8, 8), F32))
    resolution = resolve_sources(runtime(norm__weight=(8,), proj__weight=(8, 8)), found)
    assert set(resolution.bindings) == {"norm.weight", "proj.weight"}
    assert resolution.bindings["proj.weight"].source.rows is None
    assert resolution.adapters == ()
    assert rejection(dlo_backings(), resolution) is None


def test_fused_qkv_splits_rows_in_q_k_v_order_with_grouped_kv() -> None:
    found = checkpoint(attn__to_qkv__weight=((16, 8), F32), attn__to_qkv__bias=((16,), F32))
    resolution = resolve_sources(ATTENTION, found)
    rows = {name: binding.source.rows for name, binding in resolution.bindings.items()}
    assert rows == {
        "attn.to_q.weight": RowRange(0, 8),
        "attn.to_k.weight": RowRange(8, 12),
        "attn.to_v.weight": RowRange(12, 16),
        "attn.to_q.bias": RowRange(0, 8),
        "attn.to_k.bias": RowRange(8, 12),
        "attn.to_v.bias": RowRange(12, 16),
    }
    assert resolution.adapters == ("fused-qkv",)
    assert resolution.unused == []
    assert rejection(dlo_backings(), resolution) is None


def test_fused_qkv_with_the_wrong_row_count_does_not_apply() -> None:
    found = checkpoint(attn__to_qkv__weight=((15, 8), F32))
    assert FusedQKVAdapter().resolve("attn.to_q.weight", ATTENTION, found) is None


def test_a_tensor_with_two_sources_is_ambiguous() -> None:
    weights = {name: spec for name, spec in ATTENTION.items() if name.endswith("weight")}
    found = checkpoint(attn__to_q__weight=((8, 8), F32), attn__to_qkv__weight=((16, 8), F32))
    resolution = resolve_sources(weights, found)
    assert resolution.ambiguous == ["attn.to_q.weight"]
    refused = rejection(dlo_backings(), resolution)
    assert refused.code == "ambiguous"


def test_missing_sources_reject_with_the_first_name() -> None:
    resolution = resolve_sources(runtime(a=(2,), b=(2,)), checkpoint(a=((2,), F32)))
    refused = rejection(dlo_backings(), resolution)
    assert refused.code == "missing"
    assert "1 (first: 'b')" in refused.message


def test_a_source_with_foreign_tensors_falls_back_as_a_unit() -> None:
    found = checkpoint(a=((2,), F32), text_encoder__weight=((2,), F32))
    refused = rejection(dlo_backings(), resolve_sources(runtime(a=(2,)), found))
    assert refused.code == "mixed"
    assert "text_encoder.weight" in refused.message
    assert "as a unit" in refused.message


def test_a_dtype_conversion_is_left_to_the_ordinary_loader() -> None:
    found = checkpoint(a=((2,), torch.bfloat16))
    refused = rejection(dlo_backings(), resolve_sources(runtime(a=(2,)), found))
    assert refused.code == "dtype"
    assert "stores bfloat16 but the runtime dtype is float32" in refused.message


def test_a_shape_that_contradicts_the_config_is_an_error() -> None:
    with pytest.raises(CheckpointError, match=r"has shape \[3\] but the model's config.json"):
        resolve_sources(runtime(a=(2,)), checkpoint(a=((3,), F32)))


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"model": {"quantization": "fp8"}}, "no online quantization"),
        ({"parallel": {"tensor_parallel_size": 2}}, "TP 1"),
    ],
)
def test_topology_and_quantization_keep_the_ordinary_path(sections: dict, named: str) -> None:
    values = {
        "model": {},
        "parallel": {},
        "offload": {"enable_distributed_layerwise_offload": True, "dlo_use_allgather": False},
    }
    for section, fields in sections.items():
        values[section] = {**values[section], **fields}
    resolution = resolve_sources(runtime(a=(2,)), checkpoint(a=((2,), F32)))
    refused = rejection(build_config(values).effective().host_backing_candidates, resolution)
    assert refused.code == "topology"
    assert named in refused.message
