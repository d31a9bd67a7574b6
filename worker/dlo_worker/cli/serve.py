"""``dlo-worker serve``: the container entrypoint, from first probe to ordered shutdown.

Start: the HTTP server (health first, so the startup probe passes while a large
model loads), then :class:`~dlo_worker.process.worker.Worker` (process groups, pipeline,
DLO backend), then the engine's waves. SIGTERM while loading aborts through the
worker's SystemExit path. SIGTERM while serving starts the drain the architecture
prescribes: stop intake (readiness turns 503 ``draining``), finish every queued
request, stop every rank, ``backend.disable()``, destroy the process groups, and
only then close the HTTP server so liveness holds throughout.
"""

from __future__ import annotations

import logging
import os
import signal
import types
from dataclasses import dataclass
from pathlib import Path

from dlo_worker.config import ShardingGroup, WorkerConfig
from dlo_worker.engine.generation import request_limits
from dlo_worker.engine.request import NO_DEFAULTS, RequestDefaults, defaults_problems
from dlo_worker.engine.waves import Engine, RequestQueue
from dlo_worker.errors import UserFixableError
from dlo_worker.observability import metrics
from dlo_worker.process.worker import Worker
from dlo_worker.serving.server import Phase, ServerState, WorkerHTTPServer

logger = logging.getLogger(__name__)


class ListenError(OSError, UserFixableError):
    """The HTTP port cannot be bound (in use, or not permitted)."""


@dataclass(frozen=True)
class ServeOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    max_queued_requests: int = 64
    api_key: str | None = None
    """Required as ``Authorization: Bearer`` on POST routes; health and metrics stay open."""
    defaults: RequestDefaults = NO_DEFAULTS
    """Values for the fields a request leaves out."""
    lora_load_dir: Path | None = None
    """Where ``POST /v1/load_lora_adapter`` loads adapters from; None: no such route."""


class ServeDefaultsError(UserFixableError):
    """A ``--default-*`` value the loaded pipeline cannot take."""


def lockstep_waves(config: WorkerConfig) -> bool:
    """Whether DP ranks must run identical waves: DLO AllGather over the DP group."""
    effective = config.effective()
    return (
        effective.dlo_sharding_group == ShardingGroup.DATA_PARALLEL
        and effective.dlo_sharding_size > 1
    )


def served_model_name(config: WorkerConfig) -> str:
    """The id OpenAI clients name the model by: the model directory's name."""
    model = config.model.model
    return model.resolve().name if model is not None else "model"


def _listen(options: ServeOptions, state: ServerState) -> WorkerHTTPServer:
    try:
        return WorkerHTTPServer(options.host, options.port, state)
    except OSError as error:
        raise ListenError(
            f"cannot listen on {options.host}:{options.port} ({error.strerror}); "
            "choose another --port or --host"
        ) from None


def serve(config: WorkerConfig, options: ServeOptions) -> None:
    """Serve until SIGTERM, then shut down in order. Runs on every rank of the engine."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    queue = RequestQueue(options.max_queued_requests) if rank == 0 else None
    state = ServerState(
        queue,
        options.api_key,
        model_name=served_model_name(config),
        defaults=options.defaults,
        lora_load_dir=options.lora_load_dir,
        max_lora_rank=config.model.max_lora_rank,
    )
    server = _listen(options, state) if local_rank == 0 else None
    if server is not None:
        server.start()
    try:
        with Worker(config) as worker:
            engine = Engine(
                worker.pipeline,
                rank=worker.topology.rank,
                world_size=worker.topology.world_size,
                lockstep=lockstep_waves(config),
                queue=queue,
                sequence_parallel_size=config.parallel.sequence_parallel_size,
                on_intake_closed=lambda: state.set_phase(Phase.DRAINING),
                after_request=worker.after_request,
            )

            def drain_on_sigterm(_signum: int, _frame: types.FrameType | None) -> None:
                engine.request_stop()

            # Worker.shutdown restores the handler that was installed before the worker.
            signal.signal(signal.SIGTERM, drain_on_sigterm)
            metrics.HOST_BACKING.info({"backing": str(worker.backing.backing)})
            metrics.LORA_ADAPTERS.set(len(config.model.lora_adapters))
            logger.info(
                "host backing",
                extra={"fields": {"backing": worker.backing.backing, "why": worker.backing.reason}},
            )
            limits = request_limits(
                worker.pipeline,
                config.parallel.sequence_parallel_size,
                config.model.switchable_lora_names,
                config.model.fuse_lora,
            )
            if problems := defaults_problems(options.defaults, limits):
                raise ServeDefaultsError("; ".join(problems))
            if options.lora_load_dir is not None and not hasattr(
                worker.pipeline, "load_lora_weights"
            ):
                raise ServeDefaultsError(
                    f"--lora-load-dir: {type(worker.pipeline).__name__} has no LoRA loader "
                    "in diffusers; drop --lora-load-dir"
                )
            state.set_limits(limits)
            if queue is not None:
                queue.open()
            state.set_phase(Phase.READY)
            engine.run()
    finally:
        if server is not None:
            server.stop()
            logger.info("http stopped")
