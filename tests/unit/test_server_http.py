"""The worker's HTTP endpoints over a real socket: probes, routing and request validation.

Generation itself is covered end to end in tests/integration/test_serve.py; these
paths answer before a request reaches the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests

from dlo_worker.engine import RequestQueue
from dlo_worker.server import GENERATE_PATH, Phase, ServerState, WorkerHTTPServer


@pytest.fixture
def leader() -> Iterator[tuple[str, ServerState]]:
    state = ServerState(RequestQueue(max_pending=4))
    server = WorkerHTTPServer("127.0.0.1", 0, state)
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


def test_a_body_over_the_limit_is_refused(leader: tuple[str, ServerState]) -> None:
    url, _ = leader
    response = requests.post(f"{url}{GENERATE_PATH}", data=b"x" * (2 << 20), timeout=5)
    assert response.status_code == 413


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


def test_transfer_encoding_is_refused(leader: tuple[str, ServerState]) -> None:
    """Content-Length beside Transfer-Encoding is a request-smuggling shape: 400, closed."""
    import socket

    url, _ = leader
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as connection:
        connection.sendall(
            b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        answer = connection.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 400")
    assert "Transfer-Encoding is not accepted" in answer
