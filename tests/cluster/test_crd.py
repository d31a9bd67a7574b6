"""The generated DiffusionDeployment CRD on a real API server: defaults, CEL rules, scale."""

from __future__ import annotations

import pytest
from kubernetes import client

from dlo_operator.api import GROUP, PLURAL, VERSION
from tests.cluster.helpers import create, manifest


def test_defaults_are_applied_by_the_api_server(api_client, crd, namespace) -> None:
    created = create(api_client, namespace, manifest("defaults"))
    spec = created["spec"]
    assert spec["replicas"] == 1
    assert spec["offload"]["useAllGather"] is True
    assert spec["offload"]["runtimeCache"]["hostPath"] == "/var/cache/dlo-worker"
    assert spec["model"]["mountPath"] == "/models/model"
    assert spec["lockedMemory"] == "None"
    assert spec["accelerator"] == "nvidia-gpu"


def test_scale_subresource_changes_replicas(api_client, crd, namespace) -> None:
    create(api_client, namespace, manifest("scaled"))
    objects = client.CustomObjectsApi(api_client)
    objects.patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, "scaled", {"spec": {"replicas": 3}}
    )
    current = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "scaled")
    assert current["spec"]["replicas"] == 3


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"gpusPerNode": 4}, "must be divisible by gpusPerNode"),
        ({"model": {"hostPath": "/m", "imagePath": "/n"}}, "set exactly one of hostPath"),
        ({"model": {"hostPath": "/models/../etc"}}, "absolute path without '..'"),
        ({"offload": {"runtimeCache": {"hostPath": "relative"}}}, "absolute path without '..'"),
        ({"replicas": -1}, "spec.replicas"),
        ({"shmSize": "lots"}, "spec.shmSize"),
        ({"quantization": "int3"}, "spec.quantization"),
        ({"accelerator": "tpu"}, "spec.accelerator"),
        # The engine looped on EADDRINUSE, restarting every few seconds.
        ({"port": 29500}, "port 29500 is the engine's torch rendezvous port"),
        (
            {"worker": {"image": "w", "env": [{"name": "MASTER_PORT", "value": "1"}]}},
            "worker.env: the operator and torchrun set MASTER_ADDR",
        ),
        (
            {"worker": {"image": "w", "env": [{"name": "DLO_API_KEY", "value": "k"}]}},
            "every DLO_ or TORCHELASTIC_ variable",
        ),
        (
            {"worker": {"image": "w", "env": [{"name": "A", "value": "1", "valueFrom": {}}]}},
            "set value or valueFrom, not both",
        ),
        (
            {"podMetadata": {"labels": {"dlo.dev/engine": "7"}}},
            "podMetadata.labels: keys under dlo.dev/ are the operator's own",
        ),
        (
            {"loras": [{"name": "a", "imagePath": "/a"}, {"name": "a", "hostPath": "/b"}]},
            "each LoRA adapter needs a name of its own",
        ),
        ({"loras": [{"name": "a", "hostPath": "/a", "imagePath": "/b"}]}, "set exactly one of"),
        (
            {"loras": [{"name": "a", "hostPath": "/a", "subPath": "x"}]},
            "subPath applies to persistentVolumeClaim only",
        ),
        (
            {"loras": [{"name": "a", "persistentVolumeClaim": "c", "subPath": "../x"}]},
            "must be a relative path without '..'",
        ),
        ({"loras": [{"name": "a", "imagePath": "/a", "scale": 11}]}, "spec.loras[0].scale"),
    ],
    ids=[
        "world-size",
        "two-model-sources",
        "dotdot",
        "relative-cache",
        "replicas",
        "shm",
        "quantization",
        "accelerator",
        "rendezvous-port",
        "reserved-env",
        "reserved-env-prefix",
        "env-value-and-value-from",
        "operator-label",
        "lora-names",
        "lora-sources",
        "lora-sub-path-without-claim",
        "lora-sub-path-dotdot",
        "lora-scale",
    ],
)
def test_invalid_specs_are_refused_by_the_api_server(
    api_client, crd, namespace, spec, message
) -> None:
    with pytest.raises(client.ApiException) as refused:
        create(api_client, namespace, manifest("refused", **spec))
    assert refused.value.status == 422
    assert message in refused.value.body
