"""Rendering a DiffusionDeployment into Pods, Services and PodDisruptionBudgets (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dlo_operator.api import DiffusionDeploymentSpec
from dlo_operator.render import (
    ANNOTATION_SPEC_HASH,
    LABEL_ROLE,
    NRI_ULIMIT_ANNOTATION,
    Owner,
    render_client_service,
    render_engine,
    spec_hash,
    worker_arguments,
)
from dlo_operator.workerconfig import worker_config
from dlo_worker.cli import build_parser, config_from_args
from dlo_worker.cli import main as worker_main
from tests.support.deployments import deployment_spec

OWNER = Owner(name="flux", namespace="serving", uid="1234")


def spec(**overrides: Any) -> DiffusionDeploymentSpec:
    """Engines of two Pods each."""
    return deployment_spec(**{"parallelism": {"data": 4}, **overrides})


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def container(pod: dict) -> dict:
    (worker,) = pod["spec"]["containers"]
    return worker


def env(pod: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(pod)["env"]}


def test_engine_has_one_pod_per_node_with_deterministic_names() -> None:
    objects = render_engine(OWNER, spec(), engine=1)
    pods = by_kind(objects, "Pod")
    assert [p["metadata"]["name"] for p in pods] == ["flux-e1-n0", "flux-e1-n1"]
    assert [p["metadata"]["labels"][LABEL_ROLE] for p in pods] == ["leader", "worker"]
    assert render_engine(OWNER, spec(), engine=1) == objects


def test_torch_environment_points_every_rank_at_node_zero() -> None:
    pods = by_kind(render_engine(OWNER, spec(), engine=0), "Pod")
    for rank, pod in enumerate(pods):
        assert env(pod) == {
            "MASTER_ADDR": "flux-e0-n0.flux-e0.serving.svc",
            "MASTER_PORT": "29500",
            "WORLD_SIZE": "4",
            "NNODES": "2",
            "NODE_RANK": str(rank),
            "NPROC_PER_NODE": "2",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "110",
        }
        assert pod["spec"]["hostname"] == f"flux-e0-n{rank}"
        assert pod["spec"]["subdomain"] == "flux-e0"


def test_headless_service_publishes_not_ready_addresses() -> None:
    (service,) = by_kind(render_engine(OWNER, spec(), engine=0), "Service")
    assert service["metadata"]["name"] == "flux-e0"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_rendered_worker_arguments_pass_the_workers_own_validation(capsys) -> None:
    for variant in (
        spec(),
        spec(
            offload={
                "useAllGather": False,
                "residentLayers": 2,
                "runtimeCache": {"enabled": True, "pinLimitGiB": 8},
            }
        ),
        spec(model={"imagePath": "/opt/model"}, dtype="bfloat16"),
    ):
        arguments = worker_arguments(variant)
        served = build_parser().parse_args(arguments)
        assert served.command == "serve"
        assert served.port == 8000
        assert config_from_args(served) == worker_config(variant)
        assert arguments[-2:] == ["--port", "8000"]
        assert worker_main(["config", *arguments[1:-2]]) == 0
        printed = json.loads(capsys.readouterr().out)["config"]
        assert printed == worker_config(variant).model_dump(mode="json")


def test_volumes_cache_shm_and_model() -> None:
    variant = spec(
        offload={
            "useAllGather": False,
            "runtimeCache": {"enabled": True, "hostPath": "/mnt/nvme/dlo"},
        },
        shmSize="32Gi",
    )
    pod = by_kind(render_engine(OWNER, variant, engine=0), "Pod")[0]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["runtime-cache"]["hostPath"] == {
        "path": "/mnt/nvme/dlo",
        "type": "DirectoryOrCreate",
    }
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert volumes["model"]["hostPath"]["path"] == "/models/flux"
    mounts = {m["name"]: m["mountPath"] for m in container(pod)["volumeMounts"]}
    assert mounts == {
        "dshm": "/dev/shm",
        "model": "/models/model",
        "runtime-cache": "/var/cache/dlo-worker",
    }
    assert "--dlo-runtime-cache-root" in container(pod)["command"]


def test_model_from_a_pvc_or_the_image() -> None:
    pvc = by_kind(render_engine(OWNER, spec(model={"persistentVolumeClaim": "weights"}), 0), "Pod")[
        0
    ]
    assert {v["name"]: v for v in pvc["spec"]["volumes"]}["model"]["persistentVolumeClaim"] == {
        "claimName": "weights",
        "readOnly": True,
    }
    baked = by_kind(render_engine(OWNER, spec(model={"imagePath": "/opt/model"}), 0), "Pod")[0]
    assert "model" not in {v["name"] for v in baked["spec"]["volumes"]}


def test_resources_include_gpus_and_the_pinned_budget() -> None:
    variant = spec(
        offload={"useAllGather": False, "runtimeCache": {"enabled": True, "pinLimitGiB": 20}}
    )
    pod = by_kind(render_engine(OWNER, variant, 0), "Pod")[0]
    resources = container(pod)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "2"
    # 2 ranks x 20 GiB pinned + 16 GiB /dev/shm
    assert resources["requests"]["memory"] == "56Gi"
    explicit = by_kind(render_engine(OWNER, spec(resources={"memory": "200Gi"}), 0), "Pod")[0]
    assert container(explicit)["resources"]["limits"]["memory"] == "200Gi"


@pytest.mark.parametrize("mode", ["IpcLock", "NriUlimit", "None"])
def test_locked_memory_modes(mode: str) -> None:
    pod = by_kind(render_engine(OWNER, spec(lockedMemory=mode), 0), "Pod")[0]
    capabilities = container(pod).get("securityContext", {}).get("capabilities", {})
    annotations = pod["metadata"]["annotations"]
    assert (capabilities.get("add") == ["IPC_LOCK"]) == (mode == "IpcLock")
    assert (NRI_ULIMIT_ANNOTATION in annotations) == (mode == "NriUlimit")
    if mode == "NriUlimit":
        assert "RLIMIT_MEMLOCK" in annotations[NRI_ULIMIT_ANNOTATION]


def test_probes_give_loading_a_long_startup_budget() -> None:
    worker = container(by_kind(render_engine(OWNER, spec(), 0), "Pod")[0])
    startup = worker["startupProbe"]
    assert startup["httpGet"]["path"] == "/health/live"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    assert worker["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert worker["livenessProbe"]["httpGet"]["path"] == "/health/live"


def test_every_child_is_owned_by_the_deployment() -> None:
    objects = [*render_engine(OWNER, spec(), 0), render_client_service(OWNER, spec())]
    for item in objects:
        (reference,) = item["metadata"]["ownerReferences"]
        assert reference["uid"] == "1234"
        assert reference["controller"] is True


def test_scheduling_keeps_an_engine_in_one_domain_and_one_pod_per_node() -> None:
    variant = spec(
        scheduling={
            "topologyKey": "nvidia.com/gpu.clique",
            "nodeSelector": {"pool": "h200"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
        }
    )
    pod = by_kind(render_engine(OWNER, variant, 3), "Pod")[0]
    affinity = pod["spec"]["affinity"]
    (apart,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (together,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart["topologyKey"] == "kubernetes.io/hostname"
    assert together["topologyKey"] == "nvidia.com/gpu.clique"
    assert together["labelSelector"]["matchLabels"]["dlo.dev/engine"] == "3"
    assert pod["spec"]["nodeSelector"] == {"pool": "h200"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]


def test_client_service_selects_the_leaders() -> None:
    service = render_client_service(OWNER, spec(port=9000))
    assert service["spec"]["selector"] == {"dlo.dev/deployment": "flux", "dlo.dev/role": "leader"}
    assert service["spec"]["ports"][0]["port"] == 9000


def test_budget_blocks_voluntary_eviction_of_a_running_engine() -> None:
    (budget,) = by_kind(render_engine(OWNER, spec(), 0), "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 2


def test_spec_hash_ignores_replicas_but_not_pod_fields() -> None:
    assert spec_hash(spec(replicas=1)) == spec_hash(spec(replicas=5))
    assert spec_hash(spec()) != spec_hash(spec(shmSize="8Gi"))
    pod = by_kind(render_engine(OWNER, spec(), 0), "Pod")[0]
    assert pod["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == spec_hash(spec())
