"""A rendered worker Pod's process, started with exactly its user, capabilities, filesystem
and environment (as far as one machine allows: see tests/support/pod_sandbox.py), still
loads, joins its gloo world, serves and drains; the runtime-cache init step makes a fresh
node directory writable for the worker user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dlo_operator.render import WORKER_UID, render_engine_pods
from tests.support.deployments import deployment_spec
from tests.support.pod_sandbox import command, plan_container
from tests.support.rendered_pod import (
    MODEL_MOUNT_PATH,
    OWNER,
    SCAFFOLDS,
    assert_served_and_drained,
    serve_as_rendered_pod,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")),
    reason="needs root, unshare and setpriv to apply a Pod's security context",
)


def test_the_rendered_worker_pod_serves_as_its_user_without_capabilities(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """gloo initialises and the engine serves and drains (``--device cpu``: no GPU here)."""
    assert_served_and_drained(serve_as_rendered_pod(demo_model_dir, tmp_path, device="cpu"))


def _run(plan, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(plan, path), capture_output=True, text=True, timeout=120, check=False
    )


def test_the_init_step_hands_a_fresh_cache_directory_to_the_worker_user(tmp_path: Path) -> None:
    spec = deployment_spec(
        model={"hostPath": "/models/demo", "mountPath": MODEL_MOUNT_PATH},
        offload={"useAllGather": False, "runtimeCache": {"enabled": True}},
    )
    pod = render_engine_pods(OWNER, spec, 0)[0]
    (init,) = pod["spec"]["initContainers"]
    (worker,) = pod["spec"]["containers"]
    node_directory = tmp_path / "var-cache-dlo-worker"
    node_directory.mkdir(mode=0o755)  # what the kubelet makes for DirectoryOrCreate
    volumes = {"runtime-cache": str(node_directory), "model": str(tmp_path)}
    probe = {
        **worker,
        "command": ["python", "-c", "open('/var/cache/dlo-worker/entry', 'w').write('ok')"],
    }

    def plan_for(container: dict) -> object:
        return plan_container(
            pod,
            container,
            host_paths=volumes,
            env_overrides={},
            argv_overrides={},
            scaffolds=SCAFFOLDS,
        )

    refused = _run(plan_for(probe), tmp_path / "before.json")
    assert refused.returncode != 0
    assert "Permission denied" in refused.stderr
    init_plan = plan_for(init)
    assert init_plan.uid == 0
    assert init_plan.capabilities == ["chown"]
    handed = _run(init_plan, tmp_path / "init.json")
    assert handed.returncode == 0, handed.stderr
    written = _run(plan_for(probe), tmp_path / "after.json")
    assert written.returncode == 0, written.stderr
    entry = node_directory / "entry"
    assert entry.read_text() == "ok"
    assert (entry.stat().st_uid, node_directory.stat().st_uid) == (WORKER_UID, WORKER_UID)


def test_a_read_only_cache_directory_is_left_to_the_workers_fallback(tmp_path: Path) -> None:
    """The init step's chown failed on a read-only host directory, so the engine looped
    before the worker could fall back (cache-read-only) as documented."""
    spec = deployment_spec(
        model={"hostPath": "/models/demo", "mountPath": MODEL_MOUNT_PATH},
        offload={"useAllGather": False, "runtimeCache": {"enabled": True}},
    )
    pod = render_engine_pods(OWNER, spec, 0)[0]
    (init,) = pod["spec"]["initContainers"]
    read_only = {**init, "volumeMounts": [{**init["volumeMounts"][0], "readOnly": True}]}
    node_directory = tmp_path / "var-cache-dlo-worker"
    node_directory.mkdir(mode=0o755)
    plan = plan_container(
        pod,
        read_only,
        host_paths={"runtime-cache": str(node_directory), "model": str(tmp_path)},
        env_overrides={},
        argv_overrides={},
        scaffolds=SCAFFOLDS,
    )
    result = _run(plan, tmp_path / "init.json")
    assert result.returncode == 0, result.stderr
    assert "the worker falls back to its ordinary tensors" in result.stdout + result.stderr
    assert node_directory.stat().st_uid == 0  # untouched
