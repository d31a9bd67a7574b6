"""The worker's HTTP endpoints over a real socket: probes, routing, request validation,
and the HTTP layer's limits (framing, deadlines, bursts, slow and departing clients).

Generation itself is covered end to end in tests/integration/test_serve.py; these
paths answer before a request reaches the engine (the queue here has no engine).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client import REGISTRY

from dlo_worker.engine.request import RequestLimits
from dlo_worker.engine.waves import RequestQueue
from dlo_worker.serving.server import (
    GENERATE_PATH,
    HTTPLimits,
    Phase,
    ServerState,
    WorkerHTTPServer,
)

# Short deadlines so the tests that wait for them stay quick.
LIMITS = HTTPLimits(header_timeout_s=1.0, body_timeout_s=1.0)


@pytest.fixture
def leader() -> Iterator[tuple[str, ServerState]]:
    state = ServerState(RequestQueue(max_pending=4), model_name="demo")
    server = WorkerHTTPServer("127.0.0.1", 0, state, LIMITS)
    server.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.stop()


def test_probes_follow_the_phase(leader: tuple[str, ServerState]) -> None:
    url, state = leader
    assert requests.get(f"{url}/health/live", timeout=5).status_code == 200
    ready = requests.get(f"{url}/health/ready", timeout=5)
    assert (ready.status_code, ready.json()) == (503, {"status": "loading"})
    state.set_phase(Phase.READY)
    assert requests.get(f"{url}/health/ready", timeout=5).status_code == 200
    state.set_phase(Phase.DRAINING)
    ready = requests.get(f"{url}/health/ready", timeout=5)
    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
    assert requests.get(f"{url}/health/live", timeout=5).status_code == 200


def test_generate_is_refused_while_intake_is_closed(leader: tuple[str, ServerState]) -> None:
    url, _ = leader
    response = requests.post(f"{url}{GENERATE_PATH}", json={"seed": 1}, timeout=5)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert "not accepting" in response.json()["error"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"steps": 0}, "steps: Input should be greater than or equal to 1"),
        ({"seed": 1, "colour": "red"}, "colour: Extra inputs are not permitted"),
        ("not json", "Invalid JSON"),
        ({"guidance_scale": "nan"}, "guidance_scale"),
    ],
)
def test_invalid_bodies_get_422_naming_the_field(
    leader: tuple[str, ServerState], body: object, expected: str
) -> None:
    url, state = leader
    state.queue.open()
    payload = body if isinstance(body, str) else json.dumps(body)
    response = requests.post(f"{url}{GENERATE_PATH}", data=payload, timeout=5)
    assert response.status_code == 422
    assert expected in response.json()["error"]
    assert len(state.queue) == 0


def _declared_oversize_status(url: str) -> int:
    """POST the headers of a 2 MiB body and nothing else: the server refuses from the
    declared length and closes at once, so a client still writing 2 MiB could see a
    connection reset instead of the answer (it did, now and then). Its status."""
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=5)
    try:
        connection.putrequest("POST", GENERATE_PATH)
        connection.putheader("Content-Length", str(2 << 20))
        connection.endheaders()
        response = connection.getresponse()
        assert "body over" in json.loads(response.read())["error"]
        return response.status
    finally:
        connection.close()


def test_a_body_over_the_limit_is_refused(leader: tuple[str, ServerState]) -> None:
    """Refused from the declared length, before the body is read."""
    assert _declared_oversize_status(leader[0]) == 413


def test_only_refused_requests_count_as_rejected_invalid(
    leader: tuple[str, ServerState],
) -> None:
    """A request with a body that is not refused for it (here: intake closed, 503) leaves
    ``rejected_invalid`` alone; one over the size limit counts once (issue 61: every
    request with a body counted, the 413 being built before it was needed)."""
    url, _ = leader
    before = _counter("rejected_invalid")
    for _ in range(3):
        response = requests.post(f"{url}{GENERATE_PATH}", json={"seed": 1}, timeout=5)
        assert response.status_code == 503
    assert _counter("rejected_invalid") == before
    assert _declared_oversize_status(url) == 413
    assert _counter("rejected_invalid") == before + 1


def test_unknown_routes_and_non_leaders(leader: tuple[str, ServerState]) -> None:
    url, _ = leader
    assert requests.get(f"{url}/v1/nothing", timeout=5).status_code == 404
    follower = WorkerHTTPServer("127.0.0.1", 0, ServerState(queue=None))
    follower.start()
    try:
        follower_url = f"http://127.0.0.1:{follower.server_address[1]}"
        response = requests.post(f"{follower_url}{GENERATE_PATH}", json={}, timeout=5)
        assert response.status_code == 421
        assert "leader" in response.json()["error"]
    finally:
        follower.stop()


def test_metrics_are_exposed(leader: tuple[str, ServerState]) -> None:
    url, state = leader
    state.set_phase(Phase.READY)
    body = requests.get(f"{url}/metrics", timeout=5).text
    assert "dlo_ready 1.0" in body
    assert "dlo_request_queue_depth" in body


def test_query_strings_are_ignored_and_wrong_methods_get_405(
    leader: tuple[str, ServerState],
) -> None:
    url, state = leader
    state.set_phase(Phase.READY)
    assert requests.get(f"{url}/health/ready?probe=kubelet", timeout=5).status_code == 200
    for method, path, allow in (
        ("GET", GENERATE_PATH, "POST"),
        ("PUT", GENERATE_PATH, "POST"),
        ("DELETE", "/health/ready", "GET"),
        ("POST", "/metrics", "GET"),
    ):
        response = requests.request(method, f"{url}{path}", timeout=5)
        assert response.status_code == 405, (method, path)
        assert response.headers["Allow"] == allow


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _exchange(url: str, raw: bytes, timeout: float = 5) -> str:
    """Send raw bytes and read the answer until the server closes the connection."""
    with socket.create_connection(_address(url), timeout=timeout) as connection:
        connection.sendall(raw)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_both_framing_headers_are_refused(leader: tuple[str, ServerState]) -> None:
    """Content-Length beside Transfer-Encoding is a request-smuggling shape: 400, closed."""
    answer = _exchange(
        leader[0],
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    assert answer.startswith("HTTP/1.1 400")
    assert "Content-Length together with Transfer-Encoding is not accepted" in answer


def test_a_chunked_body_is_read_and_validated(leader: tuple[str, ServerState]) -> None:
    url, state = leader
    state.queue.open()
    body = b'{"steps": 0}'
    answer = _exchange(
        url,
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n",
    )
    assert answer.startswith("HTTP/1.1 422")
    assert "steps: Input should be greater than or equal to 1" in answer


def test_a_body_shorter_than_its_content_length_gets_408(
    leader: tuple[str, ServerState],
) -> None:
    started = time.monotonic()
    answer = _exchange(
        leader[0], b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}"
    )
    assert answer.startswith("HTTP/1.1 408")
    assert "Content-Length larger than the body" in answer
    assert time.monotonic() - started < LIMITS.body_timeout_s + 2


def test_partial_headers_are_closed_at_the_header_deadline(
    leader: tuple[str, ServerState],
) -> None:
    """A client trickling headers (slowloris) is cut off, even if it keeps sending."""
    started = time.monotonic()
    with socket.create_connection(_address(leader[0]), timeout=10) as connection:
        connection.sendall(b"GET /health/live HTTP/1.1\r\n")
        closed = False
        while time.monotonic() - started < 5 and not closed:
            try:
                connection.sendall(b"X-Slow: 1\r\n")
                connection.settimeout(0.3)
                closed = connection.recv(1024) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
    assert closed
    assert time.monotonic() - started < LIMITS.header_timeout_s + 2


async def _burst(host: str, port: int, connections: int) -> list[str]:
    """Open ``connections`` at once, then send one request on each (no client threads)."""

    async def one() -> str:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        return answer.decode()

    return await asyncio.gather(*(one() for _ in range(connections)))


def test_a_burst_of_200_connections_is_served_without_stalls_or_threads(
    leader: tuple[str, ServerState],
) -> None:
    """The stdlib server's backlog of 5 stalled every sixth connect of a burst for a second
    (the kernel dropped it, and the client sent its SYN again a second later) and spent a
    thread per connection; here the kernel drops none (its listen-overflow counter stays,
    which no CPU contention changes, unlike a wall-clock bound) and no thread is added."""
    url, state = leader
    state.set_phase(Phase.READY)
    threads_before = threading.active_count()
    overflows_before = _listen_overflows()
    answers = asyncio.run(_burst(*_address(url), connections=200))
    assert all(answer.startswith("HTTP/1.1 200") for answer in answers)
    assert _listen_overflows() == overflows_before
    assert threading.active_count() <= threads_before
    # The accept queue the kernel was given (ss's Send-Q of a listener): room for a burst.
    port = _address(url)[1]
    listener = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(listener[2]) == LIMITS.backlog >= 2048


def _listen_overflows() -> int:
    """Connections this network namespace's listeners dropped for a full accept queue."""
    names, values = [
        line.split()
        for line in Path("/proc/net/netstat").read_text().splitlines()
        if line.startswith("TcpExt:")
    ]
    return int(values[names.index("ListenOverflows")])


def test_slow_clients_hold_no_threads_and_do_not_block_others(
    leader: tuple[str, ServerState],
) -> None:
    url, state = leader
    state.set_phase(Phase.READY)
    threads_before = threading.active_count()
    slow = [socket.create_connection(_address(url), timeout=5) for _ in range(300)]
    try:
        for connection in slow:
            connection.sendall(b"GET /health/ready HTTP/1.1\r\nHost:")
        started = time.monotonic()
        assert requests.get(f"{url}/health/ready", timeout=5).status_code == 200
        assert time.monotonic() - started < 0.5
        assert threading.active_count() <= threads_before
    finally:
        for connection in slow:
            connection.close()


def _counter(outcome: str) -> float:
    value = REGISTRY.get_sample_value("dlo_requests_total", {"outcome": outcome})
    return value or 0.0


def test_a_request_whose_client_left_is_dropped_before_its_wave(
    leader: tuple[str, ServerState],
) -> None:
    url, state = leader
    state.queue.open()
    dropped_before = _counter("dropped_disconnected")
    body = b'{"seed": 3}'
    with socket.create_connection(_address(url), timeout=5) as connection:
        connection.sendall(
            b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 5
        while len(state.queue) == 0:
            assert time.monotonic() < deadline, "the request never reached the queue"
            time.sleep(0.01)
    # The client hung up while queued: the request is cancelled and never runs.
    deadline = time.monotonic() + 5
    while state.queue.drop_cancelled() == 0:
        assert time.monotonic() < deadline, "the departed client's request stayed queued"
        time.sleep(0.01)
    taken, wave = state.queue.take_wave(width=1, lockstep=False, timeout=0)
    assert (taken, wave.empty, len(state.queue)) == ([], True, 0)
    assert _counter("dropped_disconnected") == dropped_before + 1


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({}, 422, "prompt", "Field required"),
        ({"prompt": "a cat", "size": "big"}, 422, "size", '"WIDTHxHEIGHT"'),
        ({"prompt": "a cat", "response_format": "url"}, 422, "response_format", "b64_json"),
        ({"prompt": "a cat", "n": 9}, 422, "n", "less than or equal to 8"),
        ({"prompt": "a cat", "quality": "hd"}, 422, "quality", "Extra inputs"),
        ({"prompt": "a cat", "model": "dall-e-3"}, 404, "model", "this worker serves 'demo'"),
    ],
)
def test_openai_images_errors_take_openai_shape(
    leader: tuple[str, ServerState], body: dict, status: int, param: str, says: str
) -> None:
    url, state = leader
    state.queue.open()
    response = requests.post(f"{url}/v1/images/generations", json=body, timeout=5)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param
    assert says in error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error")
    assert len(state.queue) == 0


def test_models_lists_the_served_model(leader: tuple[str, ServerState]) -> None:
    models = requests.get(f"{leader[0]}/v1/models", timeout=5).json()
    assert [model["id"] for model in models["data"]] == ["demo"]


def test_the_openai_client_reads_every_answer_of_the_openai_routes(
    leader: tuple[str, ServerState],
) -> None:
    """Issue 61: ``GET /v1/models/{id}`` and the image routes this worker does not serve
    (edits, variations) answered bodies the OpenAI client could not read."""
    url, _ = leader
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.retrieve("demo")
    assert (model.id, model.object, model.owned_by) == ("demo", "model", "dlo-worker")
    assert model.created == client.models.list().data[0].created > 0
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("dall-e-3")
    assert missing.value.param == "model"
    assert "this worker serves 'demo', not 'dall-e-3'" in missing.value.message
    unserved = {
        "/v1/images/edits": lambda: client.images.edit(image=b"png", prompt="a cat"),
        "/v1/images/variations": lambda: client.images.create_variation(image=b"png"),
        "/v1/chat/completions": lambda: client.chat.completions.create(model="demo", messages=[]),
    }
    for path, call in unserved.items():
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.type == "not_found_error", path
        assert isinstance(refused.value.body, dict), path
        assert refused.value.body["message"] == f"no route {path}"


def test_the_api_key_guards_the_v1_routes_and_leaves_health_and_metrics_open() -> None:
    state = ServerState(RequestQueue(max_pending=4), api_key="s3cret", model_name="demo")
    server = WorkerHTTPServer("127.0.0.1", 0, state, LIMITS)
    server.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        raw = requests.post(f"{url}{GENERATE_PATH}", json={}, timeout=5)
        assert (raw.status_code, raw.headers["WWW-Authenticate"]) == (401, "Bearer")
        openai = requests.post(
            f"{url}/v1/images/generations",
            json={"prompt": "a cat"},
            headers={"Authorization": "Bearer wrong"},
            timeout=5,
        )
        assert openai.status_code == 401
        assert openai.json()["error"]["type"] == "authentication_error"
        assert requests.get(f"{url}/v1/models", timeout=5).status_code == 401
        models = requests.get(
            f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"}, timeout=5
        )
        assert models.json()["data"][0]["id"] == "demo"
        for path in ("/health/live", "/metrics"):
            assert requests.get(f"{url}{path}", timeout=5).status_code == 200, path
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        (GENERATE_PATH, b'{"steps": "2"}', "steps: Input should be a valid integer"),
        (GENERATE_PATH, b'{"steps": true}', "steps: Input should be a valid integer"),
        (GENERATE_PATH, b'{"steps": 2.5}', "steps: Input should be a valid integer"),
        (GENERATE_PATH, b'{"seed": "7"}', "seed: Input should be a valid integer"),
        (GENERATE_PATH, b'{"guidance_scale": true}', "guidance_scale: Input should be a valid"),
        (GENERATE_PATH, b'{"guidance_scale": NaN}', "guidance_scale: Input should be a finite"),
        (GENERATE_PATH, b'{"guidance_scale": -Infinity}', "guidance_scale: Input should be a fin"),
        (GENERATE_PATH, b'{"prompt": 5}', "prompt: Input should be a valid string"),
        ("/v1/images/generations", b'{"prompt": "a", "n": true}', "n: Input should be a valid"),
        ("/v1/images/generations", b'{"prompt": "a", "steps": "2"}', "steps: Input should be"),
        ("/v1/images/generations", b'{"prompt": "a", "guidance_scale": NaN}', "finite number"),
    ],
)
def test_numbers_are_numbers_no_string_or_boolean_is_coerced(
    leader: tuple[str, ServerState], path: str, body: bytes, expected: str
) -> None:
    url, state = leader
    state.queue.open()
    response = requests.post(f"{url}{path}", data=body, timeout=5)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert expected in (error if isinstance(error, str) else error["message"])
    assert len(state.queue) == 0


def test_a_trailing_slash_is_not_redirected_to_the_request_host(
    leader: tuple[str, ServerState],
) -> None:
    """Starlette's slash redirect builds its Location from the client's Host header."""
    answer = _exchange(
        leader[0],
        b"POST /v1/generate/ HTTP/1.1\r\nHost: evil.example\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}",
    )
    assert answer.startswith("HTTP/1.1 404"), answer
    assert "evil.example" not in answer
    assert "location:" not in answer.lower()


def test_metrics_publish_no_versions(leader: tuple[str, ServerState]) -> None:
    import platform

    body = requests.get(f"{leader[0]}/metrics", timeout=5).text
    assert "python_info" not in body
    assert platform.python_version() not in body


def test_a_client_that_leaves_mid_body_is_one_info_line_and_a_metric(
    leader: tuple[str, ServerState], caplog: pytest.LogCaptureFixture
) -> None:
    url, state = leader
    state.queue.open()
    before = _counter("client_disconnected")
    with caplog.at_level("INFO"), socket.create_connection(_address(url), timeout=5) as client:
        client.sendall(b'POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"s')
        time.sleep(0.2)
        client.close()
        deadline = time.monotonic() + 5
        while _counter("client_disconnected") == before:
            assert time.monotonic() < deadline, "the disconnect was never counted"
            time.sleep(0.01)
        time.sleep(0.2)  # anything logged after the count would arrive now
    assert _counter("client_disconnected") == before + 1
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    (line,) = [r for r in caplog.records if "disconnect" in r.getMessage()]
    assert line.levelno == logging.INFO
    assert len(state.queue) == 0


@pytest.fixture
def adapter_routes(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """A leader serving the adapter routes from ``loras/`` (its queue closed: a path that
    passes every check is answered 503 by the queue, not 400), and a directory outside."""
    root, outside = tmp_path / "loras", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "pytorch_lora_weights.safetensors").write_bytes(b"outside")
    state = ServerState(RequestQueue(max_pending=4), model_name="demo", lora_load_dir=root)
    state.set_limits(RequestLimits(pipeline="FluxPipeline", conditioning="prompt"))
    server = WorkerHTTPServer("127.0.0.1", 0, state, LIMITS)
    server.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root, outside
    server.stop()


def test_a_fused_adapters_name_is_refused_as_fused_not_as_loaded(tmp_path: Path) -> None:
    """Issue 61: loading under a fused adapter's name said "unload it first", which the
    unload route refuses for a fused adapter."""
    state = ServerState(RequestQueue(max_pending=4), model_name="demo", lora_load_dir=tmp_path)
    state.set_limits(
        RequestLimits(pipeline="FluxPipeline", conditioning="prompt", fused_adapters=("f",))
    )
    server = WorkerHTTPServer("127.0.0.1", 0, state, LIMITS)
    server.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        body = {"lora_name": "f", "lora_path": "f.safetensors"}
        load = requests.post(f"{url}/v1/load_lora_adapter", json=body, timeout=5)
        unload = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "f"}, timeout=5)
        dotted = requests.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "a.b", "lora_path": "f.safetensors"},
            timeout=5,
        )
    finally:
        server.stop()
    assert load.status_code == 409
    assert load.json()["error"] == (
        "lora_name: f is fused into the weights (--fuse-lora); choose another name"
    )
    assert unload.status_code == 400
    assert "fused into the weights" in unload.json()["error"]
    assert dotted.status_code == 422
    assert dotted.json()["error"].startswith("lora_name: String should match pattern")


def _load(url: str, lora_path: str) -> requests.Response:
    body = {"lora_name": "x", "lora_path": lora_path}
    return requests.post(f"{url}/v1/load_lora_adapter", json=body, timeout=5)


def test_a_link_inside_an_adapter_directory_cannot_lead_out(
    adapter_routes: tuple[str, Path, Path],
) -> None:
    """Issue 61: only ``lora_path`` itself had its links resolved, so a directory inside
    whose weights file linked outside loaded the outside file."""
    url, root, outside = adapter_routes
    (root / "linked").mkdir()
    (root / "linked" / "pytorch_lora_weights.safetensors").symlink_to(
        outside / "pytorch_lora_weights.safetensors"
    )
    refused = _load(url, "linked")
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("lora_path: linked is outside --lora-load-dir")
    # Outside is outside whether it exists or not: nothing is told of the files there.
    for probe in ("../outside", "../nowhere", str(outside / "nowhere")):
        answer = _load(url, probe).json()["error"]
        assert answer.startswith(f"lora_path: {probe} is outside --lora-load-dir"), answer
    (root / "inside").mkdir()
    (root / "inside" / "pytorch_lora_weights.safetensors").write_bytes(b"inside")
    assert _load(url, "inside").status_code == 503  # every check passed; the queue is closed


@pytest.mark.parametrize("case", ["loop", "nul", "long name", "fifo", "two files"])
def test_unusable_lora_paths_get_400_naming_lora_path(
    adapter_routes: tuple[str, Path, Path], case: str
) -> None:
    """Issue 61: a link loop, a NUL byte and a 300-character name answered 500 with two
    tracebacks; a FIFO was refused quoting a Hugging Face Hub id error."""
    url, root, _ = adapter_routes
    if case == "loop":
        (root / "a").symlink_to(root / "b")
        (root / "b").symlink_to(root / "a")
        lora_path = "a"
    elif case == "nul":
        lora_path = "x\0y"
    elif case == "long name":
        lora_path = "x" * 300
    elif case == "fifo":
        os.mkfifo(root / "fifo")
        lora_path = "fifo"
    else:
        (root / "two").mkdir()
        for name in ("one", "other"):
            (root / "two" / f"{name}.safetensors").write_bytes(b"")
        lora_path = "two"
    response = _load(url, lora_path)
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith("lora_path")
