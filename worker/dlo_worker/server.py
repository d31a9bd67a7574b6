"""The worker's HTTP endpoints, served from a background thread.

Every node's local rank 0 serves the health endpoints (the kubelet probes every Pod
of an engine) and ``/metrics``; the engine's leader (global rank 0) also serves
``POST /v1/generate``. The server starts before the model loads, so the liveness and
startup probes pass while a large checkpoint is still loading; readiness follows the
engine: 503 ``loading``, then 200 ``ready``, then 503 ``draining`` after SIGTERM.

The standard library's threading server is enough here: one thread per connection,
while generation itself runs on the main thread in :mod:`dlo_worker.engine`.
"""

from __future__ import annotations

import enum
import hmac
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from dlo_worker import metrics
from dlo_worker.engine import (
    GenerationFailedError,
    IntakeClosedError,
    QueueFullError,
    RequestQueue,
)
from dlo_worker.requests import GenerationRequest, RequestLimits, request_problems

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
GENERATE_PATH = "/v1/generate"
ROUTES: dict[str, frozenset[str]] = {
    "/health/live": frozenset({"GET"}),
    "/health/ready": frozenset({"GET"}),
    "/metrics": frozenset({"GET"}),
    GENERATE_PATH: frozenset({"POST"}),
}
"""Every route and the methods it answers (others get 405 with ``Allow``)."""


def describe_body_error(error: ValidationError) -> str:
    """One line naming each offending JSON field, e.g. ``steps: Input should be ...``."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or 'body'}: {item['msg']}"
        for item in error.errors()
    )


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class ServerState:
    """What the probes report; flipped by the serving lifecycle, read by handler threads."""

    def __init__(self, queue: RequestQueue | None, api_key: str | None = None) -> None:
        self.queue = queue
        self.api_key = api_key
        """When set, ``POST`` routes need ``Authorization: Bearer <api_key>``."""
        self._phase = Phase.LOADING
        self._limits: RequestLimits | None = None
        self._lock = threading.Lock()

    @property
    def limits(self) -> RequestLimits | None:
        """What the loaded pipeline accepts (None while loading)."""
        with self._lock:
            return self._limits

    def set_limits(self, limits: RequestLimits) -> None:
        with self._lock:
            self._limits = limits

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    def set_phase(self, phase: Phase) -> None:
        with self._lock:
            self._phase = phase
        metrics.READY.set(1 if phase is Phase.READY else 0)
        logger.info("phase", extra={"fields": {"phase": phase.value}})


class _Handler(BaseHTTPRequestHandler):
    server: WorkerHTTPServer
    protocol_version = "HTTP/1.1"

    def version_string(self) -> str:
        """The Server header names the product, not the Python or library versions."""
        return "dlo-worker"

    def _authorized(self) -> bool:
        """Constant-time check of the bearer token (always true without an API key)."""
        key = self.server.state.api_key
        if key is None:
            return True
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), key.encode()
        )

    @property
    def route(self) -> str:
        """The request's path without its query string (which no route uses)."""
        return urlsplit(self.path).path

    def _routed(self, method: str) -> bool:
        """True for a known route and method; otherwise answers 404, or 405 with Allow."""
        allowed = ROUTES.get(self.route)
        if allowed is None:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": f"no route {self.route}"})
            return False
        if method not in allowed:
            self.close_connection = True  # a body, if any, stays unread
            self._send_json(
                HTTPStatus.METHOD_NOT_ALLOWED,
                {"error": f"{method} is not allowed on {self.route}"},
                extra_headers={"Allow": ", ".join(sorted(allowed))},
            )
            return False
        return True

    def do_PUT(self) -> None:
        self._routed("PUT")

    def do_DELETE(self) -> None:
        self._routed("DELETE")

    def do_PATCH(self) -> None:
        self._routed("PATCH")

    def do_GET(self) -> None:
        if not self._routed("GET"):
            return
        if self.route == "/health/live":
            self._send_json(HTTPStatus.OK, {"status": "live"})
        elif self.route == "/health/ready":
            phase = self.server.state.phase
            status = HTTPStatus.OK if phase is Phase.READY else HTTPStatus.SERVICE_UNAVAILABLE
            self._send_json(status, {"status": phase.value})
        else:
            self._send(HTTPStatus.OK, generate_latest(), CONTENT_TYPE_LATEST)

    def _admitted_queue(self) -> RequestQueue | None:
        """The leader's queue for a known route and an authorized client, or None after
        answering with the error."""
        if not self._routed("POST"):
            return None
        if not self._authorized():
            metrics.REQUESTS.labels(outcome="rejected_unauthorized").inc()
            # The body stays unread, so this connection cannot carry another request.
            self.close_connection = True
            self._send_json(
                HTTPStatus.UNAUTHORIZED,
                {"error": "missing or wrong API key: send Authorization: Bearer <key>"},
                extra_headers={"WWW-Authenticate": "Bearer"},
            )
            return None
        if self.server.state.queue is None:
            self._send_json(
                HTTPStatus.MISDIRECTED_REQUEST,
                {"error": "this Pod is not the engine's leader; send requests to its Service"},
            )
        return self.server.state.queue

    def do_POST(self) -> None:
        queue = self._admitted_queue()
        if queue is None:
            return
        request = self._read_request()
        if request is None:
            return
        try:
            future = queue.submit(request)
        except IntakeClosedError as error:
            metrics.REQUESTS.labels(outcome="rejected_unavailable").inc()
            self._send_json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(error)}, retry=True)
            return
        except QueueFullError as error:
            metrics.REQUESTS.labels(outcome="rejected_busy").inc()
            self._send_json(HTTPStatus.TOO_MANY_REQUESTS, {"error": str(error)}, retry=True)
            return
        try:
            png = future.result()
        except GenerationFailedError as error:
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(error)})
            return
        self._send(HTTPStatus.OK, png, "image/png", {"X-DLO-Seed": str(request.seed)})

    def _read_request(self) -> GenerationRequest | None:
        """The validated body, or None after answering with the error."""
        if "Transfer-Encoding" in self.headers:
            # Chunked bodies are not accepted; with a Content-Length beside it, a proxy and
            # this server could frame the stream differently (request smuggling).
            self.close_connection = True
            self._reject(
                HTTPStatus.BAD_REQUEST, "Transfer-Encoding is not accepted; send Content-Length"
            )
            return None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            # The body stays unread, so this connection cannot carry another request.
            self.close_connection = True
            if length < 0:
                self._reject(HTTPStatus.LENGTH_REQUIRED, "send a JSON body with Content-Length")
            else:
                self._reject(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes"
                )
            return None
        body = self.rfile.read(length)
        try:
            request = GenerationRequest.model_validate_json(body or b"{}")
        except ValidationError as error:
            self._reject(HTTPStatus.UNPROCESSABLE_ENTITY, describe_body_error(error))
            return None
        limits = self.server.state.limits
        if limits is not None and (problems := request_problems(request, limits)):
            self._reject(HTTPStatus.UNPROCESSABLE_ENTITY, "; ".join(problems))
            return None
        return request

    def _reject(self, status: HTTPStatus, message: str) -> None:
        metrics.REQUESTS.labels(outcome="rejected_invalid").inc()
        self._send_json(status, {"error": message})

    def _send_json(
        self,
        status: HTTPStatus,
        body: dict,
        retry: bool = False,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        headers = {"Retry-After": "5"} if retry else {}
        headers |= extra_headers or {}
        self._send(status, json.dumps(body).encode() + b"\n", "application/json", headers)

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Access lines go to the structured log at debug level, not to stderr."""
        line = format % args
        logger.debug("http", extra={"fields": {"client": self.client_address[0], "line": line}})


class WorkerHTTPServer(ThreadingHTTPServer):
    """A threading server whose handlers see the worker's state; runs on a daemon thread."""

    daemon_threads = True

    def __init__(self, host: str, port: int, state: ServerState) -> None:
        super().__init__((host, port), _Handler)
        self.state = state
        self._thread = threading.Thread(target=self.serve_forever, name="http", daemon=True)

    def handle_error(self, request: object, client_address: tuple[str, int]) -> None:
        """A client that hangs up mid-response is routine: log it, no traceback on stderr."""
        logger.debug(
            "http connection error", exc_info=True, extra={"fields": {"client": client_address[0]}}
        )

    def start(self) -> None:
        self._thread.start()
        host, port = self.server_address[:2]
        logger.info("http listening", extra={"fields": {"host": host, "port": port}})

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()
