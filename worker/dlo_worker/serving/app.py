"""The worker's HTTP routes as a FastAPI app; :mod:`dlo_worker.serving.server` runs it on uvicorn.

Every node's local rank 0 serves the health endpoints (the kubelet probes every Pod of
an engine) and ``/metrics``; the engine's leader (global rank 0) also takes generation
requests. Handlers never block the event loop: a request goes into the engine's queue
and the handler awaits its future while watching for the client to leave, so a request
whose client went away before its wave started is dropped instead of run.

Errors are one-line JSON bodies naming the field, ``{"error": "..."}`` on the worker's
own routes (:data:`NATIVE_PATHS`) and OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` on every other ``/v1/`` path, those it does not serve included, so an OpenAI
client reads each answer; never tracebacks.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import hmac
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from dlo_worker.config import LoraAdapter
from dlo_worker.config.values import LORA_NAME_PATTERN
from dlo_worker.engine.request import (
    NO_DEFAULTS,
    AdapterChange,
    GenerationRequest,
    RequestDefaults,
    RequestLimits,
    request_problems,
)
from dlo_worker.engine.waves import (
    AdapterChangeError,
    GenerationFailedError,
    IntakeClosedError,
    QueueFullError,
    RequestQueue,
)
from dlo_worker.errors import EngineStoppedError
from dlo_worker.observability import metrics
from dlo_worker.pipeline import lora
from dlo_worker.serving.openai import IMAGES_PATH, ImagesRequest, error_body, images_response

logger = logging.getLogger(__name__)

GENERATE_PATH = "/v1/generate"
MODELS_PATH = "/v1/models"
LORAS_PATH = "/v1/loras"
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
NATIVE_PATHS = frozenset({GENERATE_PATH, LORAS_PATH, LOAD_LORA_PATH, UNLOAD_LORA_PATH})
"""The worker's own ``/v1/`` routes (vLLM's names for the adapter routes): plain errors."""
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class HTTPLimits:
    """Limits of the HTTP layer, set deliberately (docs/serving.md explains each)."""

    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0
    """A declared body must arrive within this (a Content-Length larger than the body
    gets 408 instead of holding the connection forever)."""
    header_timeout_s: float = 10.0
    """A connection must complete its request headers within this (slowloris)."""
    keep_alive_s: int = 5
    max_connections: int = 1024
    """Open connections beyond this get 503 from uvicorn; each costs a socket, no thread."""
    backlog: int = 2048


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class ServerState:
    """What the probes report; flipped by the serving lifecycle, read by the handlers."""

    def __init__(
        self,
        queue: RequestQueue | None,
        api_key: str | None = None,
        *,
        model_name: str = "model",
        defaults: RequestDefaults = NO_DEFAULTS,
        lora_load_dir: Path | None = None,
        max_lora_rank: int | None = None,
    ) -> None:
        self.queue = queue
        self.api_key = api_key
        """When set, generation routes need ``Authorization: Bearer <api_key>``."""
        self.model_name = model_name
        """The id ``/v1/models`` lists and OpenAI requests may name."""
        self.defaults = defaults
        """Values for the fields a request leaves out (``serve --default-*``)."""
        self.lora_load_dir = lora_load_dir
        """Where adapters may be loaded from while serving (``--lora-load-dir``); None
        leaves the load and unload routes out."""
        self.max_lora_rank = max_lora_rank
        """``--max-lora-rank``: adapters loaded while serving may not exceed it."""
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

    def set_adapters(self, adapters: tuple[str, ...]) -> Callable[[], None]:
        """The adapters requests may choose, after one was loaded or unloaded (an unloaded
        one also leaves the defaults: a request naming none never runs it). Returns what
        undoes the change."""
        with self._lock:
            if self._limits is None:
                raise RuntimeError("adapters change only once the pipeline is loaded")
            limits, defaults = self._limits, self.defaults
            self._limits = replace(limits, adapters=adapters)
            if defaults.loras is not None:
                kept = tuple(choice for choice in defaults.loras if choice.name in adapters)
                self.defaults = replace(defaults, loras=kept)
            metrics.LORA_ADAPTERS.set(len(adapters) + len(limits.fused_adapters))

        def undo() -> None:
            with self._lock:
                self._limits, self.defaults = limits, defaults
            metrics.LORA_ADAPTERS.set(len(limits.adapters) + len(limits.fused_adapters))

        return undo

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    def set_phase(self, phase: Phase) -> None:
        with self._lock:
            self._phase = phase
        metrics.READY.set(1 if phase is Phase.READY else 0)
        logger.info("phase", extra={"fields": {"phase": phase.value}})


class APIError(Exception):
    """An error answer: status, one-line message, extra headers, whether the connection
    must close (its body may be unread, so it cannot carry another request), and the
    ``dlo_requests_total`` outcome it counts as, once it is answered (an error built in
    advance and never raised counts nothing)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        outcome: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.outcome = outcome
        if close:
            self.headers["Connection"] = "close"


def describe_body_error(error: ValidationError) -> str:
    """One line naming each offending JSON field, e.g. ``steps: Input should be ...``."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or 'body'}: {item['msg']}"
        for item in error.errors()
    )


def _error_response(request: Request, status: int, message: str, headers: dict) -> Response:
    path = request.url.path
    openai_shaped = path.startswith("/v1/") and path not in NATIVE_PATHS
    body = error_body(status, message) if openai_shaped else {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(state: ServerState, limits: HTTPLimits) -> FastAPI:
    """The ASGI app. No interactive docs: the worker is an API, and docs/serving.md is its
    reference."""
    # No slash redirects: Starlette builds their Location from the client's Host header.
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        if error.outcome is not None:
            metrics.REQUESTS.labels(outcome=error.outcome).inc()
        return _error_response(request, error.status, error.message, error.headers)

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, error: HTTPException) -> Response:
        """404 for unknown routes, 405 with ``Allow`` for wrong methods."""
        if error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif error.status_code == 404:
            message = f"no route {request.url.path}"
        else:
            message = str(error.detail)
        return _error_response(request, error.status_code, message, dict(error.headers or {}))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        logger.exception("http handler failed")
        return _error_response(request, 500, f"internal error: {type(error).__name__}", {})

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready")
    async def ready() -> Response:
        phase = state.phase
        return JSONResponse(
            {"status": phase.value}, status_code=200 if phase is Phase.READY else 503
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    _add_model_routes(app, state)

    @app.get(LORAS_PATH)
    async def loras(request: Request) -> dict:
        """The loaded LoRA adapters: those requests choose, each with the scale a request
        naming none runs it at, then those fused into the weights (always applied)."""
        _authorize(request, state)
        limits = state.limits
        default_scales = {choice.name: choice.scale for choice in state.defaults.loras or ()}
        switchable = limits.adapters if limits is not None else ()
        fused = limits.fused_adapters if limits is not None else ()
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "lora",
                    "fused": False,
                    "default_scale": default_scales.get(name),
                }
                for name in switchable
            ]
            + [{"id": name, "object": "lora", "fused": True} for name in fused],
        }

    @app.post(GENERATE_PATH)
    async def generate(request: Request) -> Response:
        queue = _admitted_queue(request, state)
        generation = _checked(_parse(await _read_body(request, limits), GenerationRequest), state)
        pngs = await _run(request, queue, generation)
        headers = {"X-DLO-Seed": str(generation.seed)}
        if len(pngs) == 1:
            return Response(pngs[0], media_type="image/png", headers=headers)
        encoded = [base64.b64encode(png).decode("ascii") for png in pngs]
        return JSONResponse({"seed": generation.seed, "images": encoded}, headers=headers)

    @app.post(IMAGES_PATH)
    async def images(request: Request) -> Response:
        queue = _admitted_queue(request, state)
        body = _parse(await _read_body(request, limits), ImagesRequest)
        if body.model is not None and body.model != state.model_name:
            raise APIError(
                404,
                f"model: this worker serves {state.model_name!r}, not {body.model!r}",
                outcome="rejected_invalid",
            )
        generation = _checked(_validated(body.generation_request), state)
        pngs = await _run(request, queue, generation)
        return JSONResponse(images_response(pngs, created=int(time.time())))

    if state.lora_load_dir is not None:
        _add_adapter_routes(app, state, limits, state.lora_load_dir)
    return app


def _add_model_routes(app: FastAPI, state: ServerState) -> None:
    """OpenAI's ``GET /v1/models`` and ``GET /v1/models/{id}``: the one model served."""
    started = int(time.time())  # the served model's ``created``: when serving began

    def served_model() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": started,
            "owned_by": "dlo-worker",
        }

    @app.get(MODELS_PATH)
    async def models(request: Request) -> dict:
        _authorize(request, state)
        return {"object": "list", "data": [served_model()]}

    @app.get(MODELS_PATH + "/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        _authorize(request, state)
        if model_id != state.model_name:
            raise APIError(404, f"model: this worker serves {state.model_name!r}, not {model_id!r}")
        return served_model()


class LoadLoraRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(pattern=LORA_NAME_PATTERN, description="The name requests use.")
    lora_path: str = Field(
        min_length=1, max_length=1024, description="A file or directory in --lora-load-dir."
    )


class UnloadLoraRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=64)


def _add_adapter_routes(app: FastAPI, state: ServerState, limits: HTTPLimits, root: Path) -> None:
    """Load and unload adapters while serving (``--lora-load-dir``), one change at a time.

    A change goes through the engine's queue (:class:`~dlo_worker.engine.request.AdapterChange`):
    every rank makes it after the requests queued before it. A loaded adapter becomes a
    request's choice once every rank holds it; an unloaded one stops being one at once.
    """
    changing = asyncio.Lock()

    @app.post(LOAD_LORA_PATH)
    async def load_lora(request: Request) -> dict:
        queue = _admitted_queue(request, state)
        body = _parse(await _read_body(request, limits), LoadLoraRequest)
        async with changing:
            current = _loaded_limits(state)
            if body.lora_name in current.fused_adapters:
                raise APIError(
                    409,
                    f"lora_name: {body.lora_name} is fused into the weights (--fuse-lora); "
                    "choose another name",
                )
            if body.lora_name in current.adapters:
                raise APIError(
                    409,
                    f"lora_name: {body.lora_name} is already loaded; unload it first, or "
                    "choose another name",
                )
            path = _adapter_path(root, body.lora_path)
            await _change(queue, AdapterChange(body.lora_name, path, state.max_lora_rank))
            state.set_adapters((*current.adapters, body.lora_name))
        return {"id": body.lora_name, "object": "lora", "fused": False, "default_scale": None}

    @app.post(UNLOAD_LORA_PATH)
    async def unload_lora(request: Request) -> dict:
        queue = _admitted_queue(request, state)
        name = _parse(await _read_body(request, limits), UnloadLoraRequest).lora_name
        async with changing:
            current = _loaded_limits(state)
            if name in current.fused_adapters:
                raise APIError(
                    400,
                    f"lora_name: {name} is fused into the weights (--fuse-lora); restart "
                    "without fusing it to remove it",
                )
            if name not in current.adapters:
                loaded = ", ".join(current.adapters) or "none"
                raise APIError(404, f"lora_name: {name} is not loaded (loaded: {loaded})")
            # Requests stop naming it now; those queued before it still run with it.
            undo = state.set_adapters(tuple(n for n in current.adapters if n != name))
            try:
                await _change(queue, AdapterChange(name, None))
            except APIError:
                undo()
                raise
        return {"id": name, "object": "lora", "deleted": True}


def _loaded_limits(state: ServerState) -> RequestLimits:
    limits = state.limits
    if limits is None:
        raise APIError(503, "the engine is loading its model", headers={"Retry-After": "5"})
    return limits


def _adapter_path(root: Path, text: str) -> Path:
    """The safetensors file ``lora_path`` names (relative to ``--lora-load-dir`` or
    absolute; a directory names the file it holds), with every link resolved, the file's
    own included, and inside the directory; the load then opens that resolved file, so
    nothing it reads lies outside. Otherwise 400 naming ``lora_path``."""
    given = Path(text)
    try:
        resolved = _inside(root, text, (given if given.is_absolute() else root / given))
        if resolved.is_dir():
            held = lora.weights_file(LoraAdapter("lora_path", resolved), "lora_path")
            resolved = _inside(root, text, held)
        if not resolved.is_file():
            raise APIError(
                400, f"lora_path: {text} is not a regular file; give a LoRA safetensors file"
            )
    except FileNotFoundError:
        raise APIError(400, f"lora_path: {text} does not exist in --lora-load-dir {root}") from None
    except lora.LoraSetupError as error:
        raise APIError(400, str(error)) from None
    except (OSError, ValueError, RuntimeError) as error:
        # A link loop (RuntimeError), a NUL byte (ValueError), a name too long (OSError).
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise APIError(
            400, f"lora_path: {text[:200]!r} cannot be opened ({reason}); give a file's path"
        ) from None
    return resolved


def _inside(root: Path, text: str, path: Path) -> Path:
    """``path`` with every link resolved, inside ``root``, existing. A path outside is
    refused as outside whether it exists or not: the answer tells nothing of the files
    outside the directory."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise APIError(
            400, f"lora_path: {text} is outside --lora-load-dir {root}; give a path inside it"
        )
    if not resolved.exists():
        raise FileNotFoundError(resolved)
    return resolved


async def _change(queue: RequestQueue, change: AdapterChange) -> None:
    """Queue an adapter change and wait until every rank made it (it runs to the end even
    if the client leaves: ranks must never disagree on their adapters)."""
    action = "unload" if change.path is None else "load"
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    try:
        future = queue.submit(change)
    except IntakeClosedError as error:
        raise APIError(503, str(error), headers=retry) from None
    except QueueFullError as error:
        raise APIError(429, str(error), headers=retry) from None
    try:
        await asyncio.shield(asyncio.wrap_future(future))
    except AdapterChangeError as error:
        metrics.LORA_CHANGES.labels(action=action, outcome="failed").inc()
        raise APIError(400, str(error)) from None
    except EngineStoppedError as error:
        metrics.LORA_CHANGES.labels(action=action, outcome="failed").inc()
        raise APIError(503, str(error), headers=retry) from None
    metrics.LORA_CHANGES.labels(action=action, outcome="ok").inc()
    logger.info("lora adapters changed", extra={"fields": {"action": action, "name": change.name}})


def _admitted_queue(request: Request, state: ServerState) -> RequestQueue:
    """The leader's queue for an authorized client."""
    _authorize(request, state)
    if state.queue is None:
        raise APIError(421, "this Pod is not the engine's leader; send requests to its Service")
    return state.queue


def _authorize(request: Request, state: ServerState) -> None:
    """Constant-time check of the bearer token (nothing to check without an API key)."""
    key = state.api_key
    if key is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not (
            scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
        ):
            raise APIError(
                401,
                "missing or wrong API key: send Authorization: Bearer <key>",
                outcome="rejected_unauthorized",
                headers={"WWW-Authenticate": "Bearer"},
                close=True,
            )


async def _read_body(request: Request, limits: HTTPLimits) -> bytes:
    """The body, within the size limit and the body deadline (uvicorn frames it, chunked or
    by Content-Length). Both framing headers at once are refused: a proxy could frame that
    stream differently from this server (request smuggling)."""
    if "transfer-encoding" in request.headers and "content-length" in request.headers:
        raise APIError(
            400,
            "Content-Length together with Transfer-Encoding is not accepted; send one",
            outcome="rejected_invalid",
            close=True,
        )
    declared = request.headers.get("content-length", "0")
    if not declared.isdigit():
        raise APIError(
            400, "Content-Length is not a number", outcome="rejected_invalid", close=True
        )
    too_large = APIError(
        413,
        f"body over {limits.max_body_bytes} bytes",
        outcome="rejected_invalid",
        close=True,
    )
    if int(declared) > limits.max_body_bytes:
        raise too_large
    body = bytearray()

    async def collect() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limits.max_body_bytes:
                raise too_large

    try:
        await asyncio.wait_for(collect(), limits.body_timeout_s)
    except ClientDisconnect:
        # An ordinary event of the network, not a server error: nobody is left to answer.
        metrics.REQUESTS.labels(outcome="client_disconnected").inc()
        logger.info(
            "client disconnected before its request body arrived",
            extra={"fields": {"path": request.url.path, "received_bytes": len(body)}},
        )
        raise APIError(499, "client closed the request", close=True) from None
    except TimeoutError:
        raise APIError(
            408,
            f"the body did not arrive within {limits.body_timeout_s:g} s "
            "(is Content-Length larger than the body?)",
            outcome="rejected_invalid",
            close=True,
        ) from None
    return bytes(body)


Body = TypeVar("Body", bound=BaseModel)


def _parse(raw: bytes, model: type[Body]) -> Body:
    """The JSON body as ``model`` (an empty body means every default), or 422. Strict: a
    number must be a JSON number (``"2"`` and ``true`` are refused, not coerced)."""
    return _validated(lambda: model.model_validate_json(raw or b"{}", strict=True))


def _validated(build: Callable[[], Body]) -> Body:
    try:
        return build()
    except ValidationError as error:
        raise APIError(422, describe_body_error(error), outcome="rejected_invalid") from None


def _checked(generation: GenerationRequest, state: ServerState) -> GenerationRequest:
    """The request with the server's defaults, if the loaded pipeline can take it;
    otherwise 422 naming the fields."""
    generation = state.defaults.apply(generation)
    limits = state.limits
    if limits is not None and (problems := request_problems(generation, limits)):
        raise APIError(422, "; ".join(problems), outcome="rejected_invalid")
    return generation


async def _run(request: Request, queue: RequestQueue, generation: GenerationRequest) -> list[bytes]:
    """Queue the request and await its PNGs off the event loop. If the client leaves
    first, cancel it: the engine drops it unless its wave has started."""
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    try:
        future: Future[list[bytes]] = queue.submit(generation)
    except IntakeClosedError as error:
        raise APIError(503, str(error), outcome="rejected_unavailable", headers=retry) from None
    except QueueFullError as error:
        raise APIError(429, str(error), outcome="rejected_busy", headers=retry) from None
    result = asyncio.wrap_future(future)
    client_gone = asyncio.ensure_future(_client_disconnect(request))
    waiting: set[asyncio.Future[Any]] = {result, client_gone}
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    client_gone.cancel()
    if not result.done():
        result.cancel()  # cancels the queued request unless its wave already runs
        raise APIError(499, "client closed the request")
    try:
        return result.result()
    except GenerationFailedError as error:
        raise APIError(500, str(error)) from None
    except EngineStoppedError as error:
        raise APIError(503, str(error), headers=retry) from None


async def _client_disconnect(request: Request) -> None:
    """Returns when the client closes its connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
