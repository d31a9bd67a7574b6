"""``dlo-worker serve`` end to end: real HTTP, real torchrun, real gloo AllGather.

The reference is a resident single-process server, itself checked against
``dlo-worker generate``. A DP=2 AllGather engine must return the same bytes for the
same requests sent concurrently (lockstep waves with dummy lanes), and SIGTERM must
finish the request in flight before disabling DLO and destroying the process groups.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.support.in_process import run_dlo_worker
from tests.support.launch import (
    launch_command,
    rank_logs,
    torchrun_arguments,
    torchrun_command,
    wait_for_ranks,
)
from tests.support.ports import free_port
from tests.support.serving import ENV, Server, digest, serve_command

REQUESTS = (
    {"seed": 5, "steps": 4},
    {"seed": 6, "steps": 4},
    {"seed": 7, "steps": 3},
)


@pytest.fixture(scope="module")
def resident_digests(demo_model_dir: Path) -> dict[int, str]:
    port = free_port()
    server = Server(
        [sys.executable, "-m", "dlo_worker", *serve_command(demo_model_dir, port)], port
    )
    try:
        server.wait_ready()
        responses = {body["seed"]: server.generate(body) for body in REQUESTS}
    finally:
        output = server.stop()
    assert server.process.returncode == 0, output
    for response in responses.values():
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"] == "image/png"
    return {seed: digest(response.content) for seed, response in responses.items()}


def test_served_image_equals_the_generate_command(
    demo_model_dir: Path, tmp_path: Path, resident_digests: dict[int, str]
) -> None:
    out = tmp_path / "generated.png"
    model = ["--model", str(demo_model_dir), "--device", "cpu"]
    generated = run_dlo_worker(
        ["generate", *model, "--seed", "5", "--steps", "4", "--out", str(out)]
    )
    assert generated.returncode == 0, generated.stderr
    assert digest(out.read_bytes()) == resident_digests[5]


def test_serve_defaults_fill_what_a_request_leaves_out_and_are_checked_at_start(
    demo_model_dir: Path, resident_digests: dict[int, str]
) -> None:
    """``--default-steps 3`` makes ``{"seed": 7}`` the resident ``{"seed": 7, "steps": 3}``;
    a default the pipeline cannot take (DiT draws one size) ends start-up in one line."""
    port = free_port()
    command = [sys.executable, "-m", "dlo_worker", *serve_command(demo_model_dir, port)]
    server = Server([*command, "--default-steps", "3"], port)
    try:
        server.wait_ready()
        defaulted = server.generate({"seed": 7})
        explicit = server.generate({"seed": 5, "steps": 4})
    finally:
        server.stop()
    assert digest(defaulted.content) == resident_digests[7]
    assert digest(explicit.content) == resident_digests[5]

    # Refused before it serves: in this process.
    refused = run_dlo_worker([*serve_command(demo_model_dir, port), "--default-width", "64"])
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr
    assert "--default-width: DiTPipeline draws 128x128 images only; leave --default-width out" in (
        refused.stderr
    )


def assert_in_order(log: str, *messages: str) -> None:
    positions = [log.index(f'msg="{message}"') for message in messages]
    assert positions == sorted(positions), list(zip(messages, positions, strict=True))


def test_allgather_engine_serves_resident_bytes_and_drains_on_sigterm(
    demo_model_dir: Path, tmp_path: Path, resident_digests: dict[int, str]
) -> None:
    port, log_dir = free_port(), tmp_path / "logs"
    arguments = serve_command(
        demo_model_dir,
        port,
        "--enable-distributed-layerwise-offload",
        "--data-parallel-size",
        "2",
    )
    server = Server(
        torchrun_command(arguments, log_dir),
        port,
    )
    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            responses = list(pool.map(server.generate, REQUESTS))
        for body, response in zip(REQUESTS, responses, strict=True):
            assert response.status_code == 200, response.text
            assert digest(response.content) == resident_digests[body["seed"]]
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
        assert 'dlo_requests_total{outcome="ok"} 3.0' in metrics
        # This rank's calls, split by stage: the same count for each (no text encoder).
        stage_counts = dict(
            re.findall(r'dlo_request_stage_seconds_count\{stage="(\w+)"\} ([0-9.]+)', metrics)
        )
        assert set(stage_counts) == {"denoising", "decode", "png"}, stage_counts
        assert len(set(stage_counts.values())) == 1
        assert float(stage_counts["png"]) >= 1

        in_flight: dict[str, requests.Response] = {}
        slow = threading.Thread(
            target=lambda: in_flight.setdefault("response", server.generate({"steps": 60}))
        )
        slow.start()
        time.sleep(3)  # inside the slow request's denoising loop
        server.process.send_signal(signal.SIGTERM)
        slow.join(timeout=120)
        assert in_flight["response"].status_code == 200
        assert in_flight["response"].content.startswith(b"\x89PNG")
    finally:
        output = server.stop()
    logs = rank_logs(log_dir)
    assert sorted(logs) == [0, 1], output
    for rank, log in logs.items():
        assert "lockstep=True" in log
        if rank == 1:  # the slow request ran alone: rank 1 ran its discarded copy
            assert "discarded=True" in log
        drain = ["intake closed, draining"] if rank == 0 else []
        assert_in_order(
            log,
            *drain,
            "engine drained",
            "dlo disabled",
            "process groups destroyed",
        )


def test_requests_are_validated_against_the_model_and_sigterm_closes_intake_at_once(
    demo_model_dir: Path,
) -> None:
    """Kubernetes stops routing to a Pod whose readiness fails: it must fail at once, not
    when the wave in flight ends. The long request still completes."""
    port = free_port()
    server = Server(
        [sys.executable, "-m", "dlo_worker", *serve_command(demo_model_dir, port)], port
    )
    try:
        server.wait_ready()
        # Requests are validated against the loaded pipeline (a DiT of 1000 classes).
        for body, says in (
            ({"class_label": 999999}, "class_label: 999999 is not a class of this model (0-999)"),
            ({"prompt": "a cat"}, "prompt: DiTPipeline is class-conditional"),
            ({"guidance_scale": 1e30}, "guidance_scale"),
        ):
            refused = server.generate(body)
            assert refused.status_code == 422, refused.text
            assert says in refused.json()["error"]
        in_flight: dict[str, requests.Response] = {}
        slow = threading.Thread(
            target=lambda: in_flight.setdefault("response", server.generate({"steps": 400}))
        )
        slow.start()
        time.sleep(2)  # inside the long request's denoising loop
        assert slow.is_alive()
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while requests.get(f"{server.url}/health/ready", timeout=2).status_code != 503:
            assert time.monotonic() - signalled < 1.0, "readiness still 200 a second after SIGTERM"
            time.sleep(0.02)
        ready = requests.get(f"{server.url}/health/ready", timeout=2)
        assert ready.json()["status"] == "draining"
        assert ready.headers["Server"] == "dlo-worker"  # no Python or library versions
        refused = server.generate({"steps": 2})
        assert refused.status_code == 503
        assert refused.headers["Retry-After"]
        assert time.monotonic() - signalled < 1.5
        assert slow.is_alive()  # the long request is still running
        slow.join(timeout=300)
        assert in_flight["response"].status_code == 200
        assert in_flight["response"].content.startswith(b"\x89PNG")
    finally:
        output = server.stop()
    assert_in_order(output, "intake closed, draining", "engine drained")


def test_an_api_key_guards_generation_and_leaves_health_open(demo_model_dir: Path) -> None:
    port = free_port()
    server = Server(
        [sys.executable, "-m", "dlo_worker", *serve_command(demo_model_dir, port)],
        port,
        env={"DLO_API_KEY": "s3cret"},
    )
    url = f"{server.url}/v1/generate"
    try:
        server.wait_ready()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = requests.post(url, json={"steps": 2}, headers=headers, timeout=60)
            assert refused.status_code == 401, headers
            assert refused.headers["WWW-Authenticate"] == "Bearer"
            assert "Traceback" not in refused.text
        served = requests.post(
            url, json={"steps": 2}, headers={"Authorization": "Bearer s3cret"}, timeout=600
        )
        assert served.status_code == 200
        assert served.content.startswith(b"\x89PNG")
        assert requests.get(f"{server.url}/metrics", timeout=5).status_code == 200
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
        assert 'dlo_requests_total{outcome="rejected_unauthorized"} 3.0' in metrics
    finally:
        server.stop()


def test_a_stop_that_torchrun_loses_track_of_still_stops_every_rank(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """A SIGTERM landing after torchrun's last fork and before it records the ranks made it
    shut down none of them: ``launch`` said both ranks ended and exited, while they went on
    loading and serving, holding the port and the Pod's log pipe."""
    pids_file, log = tmp_path / "rank-pids", tmp_path / "launch.log"
    flags = ("--data-parallel-size", "2")
    command = [
        sys.executable,
        "-m",
        "tests.support.signalled_launch",
        *torchrun_arguments(serve_command(demo_model_dir, free_port(), *flags)),
    ]
    with log.open("w") as sink:  # a file, not a pipe: leftover ranks would hold a pipe open
        launcher = subprocess.run(
            command,
            check=False,
            env={**ENV, "DLO_TEST_RANK_PIDS": str(pids_file)},
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=120,
        )
    output = log.read_text()
    pids = [int(pid) for pid in pids_file.read_text().split()]
    running = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    for pid in running:  # leave no process behind when the assertion fails
        os.kill(pid, signal.SIGKILL)
    assert len(pids) == 2
    assert not running, f"ranks {running} outlived the launcher:\n{output}"
    assert "torchrun ended with ranks still running" in output
    assert launcher.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").glob("*")
        for child in (task / "children").read_text().split()
    ]


def _alive(pid: int) -> bool:
    """Running (not exited, nor a zombie its new parent has yet to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_stop_when_their_launcher_is_killed(demo_model_dir: Path, tmp_path: Path) -> None:
    """Issue 61: after ``kill -9`` of ``dlo-worker launch`` both DP ranks kept serving the
    port, and the launcher's ``dlo-exit-*`` directory stayed. Killed while its ranks start,
    the earliest moment: each rank still stops and the directory is removed."""
    flags = ("--data-parallel-size", "2")
    log = tmp_path / "launch.log"
    with log.open("w") as sink:  # a file, not a pipe: leftover ranks would hold a pipe open
        launcher = subprocess.Popen(
            launch_command(serve_command(demo_model_dir, free_port(), *flags)),
            env=ENV,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    wait_for_ranks(launcher.pid)
    ranks = _children(launcher.pid)
    environment = Path(f"/proc/{ranks[0]}/environ").read_bytes().split(b"\0")
    (exit_dir,) = [item.split(b"=", 1)[1] for item in environment if item.startswith(b"DLO_EXIT")]
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60
    while (running := [pid for pid in ranks if _alive(pid)]) and (time.monotonic() < deadline):
        time.sleep(0.2)
    for pid in running:  # leave no process behind when the assertion fails
        os.kill(pid, signal.SIGKILL)
    assert not running, f"ranks {running} outlived their launcher:\n{log.read_text()}"
    assert not Path(exit_dir.decode()).exists()


def test_a_rank_killed_mid_wave_answers_its_requests_503_and_stops_the_engine(
    demo_model_dir: Path,
) -> None:
    """Issue 61: with a follower rank killed mid-wave the in-flight request got uvicorn's
    plain-text 500 after its 5 s shutdown grace, with two tracebacks. The leader answers it
    (and anything queued) with a JSON 503 another replica can retry, and exits 1 in one
    line."""
    port = free_port()
    server = Server(
        launch_command(serve_command(demo_model_dir, port, "--data-parallel-size", "2")), port
    )
    try:
        server.wait_ready()
        in_flight: dict[str, requests.Response] = {}
        slow = threading.Thread(
            target=lambda: in_flight.setdefault("response", server.generate({"steps": 200}))
        )
        slow.start()
        time.sleep(2)  # inside the slow request's denoising loop
        (follower,) = [pid for pid in _children(server.process.pid) if _rank_of(pid) == 1]
        os.kill(follower, signal.SIGKILL)
        slow.join(timeout=120)
        output = server.process.communicate(timeout=120)[0]  # the launcher ends by itself
    finally:
        server.stop()
    answer = in_flight["response"]
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "5"
    assert answer.json()["error"].startswith(
        "the engine stopped: a rank of its group is gone (Connection closed by peer"
    )
    assert server.process.returncode == 1, output
    assert "dlo-worker serve: error: the engine stopped" in output
    assert "Traceback" not in output


def _rank_of(pid: int) -> int:
    environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (rank,) = [item[len(b"RANK=") :] for item in environment if item.startswith(b"RANK=")]
    return int(rank)


def test_a_drained_engine_exits_0_and_a_stop_while_loading_names_the_ranks(
    demo_model_dir: Path,
) -> None:
    """torchrun re-raised the SIGTERM it forwarded after its ranks drained cleanly: exit 1
    and a traceback, so every graceful stop ended the Pod in Error. Under ``launch`` the
    ranks report how their drain ended."""
    port = free_port()
    flags = ("--data-parallel-size", "2", "--enable-distributed-layerwise-offload")
    server = Server(launch_command(serve_command(demo_model_dir, port, *flags)), port)
    server.wait_ready()
    assert server.generate({"seed": 1, "steps": 2}).status_code == 200
    output = server.stop()
    assert server.process.returncode == 0, output
    assert "Traceback" not in output
    assert "process groups destroyed" in output

    early_port = free_port()
    early = Server(launch_command(serve_command(demo_model_dir, early_port, *flags)), early_port)
    wait_for_ranks(early.process.pid)  # the ranks import torch: no drain to finish yet
    output = early.stop()
    assert early.process.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output
    (line,) = [x for x in output.splitlines() if x.startswith("dlo-worker launch: error:")]
    assert "local rank 0 ended before its drain finished" in line
