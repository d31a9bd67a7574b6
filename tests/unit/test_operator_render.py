"""Rendering a DiffusionDeployment into Pods, Services and PodDisruptionBudgets (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from dlo_operator.api import RESERVED_ENV_NAMES, RESERVED_ENV_PREFIXES, DiffusionDeploymentSpec
from dlo_operator.render import (
    ANNOTATION_SPEC_HASH,
    LABEL_ROLE,
    NRI_ULIMIT_ANNOTATION,
    Owner,
    budget_min_available,
    render_children,
    render_client_service,
    render_engine_pods,
    render_warm_job,
    spec_hash,
    worker_arguments,
)
from dlo_operator.render import pod_spec as rendered_pod_spec
from dlo_operator.workerconfig import InvalidSpecError, validate, worker_config
from dlo_worker.cli.main import build_parser, config_from_args
from dlo_worker.cli.main import main as worker_main
from dlo_worker.config import ShardingGroup
from dlo_worker.offload import config as offload_config
from tests.support.deployments import deployment_spec

OWNER = Owner(name="flux", namespace="serving", uid="1234")


def spec(**overrides: Any) -> DiffusionDeploymentSpec:
    """Engines of two Pods each."""
    return deployment_spec(**{"parallelism": {"data": 4}, **overrides})


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def leader(variant: DiffusionDeploymentSpec, engine: int = 0) -> dict:
    return render_engine_pods(OWNER, variant, engine)[0]


def container(pod: dict) -> dict:
    (worker,) = pod["spec"]["containers"]
    return worker


def env(pod: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(pod)["env"]}


def test_engine_has_one_pod_per_node_with_deterministic_names() -> None:
    pods = render_engine_pods(OWNER, spec(), engine=1)
    assert [p["metadata"]["name"] for p in pods] == ["flux-e1-n0", "flux-e1-n1"]
    assert [p["metadata"]["labels"][LABEL_ROLE] for p in pods] == ["leader", "worker"]
    assert render_engine_pods(OWNER, spec(), engine=1) == pods


def test_torch_environment_points_every_rank_at_node_zero() -> None:
    pods = render_engine_pods(OWNER, spec(), engine=0)
    for rank, pod in enumerate(pods):
        assert env(pod) == {
            "MASTER_ADDR": "flux-e0-n0.flux-e0.serving.svc",
            "MASTER_PORT": "29500",
            "WORLD_SIZE": "4",
            "NNODES": "2",
            "NODE_RANK": str(rank),
            "NPROC_PER_NODE": "2",
            "DLO_LOG_LEVEL": "warning",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "105",
            "HOME": "/home/dlo",
            "USER": "dlo",
        }
        assert pod["spec"]["hostname"] == f"flux-e0-n{rank}"
        assert pod["spec"]["subdomain"] == "flux-e0"


def test_the_log_level_reaches_every_rank_as_the_workers_own_variable() -> None:
    pods = render_engine_pods(OWNER, spec(logLevel="info"), engine=0)
    assert [env(pod)["DLO_LOG_LEVEL"] for pod in pods] == ["info", "info"]
    with pytest.raises(ValidationError, match="logLevel"):
        spec(logLevel="verbose")


@pytest.mark.parametrize(("grace", "delay", "torchrun"), [(120, 5, 105), (12, 3, 0), (3, 0, 0)])
def test_a_deleted_worker_keeps_serving_until_it_left_the_service(
    grace: int, delay: int, torchrun: int
) -> None:
    """A preStop sleep before SIGTERM, within the grace period, and torchrun's own kill
    timer counts from SIGTERM."""
    (pod, _) = render_engine_pods(OWNER, spec(terminationGracePeriodSeconds=grace), engine=0)
    (container,) = pod["spec"]["containers"]
    if delay:
        assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": delay}}}
    else:
        assert "lifecycle" not in container
    assert env(pod)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(torchrun)


def test_headless_service_publishes_not_ready_addresses() -> None:
    services = by_kind(render_children(OWNER, spec()), "Service")
    (service,) = [s for s in services if s["metadata"]["name"] == "flux-e0"]
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
        spec(offload={"useAllGather": False, "gpuMemoryBudgetGiB": 40}),
        spec(
            offload={
                "useAllGather": False,
                "maxGpuMemoryGiB": 24,
                "streamTextEncoders": ["text_encoder_2"],
            }
        ),
        spec(offload={"enabled": False, "maxGpuMemoryGiB": 12}),
        spec(offload={"allGatherShardBuffers": 2}),
        spec(
            offload={
                "useAllGather": False,
                "staging": {"mode": "ring", "chunkMiB": 4, "packThreads": 4},
            }
        ),
        spec(accelerator="none", gpusPerNode=2),
        spec(serve={"maxQueuedRequests": 8, "defaultSteps": 12, "defaultWidth": 512}),
    ):
        arguments = worker_arguments(variant)
        served = build_parser().parse_args(arguments)
        assert served.command == "serve"
        assert served.port == 8000
        assert served.max_queued_requests == variant.serve.max_queued_requests
        assert (served.default_steps, served.default_width, served.default_height) == (
            variant.serve.default_steps,
            variant.serve.default_width,
            variant.serve.default_height,
        )
        assert config_from_args(served) == worker_config(variant)
        configuration = arguments[1 : arguments.index("--port")]
        assert worker_main(["config", *configuration]) == 0
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
    pod = leader(variant)
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
        "tmp": "/tmp",
        "home": "/home/dlo",
        "model": "/models/model",
        "runtime-cache": "/var/cache/dlo-worker",
    }
    assert "--dlo-runtime-cache-root" in container(pod)["command"]


def test_model_from_a_pvc_or_the_image() -> None:
    pvc = leader(spec(model={"persistentVolumeClaim": "weights"}), 0)
    assert {v["name"]: v for v in pvc["spec"]["volumes"]}["model"]["persistentVolumeClaim"] == {
        "claimName": "weights",
        "readOnly": True,
    }
    baked = leader(spec(model={"imagePath": "/opt/model"}), 0)
    assert "model" not in {v["name"] for v in baked["spec"]["volumes"]}


def test_resources_default_per_rank_plus_the_pinned_budget_and_shm() -> None:
    variant = spec(
        offload={"useAllGather": False, "runtimeCache": {"enabled": True, "pinLimitGiB": 20}}
    )
    resources = container(leader(variant))["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "2"
    # 2 ranks x (16 GiB per rank + 20 GiB pinned) + 16 GiB /dev/shm, requested and limited
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "88Gi"
    # 2 ranks x 4 CPUs requested; no CPU limit (throttling stalls pack and NCCL threads)
    assert resources["requests"]["cpu"] == "8"
    assert "cpu" not in resources["limits"]


@pytest.mark.parametrize(
    ("offload", "cpu"),
    [
        # AllGather from pinned shards: nothing packs, 4 per rank.
        ({}, "8"),
        # Rank-local from the checkpoint mapping: 8 packers + model thread + feeder.
        ({"useAllGather": False}, "20"),
        ({"useAllGather": False, "runtimeCache": {"enabled": True}}, "20"),
        ({"useAllGather": False, "staging": {"packThreads": 12}}, "28"),
        # Registered: copied straight from the mapping, nothing packs.
        ({"useAllGather": False, "runtimeCache": {"enabled": True, "pinLimitGiB": 30}}, "8"),
    ],
)
def test_a_rank_that_packs_requests_a_cpu_per_busy_thread(offload, cpu) -> None:
    resources = container(leader(spec(offload=offload)))["resources"]
    assert resources["requests"]["cpu"] == cpu
    assert "cpu" not in resources["limits"]


def test_a_cpu_engine_never_requests_cpus_for_packers() -> None:
    variant = spec(accelerator="none", offload={"useAllGather": False})
    assert container(leader(variant))["resources"]["requests"]["cpu"] == "8"


def test_the_operator_sizes_the_request_by_the_workers_own_defaults() -> None:
    assert rendered_pod_spec.WORKER_PACK_THREADS == offload_config.MAX_PACK_THREADS
    assert rendered_pod_spec.WORKER_BUSY_THREADS == offload_config.BUSY_THREADS_PER_RANK


def test_resources_per_rank_figures_and_explicit_totals_override() -> None:
    tuned = container(leader(spec(resources={"cpuPerRank": "1500m", "memoryPerRank": "8Gi"})))
    assert tuned["resources"]["requests"]["cpu"] == "3"
    assert tuned["resources"]["limits"]["memory"] == "32Gi"  # 2 x 8 GiB + 16 GiB shm
    packing = spec(offload={"useAllGather": False}, resources={"cpuPerRank": "3"})
    assert container(leader(packing))["resources"]["requests"]["cpu"] == "6"
    explicit = container(leader(spec(resources={"memory": "200Gi", "cpu": "12"})))
    assert explicit["resources"]["requests"]["memory"] == "200Gi"
    assert explicit["resources"]["limits"]["memory"] == "200Gi"
    assert explicit["resources"]["requests"]["cpu"] == "12"
    assert (
        container(leader(spec(resources={"cpuPerRank": "250m"})))["resources"]["requests"]["cpu"]
        == "500m"
    )


@pytest.mark.parametrize(
    "variant",
    [
        spec(),
        spec(lockedMemory="IpcLock"),
        spec(lockedMemory="NriUlimit", resources={"memory": "1Ti"}),
        spec(offload={"useAllGather": False, "runtimeCache": {"enabled": True}}),
    ],
)
def test_no_spec_renders_a_pod_without_a_memory_limit(variant: DiffusionDeploymentSpec) -> None:
    for pod in render_engine_pods(OWNER, variant, 0):
        for item in [*pod["spec"]["containers"], *pod["spec"].get("initContainers", [])]:
            assert item["resources"]["limits"]["memory"], item["name"]
            assert item["resources"]["requests"]["cpu"], item["name"]


def test_worker_pods_are_hardened_by_default() -> None:
    pod = leader(spec())
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container(pod)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["enableServiceLinks"] is False
    assert "initContainers" not in pod["spec"]
    mounts = {m["name"]: m for m in container(pod)["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True
    writable = {v["name"] for v in pod["spec"]["volumes"] if "emptyDir" in v}
    assert writable == {"dshm", "tmp", "home"}


PLATFORM = {
    "worker": {
        "image": "registry.example/dlo-worker:0.1",
        "imagePullSecrets": [{"name": "registry"}],
        "env": [
            {"name": "NCCL_DEBUG", "value": "WARN"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        ],
        "serviceAccountName": "inference",
    },
    "scheduling": {
        "priorityClassName": "inference-high",
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
            }
        ],
    },
    "podMetadata": {
        "labels": {"team": "vision"},
        "annotations": {"sidecar.istio.io/inject": "false"},
    },
}


def test_platform_fields_reach_engine_pods_and_warm_jobs() -> None:
    variant = spec(**PLATFORM, offload={"useAllGather": False, "runtimeCache": {"enabled": True}})
    pod = leader(variant)
    (job,) = by_kind(render_children(OWNER, variant, warm_on=["node-a"]), "Job")
    for pod_spec, metadata, worker in (
        (pod["spec"], pod["metadata"], container(pod)),
        (
            job["spec"]["template"]["spec"],
            job["spec"]["template"]["metadata"],
            job["spec"]["template"]["spec"]["containers"][0],
        ),
    ):
        assert pod_spec["imagePullSecrets"] == [{"name": "registry"}]
        assert pod_spec["serviceAccountName"] == "inference"
        assert pod_spec["automountServiceAccountToken"] is False  # the name alone mounts nothing
        assert pod_spec["priorityClassName"] == "inference-high"
        assert metadata["labels"]["team"] == "vision"
        assert metadata["annotations"]["sidecar.istio.io/inject"] == "false"
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in worker["env"]
        assert {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
        } in worker["env"]
    assert pod["spec"]["topologySpreadConstraints"][0]["maxSkew"] == 1
    assert pod["metadata"]["labels"]["dlo.dev/engine"] == "0"
    asked = spec(worker={**PLATFORM["worker"], "automountServiceAccountToken": True})
    assert leader(asked)["spec"]["automountServiceAccountToken"] is True


def test_every_variable_the_operator_renders_is_reserved() -> None:
    """A user variable may not shadow one the operator sets (the CRD refuses those names)."""
    variant = spec(apiKeySecret={"name": "key"})
    rendered = {item["name"] for item in container(leader(variant))["env"]}
    assert rendered - set(RESERVED_ENV_NAMES) == {"DLO_LOG_LEVEL", "DLO_API_KEY"}
    assert all(
        name.startswith(RESERVED_ENV_PREFIXES) for name in rendered - set(RESERVED_ENV_NAMES)
    )


def test_worker_pods_carry_prometheus_scrape_annotations_unless_turned_off() -> None:
    annotations = leader(spec(port=9000))["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9000"
    assert annotations["prometheus.io/path"] == "/metrics"
    quiet = leader(spec(metrics={"scrapeAnnotations": False}))["metadata"]["annotations"]
    assert not any(key.startswith("prometheus.io/") for key in quiet)


def test_runtime_cache_directory_is_handed_to_the_worker_user() -> None:
    variant = spec(offload={"useAllGather": False, "runtimeCache": {"enabled": True}})
    (init,) = leader(variant)["spec"]["initContainers"]
    assert init["command"][:2] == ["sh", "-c"]
    assert init["command"][2].startswith('chown 65532:65532 "$0" || echo ')
    assert init["command"][3] == "/var/cache/dlo-worker"
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert init["volumeMounts"] == [{"name": "runtime-cache", "mountPath": "/var/cache/dlo-worker"}]


@pytest.mark.parametrize("mode", ["IpcLock", "NriUlimit", "None"])
def test_locked_memory_modes(mode: str) -> None:
    pod = leader(spec(lockedMemory=mode), 0)
    security = container(pod)["securityContext"]
    annotations = pod["metadata"]["annotations"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert (security["capabilities"].get("add") == ["IPC_LOCK"]) == (mode == "IpcLock")
    # An added capability is only effective for root (no ambient capabilities).
    assert (security.get("runAsUser") == 0) == (mode == "IpcLock")
    assert (NRI_ULIMIT_ANNOTATION in annotations) == (mode == "NriUlimit")
    if mode == "NriUlimit":
        assert "RLIMIT_MEMLOCK" in annotations[NRI_ULIMIT_ANNOTATION]


def test_probes_give_loading_a_long_startup_budget() -> None:
    worker = container(leader(spec(), 0))
    startup = worker["startupProbe"]
    assert startup["httpGet"]["path"] == "/health/live"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    assert worker["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert worker["livenessProbe"]["httpGet"]["path"] == "/health/live"


def test_every_child_is_owned_by_the_deployment() -> None:
    objects = [*render_engine_pods(OWNER, spec(), 0), *render_children(OWNER, spec())]
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
    pod = leader(variant, 3)
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


BUDGET_CASES = [
    # (replicas, pods per engine via data, maxUnavailableEngines, minAvailable)
    (2, 4, 1, 3),  # 4 Pods: one eviction, then the evicted engine's restart blocks more
    (3, 2, 1, 2),  # one Pod per engine: replicas - 1
    (3, 2, 2, 1),
    (2, 4, 0, 4),  # never evict a healthy Pod
    (1, 2, 1, 0),  # a single engine can be drained (with downtime)
    (0, 2, 1, 0),
]


@pytest.mark.parametrize(("replicas", "data", "engines", "min_available"), BUDGET_CASES)
def test_one_budget_counts_disruptions_in_engines(
    replicas: int, data: int, engines: int, min_available: int
) -> None:
    variant = spec(
        replicas=replicas,
        parallelism={"data": data},
        disruptionBudget={"maxUnavailableEngines": engines},
    )
    (budget,) = by_kind(render_children(OWNER, variant), "PodDisruptionBudget")
    assert budget["metadata"]["name"] == "flux"
    assert budget["spec"]["minAvailable"] == min_available == budget_min_available(variant)
    assert budget["spec"]["selector"] == {"matchLabels": {"dlo.dev/deployment": "flux"}}
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_network_policy_per_engine_opens_only_http_beyond_the_engine() -> None:
    policies = by_kind(render_children(OWNER, spec(replicas=2, port=9000)), "NetworkPolicy")
    assert [p["metadata"]["name"] for p in policies] == ["flux-e0", "flux-e1"]
    policy = policies[1]["spec"]
    engine = {"dlo.dev/deployment": "flux", "dlo.dev/engine": "1"}
    assert policy["podSelector"] == {"matchLabels": engine}
    assert policy["policyTypes"] == ["Ingress"]
    within, http = policy["ingress"]
    assert within == {"from": [{"podSelector": {"matchLabels": engine}}]}
    assert http == {"ports": [{"protocol": "TCP", "port": 9000}]}
    disabled = spec(replicas=2, networkPolicy={"enabled": False})
    assert by_kind(render_children(OWNER, disabled), "NetworkPolicy") == []


def test_children_carry_a_hash_of_their_rendering() -> None:
    def hashes(variant: DiffusionDeploymentSpec) -> dict[str, str]:
        return {
            f"{item['kind']}/{item['metadata']['name']}": item["metadata"]["annotations"][
                "dlo.dev/config-hash"
            ]
            for item in render_children(OWNER, variant)
        }

    base, scaled = hashes(spec(replicas=2)), hashes(spec(replicas=3))
    assert base["Service/flux-e0"] == scaled["Service/flux-e0"]
    assert base["PodDisruptionBudget/flux"] != scaled["PodDisruptionBudget/flux"]
    assert "Service/flux-e2" in scaled
    assert "Service/flux-e2" not in base


def test_spec_hash_ignores_replicas_but_not_pod_fields() -> None:
    assert spec_hash(spec(replicas=1)) == spec_hash(spec(replicas=5))
    assert spec_hash(spec()) != spec_hash(spec(shmSize="8Gi"))
    pod = leader(spec())
    assert pod["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == spec_hash(spec())


def test_the_api_key_comes_from_the_secret_as_an_environment_variable() -> None:
    pod = leader(spec(apiKeySecret={"name": "flux-api"}))
    (variable,) = [item for item in container(pod)["env"] if item["name"] == "DLO_API_KEY"]
    assert variable["valueFrom"] == {"secretKeyRef": {"name": "flux-api", "key": "api-key"}}
    assert not any("api" in argument for argument in container(pod)["command"])


def test_a_cpu_engine_requests_no_gpu_and_runs_its_ranks_on_the_cpu() -> None:
    variant = spec(accelerator="none", gpusPerNode=2)
    pods = render_engine_pods(OWNER, variant, engine=0)
    assert len(pods) == 2  # data 4 over 2 ranks per Pod
    for pod in pods:
        resources = container(pod)["resources"]
        assert "nvidia.com/gpu" not in resources["requests"]
        assert "nvidia.com/gpu" not in resources["limits"]
        assert resources["requests"]["cpu"] == "8"  # 2 ranks x 4 CPUs
        assert env(pod)["NPROC_PER_NODE"] == "2"
    arguments = worker_arguments(variant)
    assert arguments[arguments.index("--device") + 1] == "cpu"
    gpu_arguments = worker_arguments(spec())
    assert gpu_arguments[gpu_arguments.index("--device") + 1] == "cuda"


def test_a_cpu_engine_cannot_ask_for_gpu_host_registration() -> None:
    variant = spec(
        accelerator="none",
        offload={"useAllGather": False, "runtimeCache": {"enabled": True, "pinLimitGiB": 4}},
    )
    with pytest.raises(InvalidSpecError, match="accelerator none has no GPU"):
        validate(variant)


def test_a_data_and_sequence_parallel_engine_spans_dp_x_sp_ranks() -> None:
    """DP=2 x SP=2 on 2 GPUs per node: 4 ranks on 2 Pods, and the worker flags that make
    each rank join its SP group (DLO's AllGather keeps the DP group)."""
    variant = spec(parallelism={"data": 2, "sequence": 2})
    validate(variant)
    pods = render_engine_pods(OWNER, variant, engine=0)
    assert len(pods) == 2
    assert [env(pod)["WORLD_SIZE"] for pod in pods] == ["4", "4"]
    config = config_from_args(build_parser().parse_args(worker_arguments(variant)))
    assert config.parallel.data_parallel_size == 2
    assert config.parallel.sequence_parallel_size == 2
    assert config.effective().dlo_sharding_group == ShardingGroup.DATA_PARALLEL


def test_an_fp8_deployment_renders_workers_that_stream_fp8_weights() -> None:
    variant = spec(quantization="fp8")
    validate(variant)
    arguments = worker_arguments(variant)
    assert arguments[arguments.index("--quantization") + 1] == "fp8"
    assert "--enable-distributed-layerwise-offload" in arguments


@pytest.mark.parametrize(
    ("runtime_cache", "cache_dir", "volume"),
    [
        (False, "/var/cache/dlo-compile", {"name": "compile-cache", "emptyDir": {}}),
        (True, "/var/cache/dlo-worker/compile", None),
    ],
)
def test_compiled_graphs_are_kept_where_a_restarted_worker_finds_them(
    runtime_cache: bool, cache_dir: str, volume: dict | None
) -> None:
    """An emptyDir of the Pod (a restarted container loads the graphs), or beside the
    runtime cache on the node's hostPath (a Pod restarted on the node loads them)."""
    variant = spec(
        compile={"enabled": True, "mode": "reduce-overhead"},
        offload={"useAllGather": False, "runtimeCache": {"enabled": runtime_cache}},
    )
    validate(variant)
    config = config_from_args(build_parser().parse_args(worker_arguments(variant)))
    assert str(config.model.compile_cache_dir) == cache_dir
    assert config.effective().compile == "reduce-overhead"
    pod = leader(variant)
    mounts = {m["mountPath"] for m in container(pod)["volumeMounts"]}
    volumes = [v for v in pod["spec"]["volumes"] if v["name"] == "compile-cache"]
    if volume is None:
        assert volumes == []
        assert "/var/cache/dlo-worker" in mounts
    else:
        assert volumes == [volume]
        assert cache_dir in mounts


def test_an_engine_without_compile_gets_no_compile_cache() -> None:
    pod = leader(spec())
    assert "--compile-cache-dir" not in container(pod)["command"]
    assert all(v["name"] != "compile-cache" for v in pod["spec"]["volumes"])


LORAS = [
    {"name": "style", "scale": 0.7, "hostPath": "/srv/loras/style.safetensors"},
    {"name": "faces", "persistentVolumeClaim": "adapters", "subPath": "faces/v2"},
    {"name": "baked", "scale": -1.5, "imagePath": "/opt/loras/baked"},
]


def test_spec_loras_are_mounted_read_only_and_reach_the_worker_as_its_flags() -> None:
    variant = spec(loras=LORAS)
    validate(variant)
    config = config_from_args(build_parser().parse_args(worker_arguments(variant)))
    assert [(a.name, str(a.path), a.scale) for a in config.model.lora_adapters] == [
        ("style", "/var/lib/dlo/loras/style", 0.7),
        ("faces", "/var/lib/dlo/loras/faces", 1.0),
        ("baked", "/opt/loras/baked", -1.5),  # in the image: no volume
    ]
    for pod in render_engine_pods(OWNER, variant, 0):  # every rank loads them
        volumes = {v["name"]: v for v in pod["spec"]["volumes"] if v["name"].startswith("lora")}
        assert volumes == {
            "lora-0": {"name": "lora-0", "hostPath": {"path": "/srv/loras/style.safetensors"}},
            "lora-1": {
                "name": "lora-1",
                "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True},
            },
        }
        mounts = [m for m in container(pod)["volumeMounts"] if m["name"].startswith("lora")]
        assert mounts == [
            {"name": "lora-0", "mountPath": "/var/lib/dlo/loras/style", "readOnly": True},
            {
                "name": "lora-1",
                "mountPath": "/var/lib/dlo/loras/faces",
                "readOnly": True,
                "subPath": "faces/v2",
            },
        ]


def test_fused_loras_reach_the_engines_and_the_warm_job_as_fuse_flags() -> None:
    variant = spec(
        loras=[{**LORAS[0], "fuse": True}, *LORAS[1:]],
        offload={"enabled": True, "useAllGather": False, "runtimeCache": {"enabled": True}},
    )
    validate(variant)
    config = config_from_args(build_parser().parse_args(worker_arguments(variant)))
    assert config.model.fuse_lora == ("style",)
    assert config.model.switchable_lora_names == ("faces", "baked")
    # The warm Job builds the entry with the adapter fused: it mounts it and fuses it too.
    (job_container,) = render_warm_job(OWNER, variant, "node-a")["spec"]["template"]["spec"][
        "containers"
    ]
    assert "--fuse-lora" in job_container["command"]
    assert any(m["name"] == "lora-0" for m in job_container["volumeMounts"])
    assert spec_hash(variant) != spec_hash(spec(loras=LORAS))


def test_a_change_of_adapters_rolls_the_engines() -> None:
    assert spec_hash(spec(loras=LORAS[:1])) != spec_hash(spec(loras=LORAS[:2]))
    changed_scale = [{**LORAS[0], "scale": 0.8}]
    assert spec_hash(spec(loras=LORAS[:1])) != spec_hash(spec(loras=changed_scale))


def test_loras_the_worker_cannot_run_are_refused_in_crd_terms() -> None:
    with pytest.raises(InvalidSpecError, match=r"^loras with quantization fp8: LoRA adapters"):
        validate(spec(loras=LORAS[:1], quantization="fp8"))
    with pytest.raises(InvalidSpecError, match=r"loras names style more than once"):
        validate(spec(loras=[LORAS[0], {**LORAS[2], "name": "style"}]))
    with pytest.raises(ValidationError):
        spec(loras=[{"name": "bad name", "imagePath": "/x"}])
