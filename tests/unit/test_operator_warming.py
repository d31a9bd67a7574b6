"""Per-node runtime-cache warming: eligible nodes, the warm Jobs, node states and placement."""

from __future__ import annotations

from dlo_operator.api import DiffusionDeploymentStatus
from dlo_operator.reconcile import reconcile
from dlo_operator.render import (
    GPU_RESOURCE,
    LABEL_DEPLOYMENT,
    Owner,
    render_warm_job,
    warm_template_hash,
    worker_arguments,
)
from dlo_operator.warming import (
    FAILED,
    PENDING,
    WARM,
    WARMING,
    ObservedJob,
    ObservedNode,
    eligible_nodes,
)
from tests.support.deployments import deployment_spec

OWNER = Owner(name="flux", namespace="serving", uid="1234")
CACHE = {"useAllGather": False, "runtimeCache": {"enabled": True}}
NODES = [
    ObservedNode("gpu-a", {"pool": "h200"}, gpus=8),
    ObservedNode("gpu-b", {"pool": "h200"}, gpus=8),
    ObservedNode("gpu-c", {"pool": "h200"}, gpus=8, ready=False),
    ObservedNode("gpu-d", {"pool": "h200"}, gpus=8, schedulable=False),
    ObservedNode("gpu-e", {"pool": "a100"}, gpus=8),
    ObservedNode("cpu-f", {"pool": "h200"}, gpus=0),
]


def spec(**overrides: object):
    return deployment_spec(
        offload=CACHE, scheduling={"nodeSelector": {"pool": "h200"}}, **overrides
    )


def test_eligible_nodes_are_ready_schedulable_selected_and_hold_the_gpus() -> None:
    assert [node.name for node in eligible_nodes(spec(), NODES)] == ["gpu-a", "gpu-b"]


def test_cpu_engines_warm_on_every_selected_node_gpus_or_not() -> None:
    eligible = eligible_nodes(spec(accelerator="none", gpusPerNode=1), NODES)
    assert [node.name for node in eligible] == ["cpu-f", "gpu-a", "gpu-b"]


def test_a_warm_job_runs_cache_warm_with_the_engines_flags_on_its_node_without_gpus() -> None:
    job = render_warm_job(OWNER, spec(), "gpu-a")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["nodeName"] == "gpu-a"
    assert container["command"][:3] == ["dlo-worker", "cache", "warm"]
    serve = worker_arguments(spec())
    assert container["command"][3:] == serve[1 : serve.index("--port")]
    assert GPU_RESOURCE not in container["resources"]["requests"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "runtime-cache", "mountPath": "/var/cache/dlo-worker"} in container[
        "volumeMounts"
    ]
    assert pod["initContainers"][0]["name"] == "runtime-cache-owner"
    assert pod["automountServiceAccountToken"] is False
    # Not an engine Pod: the operator lists engine Pods by the deployment label.
    assert LABEL_DEPLOYMENT not in job["spec"]["template"]["metadata"]["labels"]
    assert len(job["metadata"]["name"]) <= 63


def _job(node: str, state: str, template_hash: str, reason: str = "") -> ObservedJob:
    return ObservedJob(f"flux-warm-{node}", node, template_hash, state, reason)


def test_reconcile_creates_one_warm_job_per_eligible_node_and_reports_each_state() -> None:
    desired = spec()
    actions = reconcile(OWNER, desired, 1, [], DiffusionDeploymentStatus(), nodes=NODES)
    jobs = [item for item in actions.apply_children if item["kind"] == "Job"]
    assert sorted(job["spec"]["template"]["spec"]["nodeName"] for job in jobs) == [
        "gpu-a",
        "gpu-b",
    ]
    assert actions.status.cache.warm == "0/2"
    assert {n.node: n.state for n in actions.status.cache.nodes} == {
        "gpu-a": PENDING,
        "gpu-b": PENDING,
    }

    current = warm_template_hash(desired)
    observed = [_job("gpu-a", WARM, current), _job("gpu-b", FAILED, current, "DeadlineExceeded")]
    actions = reconcile(
        OWNER, desired, 1, [], DiffusionDeploymentStatus(), nodes=NODES, jobs=observed
    )
    states = {n.node: (n.state, n.reason) for n in actions.status.cache.nodes}
    assert states == {"gpu-a": (WARM, ""), "gpu-b": (FAILED, "DeadlineExceeded")}
    assert actions.status.cache.warm == "1/2"
    # New engine Pods prefer the warm node.
    (pod,) = [p for p in actions.create_pods if p["metadata"]["name"] == "flux-e0-n0"]
    preferred = pod["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert preferred[0]["preference"]["matchExpressions"][0]["values"] == ["gpu-a"]


def test_a_jobs_state_follows_its_conditions() -> None:
    def job(status: dict) -> ObservedJob:
        return ObservedJob.from_manifest(
            {
                "metadata": {
                    "name": "j",
                    "labels": {"dlo.dev/cache-warm": "h"},
                    "annotations": {"dlo.dev/node": "gpu-a"},
                },
                "status": status,
            }
        )

    assert job({}).state == PENDING
    assert job({"active": 1}).state == WARMING
    assert job({"conditions": [{"type": "Complete", "status": "True"}]}).state == WARM
    failed = job(
        {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    )
    assert (failed.state, failed.reason, failed.node) == (FAILED, "BackoffLimitExceeded", "gpu-a")


def test_without_the_runtime_cache_nothing_warms() -> None:
    plain = deployment_spec()
    actions = reconcile(OWNER, plain, 1, [], DiffusionDeploymentStatus(), nodes=NODES)
    assert not [item for item in actions.apply_children if item["kind"] == "Job"]
    assert actions.status.cache is None


def test_a_new_warm_template_replaces_the_jobs() -> None:
    old, new = spec(), spec(worker={"image": "dlo-worker:0.2"})
    assert warm_template_hash(old) != warm_template_hash(new)
    first = {job["metadata"]["name"] for job in [render_warm_job(OWNER, old, "gpu-a")]}
    second = {job["metadata"]["name"] for job in [render_warm_job(OWNER, new, "gpu-a")]}
    assert first.isdisjoint(second)


def test_a_pass_builds_the_worker_configuration_once_and_renders_from_it(monkeypatch) -> None:
    """Validation resolves the spec into the worker configuration; every engine Pod's
    command and every warm Job's are rendered from that one result, and the warm template
    is rendered once for all nodes."""
    from dlo_operator import reconcile as reconcile_module
    from dlo_operator import render, workerconfig

    built: list[object] = []
    real = workerconfig.build_config
    monkeypatch.setattr(
        workerconfig, "build_config", lambda values: built.append(values) or real(values)
    )
    rendered: list[object] = []
    real_template = render.warm_template

    def counted_template(*args: object, **kwargs: object) -> dict:
        rendered.append(args)
        return real_template(*args, **kwargs)

    for module in (render, reconcile_module):
        monkeypatch.setattr(module, "warm_template", counted_template)
    desired = spec(replicas=2, parallelism={"data": 2}, gpusPerNode=1)
    actions = reconcile(OWNER, desired, 1, [], DiffusionDeploymentStatus(), nodes=NODES)
    assert len(actions.create_pods) == 4
    assert len([item for item in actions.apply_children if item["kind"] == "Job"]) == 2
    assert len(built) == 1
    assert len(rendered) == 1
    commands = {tuple(pod["spec"]["containers"][0]["command"]) for pod in actions.create_pods}
    assert len(commands) == 1
