"""A rendered worker Pod's process, started with exactly its user, capabilities, filesystem
and environment (as far as one machine allows: see tests/support/pod_sandbox.py), still
loads, joins its gloo world, serves and drains; the runtime-cache init step makes a fresh
node directory writable for the worker user.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from dlo_operator.render import WORKER_UID, Owner, render_engine_pods
from tests.support.deployments import deployment_spec
from tests.support.pod_sandbox import command, plan_container
from tests.support.ports import free_port

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")),
    reason="needs root, unshare and setpriv to apply a Pod's security context",
)

OWNER = Owner(name="flux", namespace="serving", uid="1234")
SCAFFOLDS = ["/mnt", "/home", "/var/cache"]
"""Directories covered by an empty tmpfs so the Pod's mountPaths can be made in them."""


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _tree(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for child in children for p in _tree(int(child)))]


def _root_mount_options(pid: int) -> list[str]:
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            options = fields[5].split(",")
    return options


def test_the_rendered_worker_pod_serves_as_its_user_without_capabilities(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    spec = deployment_spec(model={"hostPath": "/models/demo", "mountPath": "/mnt/model"})
    # /mnt/model: this machine has no /models to mount on (the default mountPath).
    pod = render_engine_pods(OWNER, spec, 0)[0]
    (container,) = pod["spec"]["containers"]
    model = tmp_path / "node-models" / "demo"
    shutil.copytree(demo_model_dir, model)
    subprocess.run(["chmod", "-R", "a+rX", str(model)], check=True)
    http, rendezvous = free_port(), free_port()
    plan = plan_container(
        pod,
        container,
        host_paths={"model": str(model)},
        # No cluster DNS, fixed ports or GPU on this machine: everything else as rendered.
        env_overrides={
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(rendezvous),
            "DLO_LOG_LEVEL": "info",  # the drain steps are logged at info
        },
        argv_overrides={"--port": str(http), "--device": "cpu"},
        scaffolds=SCAFFOLDS,
    )
    assert plan.argv[:2] == ["torchrun", "--nnodes=1"]
    assert plan.uid == plan.gid == WORKER_UID
    assert plan.capabilities == []
    process = subprocess.Popen(
        command(plan, tmp_path / "plan.json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[0]
            try:
                if requests.get(f"{url}/health/ready", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the sandboxed worker never became ready")
        ranks = _tree(process.pid)
        assert len(ranks) == 3  # torchrun and its two ranks
        for pid in ranks:
            status = _status(pid)
            assert status["Uid"].split() == [str(WORKER_UID)] * 4
            assert status["Gid"].split() == [str(WORKER_UID)] * 4
            assert status["Groups"].split() == [str(WORKER_UID)]
            for capability_set in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(status[capability_set], 16) == 0, capability_set
            assert status["NoNewPrivs"] == "1"
            assert "ro" in _root_mount_options(pid)
        answer = requests.post(f"{url}/v1/generate", json={"seed": 1, "steps": 2}, timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.headers["Content-Type"] == "image/png"
        assert answer.content.startswith(b"\x89PNG")
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        log = process.communicate(timeout=120)[0]
    for step in ("intake closed", "dlo disabled", "process groups destroyed"):
        assert step in log, (step, log[-3000:])
    assert "Read-only file system" not in log
    assert "Permission denied" not in log


def _run(plan, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(plan, path), capture_output=True, text=True, timeout=120, check=False
    )


def test_the_init_step_hands_a_fresh_cache_directory_to_the_worker_user(tmp_path: Path) -> None:
    spec = deployment_spec(
        model={"hostPath": "/models/demo", "mountPath": "/mnt/model"},
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
