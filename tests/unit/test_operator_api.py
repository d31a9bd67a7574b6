"""The DiffusionDeployment API: generated CRD in sync, structural, and the worker's own rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from dlo_operator.api import DiffusionDeploymentSpec
from dlo_operator.crd import (
    CHART_TEMPLATE,
    custom_resource_definition,
    render_chart_template,
    render_yaml,
)
from dlo_operator.workerconfig import InvalidSpecError, validate, worker_config
from dlo_worker.config import TransferMode, to_flags
from tests.support.deployments import deployment_spec

CRD_FILE = Path(__file__).parents[2] / "crds" / "diffusiondeployments.dlo.dev.yaml"


def spec(**overrides: Any) -> DiffusionDeploymentSpec:
    return deployment_spec(**overrides)


def test_committed_crd_matches_the_models() -> None:
    assert CRD_FILE.read_text() == render_yaml(), (
        "crds/ is stale: run python -m dlo_operator.crd > crds/diffusiondeployments.dlo.dev.yaml"
    )


def test_chart_crd_template_matches_the_models() -> None:
    chart_crd = Path(__file__).parents[2] / CHART_TEMPLATE
    assert chart_crd.read_text() == render_chart_template(), (
        "the chart's CRD is stale: run python -m dlo_operator.crd --chart > " + CHART_TEMPLATE
    )


def _walk(node: Any):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _undescribed(node: dict[str, Any], path: str) -> list[str]:
    missing = [] if "description" in node else [path.removeprefix("diffusiondeployment")]
    for name, child in node.get("properties", {}).items():
        missing += _undescribed(child, f"{path}.{name}")
    if "items" in node:
        missing += [
            p for p in _undescribed(node["items"], f"{path}[]") if "properties" in node["items"]
        ]
    return missing


def test_kubectl_explain_describes_every_field() -> None:
    """``kubectl explain`` shows a field's description: every field, spec and status,
    and each object's fields within lists, has one."""
    schema = custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _undescribed(schema, "diffusiondeployment") == [".metadata"]  # ObjectMeta's own


def test_schema_is_structural() -> None:
    schema = custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for node in _walk(schema):
        assert "$ref" not in node
        assert "anyOf" not in node
        assert node.get("additionalProperties") is not False
        if "properties" in node:
            assert node.get("type") == "object"
    assert yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["subresources"]["scale"]


def test_spec_maps_onto_the_worker_configuration() -> None:
    config = worker_config(spec())
    assert config.parallel.data_parallel_size == 2
    assert config.model.model == Path("/models/model")
    assert config.effective().transfer_mode == TransferMode.ALLGATHER


def test_model_baked_into_the_image_is_used_in_place() -> None:
    config = worker_config(spec(model={"imagePath": "/opt/models/dit"}))
    assert config.model.model == Path("/opt/models/dit")


def test_invalid_dlo_combination_carries_the_workers_message() -> None:
    with pytest.raises(InvalidSpecError) as error:
        validate(spec(parallelism={"sequence": 2, "hsdp": {"enabled": True}}))
    # In the CRD's terms: the message named the worker's flags (--use-hsdp, add
    # --dlo-no-use-allgather), which a DiffusionDeployment's author never writes.
    assert str(error.value) == (
        "parallelism.hsdp.enabled: true cannot be combined with DLO AllGather: HSDP already "
        "shards the parameters and DLO would shard them twice; add offload.useAllGather: false"
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"parallelism": {"data": 2, "tensor": 2}}, "tensor parallelism needs"),
        (
            {"quantization": "int8", "offload": {"useAllGather": False}},
            "quantization int8 is not executed by this worker release",
        ),
    ],
)
def test_valid_but_not_yet_executable_specs_are_refused(fields: dict, named: str) -> None:
    """The worker would exit at start-up; the operator says so instead of crash-looping Pods."""
    with pytest.raises(InvalidSpecError, match=named):
        validate(spec(**fields))


def test_runtime_cache_needs_no_allgather_per_the_worker() -> None:
    with pytest.raises(
        InvalidSpecError,
        match=r"offload\.runtimeCache\.enabled: true requires offload\.useAllGather: false",
    ):
        validate(spec(offload={"runtimeCache": {"enabled": True}}))


def test_shard_buffers_reach_the_worker_and_are_refused_without_allgather() -> None:
    config = worker_config(spec(offload={"allGatherShardBuffers": 6}))
    assert config.offload.dlo_allgather_shard_buffers == 6
    with pytest.raises(InvalidSpecError, match=r"offload\.allGatherShardBuffers applies only"):
        validate(spec(offload={"useAllGather": False, "allGatherShardBuffers": 6}))


def test_staging_reaches_the_worker_and_a_chunk_size_for_buffers_is_refused() -> None:
    staging = {"mode": "ring", "chunkMiB": 8, "packThreads": 6}
    config = worker_config(spec(offload={"useAllGather": False, "staging": staging}))
    assert config.offload.dlo_staging == "ring"
    assert config.offload.dlo_staging_chunk_mib == 8
    assert config.offload.dlo_pack_threads == 6
    assert worker_config(spec()).offload.dlo_staging == "auto"
    with pytest.raises(
        InvalidSpecError,
        match=r"offload\.staging\.chunkMiB sizes the staging ring's chunks, but "
        r"offload\.staging\.mode buffers",
    ):
        validate(spec(offload={"staging": {"mode": "buffers", "chunkMiB": 8}}))


def test_the_cache_size_budget_and_skip_load_reach_the_worker() -> None:
    cache = {"enabled": True, "sizeBudgetGiB": 200, "skipLoad": "required"}
    config = worker_config(spec(offload={"useAllGather": False, "runtimeCache": cache}))
    assert config.offload.dlo_runtime_cache_size_budget_gib == 200
    assert config.offload.dlo_runtime_cache_skip_load == "required"


def test_memory_limit_must_hold_the_pinned_budget_and_shm() -> None:
    cache = {"useAllGather": False, "runtimeCache": {"enabled": True, "pinLimitGiB": 40}}
    with pytest.raises(InvalidSpecError, match=r"resources\.memory 64Gi cannot hold"):
        validate(spec(offload=cache, resources={"memory": "64Gi"}))
    validate(spec(offload=cache, resources={"memory": "100Gi"}))


def test_resident_layers_without_dlo_are_rejected_like_the_worker_does() -> None:
    with pytest.raises(InvalidSpecError, match=r"offload\.enabled"):
        validate(spec(offload={"enabled": False, "residentLayers": 2}))


def test_the_operator_never_imports_torch() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, dlo_operator.kopf_handlers, dlo_operator.__main__; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_every_option_the_operator_renders_has_its_crd_field() -> None:
    from dlo_operator.workerconfig import CRD_FIELDS
    from dlo_worker.config import ModelOptions, OffloadOptions, ParallelOptions

    config = worker_config(spec(offload={"useAllGather": False, "runtimeCache": {"enabled": True}}))
    rendered = {
        name
        for group, options in (
            ("model", ModelOptions),
            ("parallel", ParallelOptions),
            ("offload", OffloadOptions),
        )
        for name in options.model_fields
        if name in getattr(config, group).model_fields_set
    }
    assert rendered - set(CRD_FIELDS) == set()


def test_every_crd_field_of_the_mapping_exists_in_the_crd() -> None:
    """The one table the worker configuration is built from names real CRD fields, so a
    refusal (written in CRD terms) points at a field the author can set."""
    from dlo_operator.api import DiffusionDeploymentSpec
    from dlo_operator.workerconfig import CRD_FIELDS

    def resolves(model: type, path: list[str]) -> bool:
        by_alias = {field.alias or name: field for name, field in model.model_fields.items()}
        name, items = path[0].removesuffix("[]"), path[0].endswith("[]")
        field = by_alias.get(name)
        if field is None:
            return False
        if len(path) == 1:
            return True
        # "loras[].fuse": a field of the list's items
        inner = get_args(field.annotation)[0] if items else field.annotation
        return resolves(inner, path[1:])

    missing = [
        field.path
        for field in CRD_FIELDS.values()
        if not resolves(DiffusionDeploymentSpec, field.path.split("."))
    ]
    assert missing == []


def test_spec_compile_reaches_the_worker_and_its_refusals_read_in_crd_terms() -> None:
    config = worker_config(spec(compile={"enabled": True, "mode": "max-autotune-no-cudagraphs"}))
    assert config.effective().compile == "max-autotune-no-cudagraphs"
    assert "--compile" in to_flags(config)
    with pytest.raises(
        InvalidSpecError, match=r"^compile\.mode max-autotune-no-cudagraphs requires compile\."
    ):
        validate(spec(compile={"mode": "max-autotune-no-cudagraphs"}))
    # CUDA graphs run under DLO; they need a GPU.
    validate(spec(compile={"enabled": True, "mode": "reduce-overhead"}))
    with pytest.raises(
        InvalidSpecError,
        match=r"^compile\.mode reduce-overhead with accelerator cpu: CUDA graphs need a CUDA ",
    ):
        validate(
            spec(
                accelerator="none",
                compile={"enabled": True, "mode": "reduce-overhead"},
                offload={"enabled": False},
            )
        )
