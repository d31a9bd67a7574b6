"""Serve from a rendered worker Pod's container as its securityContext says (see pod_sandbox)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import requests

from dlo_operator.render import WORKER_UID, Owner, render_engine_pods
from tests.support.deployments import deployment_spec
from tests.support.pod_sandbox import command, plan_container
from tests.support.ports import free_port

OWNER = Owner(name="flux", namespace="serving", uid="1234")
SCAFFOLDS = ["/mnt", "/home", "/var/cache"]
"""Directories covered by an empty tmpfs so the Pod's mountPaths can be made in them."""
MODEL_MOUNT_PATH = "/mnt/model"
"""This machine has no /models to mount on (the default mountPath)."""
NO_CAPABILITIES = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _tree(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for child in children for p in _tree(int(child)))]


def _root_is_read_only(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            read_only = "ro" in fields[5].split(",")
    return read_only


def serve_as_rendered_pod(
    model_dir: Path, work: Path, *, device: str, env: dict[str, str] | None = None
) -> dict:
    """Start the leader container of a DP=2 engine (two ranks, one Pod), check every process
    runs as the worker user with no capabilities, no_new_privs and a read-only root, send one
    request, SIGTERM it; returns the answer's status, content type and body, and the log.

    ``device`` replaces the rendered ``--device cuda`` where there is no GPU; ``env`` adds
    to the rendered environment (the machine's own settings, log level).
    """
    spec = deployment_spec(model={"hostPath": "/models/demo", "mountPath": MODEL_MOUNT_PATH})
    pod = render_engine_pods(OWNER, spec, 0)[0]
    (container,) = pod["spec"]["containers"]
    model = work / "node-models" / "demo"
    shutil.copytree(model_dir, model)
    subprocess.run(["chmod", "-R", "a+rX", str(work / "node-models")], check=True)
    http, rendezvous = free_port(), free_port()
    plan = plan_container(
        pod,
        container,
        host_paths={"model": str(model)},
        # No cluster DNS or fixed ports here: everything else as rendered.
        env_overrides={
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(rendezvous),
            "DLO_LOG_LEVEL": "info",  # the drain steps are logged at info
            **(env or {}),
        },
        argv_overrides={"--port": str(http), "--device": device},
        scaffolds=SCAFFOLDS,
    )
    assert plan.argv[:4] == ["dlo-worker", "launch", "--", "--nnodes=1"]
    assert plan.uid == plan.gid == WORKER_UID
    assert plan.capabilities == []
    process = subprocess.Popen(
        command(plan, work / "plan.json"),
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
            raise AssertionError("the sandboxed worker never became ready")
        ranks = _tree(process.pid)
        assert len(ranks) == 3  # the launcher (torchrun in its process) and its two ranks
        for pid in ranks:
            status = _status(pid)
            assert status["Uid"].split() == [str(WORKER_UID)] * 4
            assert status["Gid"].split() == [str(WORKER_UID)] * 4
            assert status["Groups"].split() == [str(WORKER_UID)]
            for capability_set in NO_CAPABILITIES:
                assert int(status[capability_set], 16) == 0, capability_set
            assert status["NoNewPrivs"] == "1"
            assert _root_is_read_only(pid)
        answer = requests.post(f"{url}/v1/generate", json={"seed": 1, "steps": 2}, timeout=300)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        log = process.communicate(timeout=120)[0]
    return {
        "status": answer.status_code,
        "content_type": answer.headers.get("Content-Type"),
        "body": answer.content,
        "log": log,
        "returncode": process.returncode,
    }


def assert_served_and_drained(result: dict) -> None:
    assert result["status"] == 200, result["log"][-3000:]
    assert result["content_type"] == "image/png"
    assert result["body"].startswith(b"\x89PNG")
    for step in ("intake closed", "dlo disabled", "process groups destroyed"):
        assert step in result["log"], (step, result["log"][-3000:])
    assert "Read-only file system" not in result["log"]
    assert "Permission denied" not in result["log"]
    # A clean drain is a clean exit (torchrun alone re-raised SIGTERM: exit 1, a traceback).
    assert result["returncode"] == 0, result["log"][-3000:]
    assert "Traceback" not in result["log"], result["log"][-3000:]
