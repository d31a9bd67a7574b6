"""Runs the worker's HTTP app (:mod:`dlo_worker.serving.app`) on uvicorn, from a thread.

The server starts before the model loads, so the liveness and startup probes pass while
a large checkpoint is still loading, and stops last in the shutdown order. Generation
runs on the main thread in :mod:`dlo_worker.engine.waves`; the HTTP thread runs one asyncio
event loop, so connections cost a socket each, never a thread.

The socket is bound here, before uvicorn starts, so a port in use is an error the caller
reports (uvicorn would exit its thread). uvicorn's h11 protocol is used as-is except for
one addition: a deadline for a request's headers, which uvicorn lacks (it times out idle
keep-alive connections, not a client that trickles partial headers).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dlo_worker.serving.app import (
    GENERATE_PATH,
    HTTPLimits,
    Phase,
    ServerState,
    build_app,
)

__all__ = ["GENERATE_PATH", "HTTPLimits", "Phase", "ServerState", "WorkerHTTPServer"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


def _protocol_with_header_deadline(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    ``seconds`` after it opened or after its previous response."""

    class HeaderDeadlineProtocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request's headers arrived
                self._disarm_header_deadline()

        def on_response_complete(self) -> None:
            # Armed first: the base class may parse a pipelined request, which disarms it.
            self._arm_header_deadline()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._header_deadline = self.loop.call_later(seconds, self._headers_overdue)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_overdue(self) -> None:
            self._header_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.debug("http headers overdue, closing", extra={"fields": {}})
                self.transport.close()

    return HeaderDeadlineProtocol


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener


class WorkerHTTPServer:
    """The HTTP server of one Pod: bound at construction, served from a daemon thread."""

    def __init__(
        self, host: str, port: int, state: ServerState, limits: HTTPLimits | None = None
    ) -> None:
        limits = limits or HTTPLimits()
        self.state = state
        self._socket = _bind(host, port, limits.backlog)
        self.server_address: tuple[str, int] = self._socket.getsockname()[:2]
        config = uvicorn.Config(
            build_app(state, limits),
            http=_protocol_with_header_deadline(limits.header_timeout_s),
            loop="asyncio",
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            headers=[("Server", "dlo-worker")],  # the product, no Python or library versions
            timeout_keep_alive=limits.keep_alive_s,
            limit_concurrency=limits.max_connections,
            backlog=limits.backlog,
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="http", daemon=True
        )

    def start(self) -> None:
        """Start serving and return once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start; see the log above")
            time.sleep(0.01)
        host, port = self.server_address
        logger.info("http listening", extra={"fields": {"host": host, "port": port}})

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()
