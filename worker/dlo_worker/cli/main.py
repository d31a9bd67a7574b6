"""``dlo-worker``: the worker's command line.

Configuration flags are generated from the pydantic models in
:mod:`dlo_worker.config`, one flag per field, so the CLI and the configuration
cannot drift apart. Every invalid option or combination exits with status 2 and
one line naming the options and the fix, before torch or a model is loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import BaseModel, ValidationError

from dlo_worker import __version__
from dlo_worker.config import (
    NEGATIVE_FLAGS,
    ConfigError,
    ModelOptions,
    OffloadOptions,
    ParallelOptions,
    WorkerConfig,
    build_config,
    describe_validation_error,
    execution_errors,
    flag_for,
    runtime_lora_errors,
)
from dlo_worker.engine.request import GenerationRequest, LoraChoice, RequestDefaults
from dlo_worker.errors import EngineStoppedError, UserFixableError
from dlo_worker.observability import logs
from dlo_worker.process import numerics
from dlo_worker.process.termination import write_termination_message

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from dlo_worker.runtime_cache.store import RuntimeCacheStore

logger = logging.getLogger("dlo_worker.cli.main")

API_KEY_ENV = "DLO_API_KEY"
EXIT_USAGE = 2
EXIT_FAILURE = 1

_CONFIG_GROUPS: dict[str, type[BaseModel]] = {
    "model": ModelOptions,
    "parallel": ParallelOptions,
    "offload": OffloadOptions,
}
_REQUEST_PREFIX = "request"


class UsageError(UserFixableError):
    """Bad input the user can fix: reported as one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """The worker configuration's flags, one argument group per part (model, parallel,
    offload), as every command that loads a model takes them."""
    for prefix, model in _CONFIG_GROUPS.items():
        _add_model_fields(parser, prefix, model, f"{prefix} options")


def _add_model_fields(
    parser: argparse.ArgumentParser,
    prefix: str,
    model: type[BaseModel],
    title: str,
    own_flags: frozenset[str] = frozenset(),
) -> argparse._ArgumentGroup:
    """One flag per field of ``model`` but ``own_flags`` (the caller spells those); values
    stay strings so pydantic validates them."""
    group = parser.add_argument_group(title)
    for name, field in model.model_fields.items():
        if name in own_flags:
            continue
        dest = f"{prefix}.{name}"
        help_text = f"{field.description} (default: {_default_text(field.default)})"
        if field.annotation is bool:
            if field.default:
                group.add_argument(
                    flag_for(name),
                    dest=dest,
                    action="store_const",
                    const=True,
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
                group.add_argument(
                    NEGATIVE_FLAGS[name],
                    dest=dest,
                    action="store_const",
                    const=False,
                    default=argparse.SUPPRESS,
                    help=f"Disable {flag_for(name)}.",
                )
            else:
                group.add_argument(
                    flag_for(name),
                    dest=dest,
                    action="store_const",
                    const=True,
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            continue
        choices = _enum_choices(field.annotation)
        group.add_argument(
            flag_for(name),
            dest=dest,
            default=argparse.SUPPRESS,
            # A list that starts empty (--lora) takes the flag repeated.
            action="append" if field.default == () else "store",
            choices=choices,
            metavar=_metavar(name, choices),
            help=help_text,
        )
    return group


def _enum_choices(annotation: Any) -> list[str] | None:
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return [member.value for member in annotation]
    return None


def _metavar(name: str, choices: list[str] | None) -> str:
    return "{" + ",".join(choices) + "}" if choices else name.rsplit("_", 1)[-1].upper()


def _default_text(default: Any) -> str:
    if isinstance(default, Enum):
        return str(default.value)
    return "unset" if default is None else str(default)


def _grouped_values(namespace: argparse.Namespace, prefix: str | None = None) -> dict[str, Any]:
    grouped: dict[str, dict[str, Any]] = {}
    for key, value in vars(namespace).items():
        if "." in key:
            group, field = key.split(".", 1)
            grouped.setdefault(group, {})[field] = value
    if prefix is not None:
        return grouped.get(prefix, {})
    return {name: grouped.get(name, {}) for name in _CONFIG_GROUPS}


def config_from_args(namespace: argparse.Namespace) -> WorkerConfig:
    """The validated configuration the parsed flags describe (raises ConfigError)."""
    return build_config(_grouped_values(namespace))


def request_from_args(namespace: argparse.Namespace) -> GenerationRequest:
    values = _grouped_values(namespace, _REQUEST_PREFIX)
    if (chosen := getattr(namespace, "use_lora", None)) is not None:
        values["loras"] = [_lora_choice(text) for text in chosen]
    try:
        return GenerationRequest.model_validate(values)
    except ValidationError as error:
        message = describe_validation_error(error).replace("--loras", "--use-lora")
        raise ConfigError(message) from None


def _lora_choice(text: str) -> dict[str, object]:
    """``--use-lora NAME[:SCALE]`` as a request's adapter choice."""
    name, colon, scale = text.rpartition(":")
    if not colon:
        return {"name": text}
    try:
        return {"name": name, "scale": float(scale)}
    except ValueError:
        raise UsageError(f"--use-lora expects NAME[:SCALE], got {text!r}") from None


def adapter_defaults(config: WorkerConfig) -> tuple[LoraChoice, ...] | None:
    """What a request that names no adapters runs with: every ``--lora`` it can choose
    (not fused) at its scale."""
    adapters = config.model.switchable_lora_adapters
    if not adapters:
        return None
    return tuple(LoraChoice(name=adapter.name, scale=adapter.scale) for adapter in adapters)


def _warn_effective(config: WorkerConfig) -> None:
    for warning in config.effective().warnings:
        logger.warning(warning)


def _command_config(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    _warn_effective(config)
    report = {
        "config": config.model_dump(mode="json"),
        "effective": config.effective().model_dump(mode="json"),
    }
    print(json.dumps(report, indent=2))
    return 0


def _shard_size(text: str) -> str:
    """A checkpoint shard size as diffusers and transformers read it (``5GB``, ``200KB``)."""
    if re.fullmatch(r"[1-9][0-9]*(KB|MB|GB|KiB|MiB|GiB)", text) is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; give a number and a unit, e.g. 5GB or 200KB"
        )
    return text


def _command_demo_model(args: argparse.Namespace) -> int:
    from dlo_worker.pipeline.demo_model import (
        DemoKind,
        DemoSize,
        DemoWeights,
        has_trained_weights,
        write_demo_model,
    )

    kind, size = DemoKind(args.kind), DemoSize(args.size)
    # Trained where they exist (the tiny demos); a seed other than 0 asks for random ones.
    trained = has_trained_weights(size, args.seed)
    default_weights = DemoWeights.TRAINED if trained else DemoWeights.RANDOM
    path = write_demo_model(
        Path(args.directory),
        seed=args.seed,
        overwrite=args.overwrite,
        kind=kind,
        size=size,
        max_shard_size=args.max_shard_size,
        weights=DemoWeights(args.weights) if args.weights else default_weights,
    )
    print(f"demo model written to {path}")
    return 0


def image_output_paths(
    out: Path, data_parallel_rank: int, data_parallel_size: int, num_images: int
) -> list[Path]:
    """Where one rank writes its images: DP rank 0 writes ``out`` and rank ``r`` > 0
    ``<stem>.dp<r><suffix>`` beside it; image ``i`` > 0 of a rank adds ``-<i>`` to the stem."""
    if data_parallel_size > 1 and data_parallel_rank > 0:
        out = out.with_name(f"{out.stem}.dp{data_parallel_rank}{out.suffix}")
    return [out] + [
        out.with_name(f"{out.stem}-{index}{out.suffix}") for index in range(1, num_images)
    ]


def _executable_config(args: argparse.Namespace) -> WorkerConfig:
    """The configuration of a command that loads the model, checked before torch loads."""
    config = config_from_args(args)
    _warn_effective(config)
    if config.model.model is None:
        raise UsageError("--model is required: a diffusers pipeline directory")
    if errors := execution_errors(config):
        raise UsageError("; ".join(errors))

    from dlo_worker.loader import check_model_directory

    check_model_directory(config.model.model)
    return config


def _command_generate(args: argparse.Namespace) -> int:
    request = request_from_args(args)
    config = _executable_config(args)
    # A request that names no adapters runs every --lora adapter.
    request = RequestDefaults(loras=adapter_defaults(config)).apply(request)
    _check_outputs(args.out, config, request.num_images, make_parents=args.make_parents)

    from dlo_worker.engine.generation import (
        NonFiniteOutputError,
        generate_images,
        request_limits,
        write_png,
    )
    from dlo_worker.engine.request import request_problems
    from dlo_worker.engine.stages import stage_fields
    from dlo_worker.process.device_budget import device_peak
    from dlo_worker.process.worker import Worker

    def check_request(pipeline: DiffusionPipeline) -> None:
        """Before the weights load: the request is one this pipeline can take."""
        limits = request_limits(
            pipeline,
            config.parallel.sequence_parallel_size,
            config.model.switchable_lora_names,
            config.model.fuse_lora,
        )
        if problems := request_problems(request, limits):
            raise UsageError("; ".join(problems))

    with Worker(config, check_pipeline=check_request) as worker:
        rank = worker.topology.coordinates.data_parallel_rank
        # Each DP rank draws its own seed; the ranks run the same steps in lockstep.
        rank_request = request.model_copy(update={"seed": request.seed + rank})
        try:
            generated = generate_images(worker.pipeline, rank_request)
        except NonFiniteOutputError as error:
            print(f"dlo-worker generate: error: {error}", file=sys.stderr)
            return EXIT_FAILURE
        images = generated.images
        logger.info("request stages", extra={"fields": stage_fields(generated.stage_seconds)})
        backing = worker.backing
        if worker.backend is not None:
            logger.info("dlo stats", extra={"fields": vars(worker.backend.stats())})
        if worker.compiled is not None:
            logger.info("compile stats", extra={"fields": worker.compiled.fields()})
        if worker.device.type == "cuda":
            logger.info("device memory", extra={"fields": device_peak(worker.device)})
    if worker.topology.coordinates.sequence_parallel_rank > 0:
        return 0  # the SP group's first rank writes the images they made together
    outs = image_output_paths(
        Path(args.out), rank, config.parallel.data_parallel_size, request.num_images
    )
    paths = [
        write_png(image, out, make_parents=args.make_parents)
        for image, out in zip(images, outs, strict=True)
    ]
    if backing is not None:
        print(f"host backing: {backing.backing} - {backing.reason}")
    for path in paths:
        print(f"image written to {path}")
    return 0


def _check_outputs(
    out_text: str, config: WorkerConfig, num_images: int, *, make_parents: bool
) -> None:
    """Every rank's output path, before the model loads (exit 2 naming the problem)."""
    from dlo_worker.engine.images import OutputPathError, check_output_path

    if not out_text.strip():
        raise OutputPathError("--out is empty; name the PNG file to write (e.g. --out image.png)")
    out = Path(out_text)
    ranks = config.parallel.data_parallel_size
    for rank in range(ranks):
        for path in image_output_paths(out, rank, ranks, num_images):
            check_output_path(path, make_parents=make_parents)


def _check_lora_loading(directory: Path, api_key: str | None, config: WorkerConfig) -> None:
    """``--lora-load-dir``: behind the API key, an existing directory, and where adapters
    run (exit 2 naming the fix)."""
    if api_key is None:
        raise UsageError(
            f"--lora-load-dir needs --api-key (or ${API_KEY_ENV}): loading adapters reads "
            "files on the node, so only clients holding the key may"
        )
    if not directory.is_dir():
        raise UsageError(
            f"--lora-load-dir {directory}: not a directory; give the directory adapters are "
            "loaded from"
        )
    if errors := runtime_lora_errors(config):
        raise UsageError("; ".join(errors))


def _command_serve(args: argparse.Namespace) -> int:
    from dlo_worker.cli.launch import record_exit, watch_launcher

    watch_launcher()  # under `launch`: a rank whose launcher was killed stops itself
    # The serving flags first: refusing one needs neither torch nor the model directory.
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise UsageError(f"--api-key (or ${API_KEY_ENV}) is empty; set a key or leave it unset")
    default_fields = _default_request_fields(args)
    config = _executable_config(args)

    from dlo_worker.cli.serve import ServeOptions, serve

    lora_load_dir: Path | None = args.lora_load_dir
    if lora_load_dir is not None:
        _check_lora_loading(lora_load_dir, api_key, config)
    loras = adapter_defaults(config)
    if loras is None and lora_load_dir is not None:
        loras = ()  # requests naming none run none, whatever is loaded later
    options = ServeOptions(
        host=args.host,
        port=args.port,
        max_queued_requests=args.max_queued_requests,
        api_key=api_key.strip() if api_key else None,
        defaults=RequestDefaults(**default_fields, loras=loras),
        lora_load_dir=lora_load_dir,
    )
    serve(config, options)
    record_exit(0)  # the drain finished: under `launch`, the Pod ends Succeeded
    return 0


def _default_request_fields(args: argparse.Namespace) -> dict[str, int]:
    """``--default-steps/width/height``, held to the request schema's bounds; the ``--lora``
    adapters join them as a request's default adapters once the configuration is read."""
    given: dict[str, int] = {
        field: getattr(args, f"default_{field}")
        for field in ("steps", "width", "height")
        if getattr(args, f"default_{field}") is not None
    }
    try:
        GenerationRequest.model_validate(given)
    except ValidationError as error:
        problems = [
            f"--default-{problem['loc'][0]}: {problem['msg']}" for problem in error.errors()
        ]
        raise UsageError("; ".join(problems)) from None
    return given


def _command_launch(args: argparse.Namespace) -> int:
    from dlo_worker.cli.launch import launch

    arguments = args.torchrun_arguments
    if arguments[:1] == ["--"]:
        arguments = arguments[1:]
    if not arguments:
        raise UsageError(
            "launch needs torchrun's arguments after --, e.g. dlo-worker launch -- "
            "--nproc-per-node 2 -m dlo_worker serve --model DIR"
        )
    return launch(arguments)


def _command_cache_warm(args: argparse.Namespace) -> int:
    config = _executable_config(args)
    if not config.offload.dlo_enable_runtime_cache:
        raise UsageError("cache warm needs --dlo-enable-runtime-cache (the flags `serve` gets)")

    from dlo_worker.cli.cache import warm_runtime_cache

    report = warm_runtime_cache(config)
    print(json.dumps(report))
    return EXIT_FAILURE if report["result"] == "fallback" else 0


def _cache_store(args: argparse.Namespace) -> RuntimeCacheStore:
    """The store of ``--root``, which must exist: a mistyped root is an error, never an
    empty listing. Every problem a command meets there is one line (exit 2)."""
    from dlo_worker.config import default_runtime_cache_root
    from dlo_worker.runtime_cache.store import RuntimeCacheStore

    root = Path(args.root or default_runtime_cache_root())
    if not root.is_dir():
        raise UsageError(f"no runtime cache at {root} (no such directory); check --root")
    return RuntimeCacheStore(root, lock_timeout=0)


def _command_cache_ls(args: argparse.Namespace) -> int:
    print(json.dumps(_cache_store(args).describe(), indent=2))
    return 0


def _command_cache_verify(args: argparse.Namespace) -> int:
    store = _cache_store(args)
    keys = args.keys or [entry["key"] for entry in store.describe()]
    problems = {key: found for key in keys if (found := store.verify(key))}
    for found in problems.values():
        for problem in found:
            print(f"dlo-worker cache verify: {problem}", file=sys.stderr)
    print(json.dumps({"verified": len(keys), "corrupt": sorted(problems)}))
    return EXIT_FAILURE if problems else 0


def _command_cache_rm(args: argparse.Namespace) -> int:
    store = _cache_store(args)
    for key in args.keys:
        store.remove(key)
        print(f"removed runtime-cache entry {key}")
    return 0


def _add_cache_commands(
    commands: argparse._SubParsersAction, common: argparse.ArgumentParser
) -> None:
    cache_parser = commands.add_parser(
        "cache", parents=[common], help="Inspect, verify, remove or warm runtime-cache entries."
    )
    actions = cache_parser.add_subparsers(dest="cache_command", required=True, parser_class=_Parser)
    root = argparse.ArgumentParser(add_help=False)
    root.add_argument(
        "--root",
        help="Cache root (default: $XDG_CACHE_HOME/dlo-worker/runtime-cache).",
    )
    warm_parser = actions.add_parser(
        "warm",
        parents=[common],
        help="Build or join the entry for a worker configuration (the flags `serve` gets) "
        "and print the result as JSON.",
    )
    _add_config_options(warm_parser)
    warm_parser.set_defaults(handler=_command_cache_warm)
    ls_parser = actions.add_parser(
        "ls", parents=[common, root], help="List entries (JSON): size, last use, processes."
    )
    ls_parser.set_defaults(handler=_command_cache_ls)
    verify_parser = actions.add_parser(
        "verify",
        parents=[common, root],
        help="Re-hash entries against their manifests; exit 1 naming corrupt files.",
    )
    verify_parser.add_argument("keys", nargs="*", help="Entry keys (default: all).")
    verify_parser.set_defaults(handler=_command_cache_verify)
    rm_parser = actions.add_parser(
        "rm", parents=[common, root], help="Remove entries no process uses (refuses others)."
    )
    rm_parser.add_argument("keys", nargs="+", help="Entry keys.")
    rm_parser.set_defaults(handler=_command_cache_rm)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dlo-worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"dlo-worker {__version__}")
    common = _Parser(add_help=False)
    common.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        default=logs.default_level(),
        help=f"Log verbosity (default: ${logs.LOG_LEVEL_ENV} or warning).",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    config_parser = commands.add_parser(
        "config",
        parents=[common],
        help="Validate the flags and print the effective configuration as JSON.",
    )
    _add_config_options(config_parser)
    config_parser.set_defaults(handler=_command_config)

    demo_parser = commands.add_parser(
        "demo-model",
        parents=[common],
        help="Write a small built-in pipeline (offline, deterministic).",
    )
    demo_parser.add_argument("directory", help="Target directory (created).")
    demo_parser.add_argument(
        "--kind",
        choices=["dit", "flux"],
        default="dit",
        help="dit: class-conditional DiTPipeline (default); flux: text-to-image FluxPipeline "
        "with CLIP and T5 text encoders.",
    )
    demo_parser.add_argument(
        "--size",
        choices=["tiny", "full"],
        default="tiny",
        help="tiny (default): seconds on a CPU; full (--kind flux): FLUX.1-dev's sizes and "
        "layout, random bfloat16 weights drawn on the GPU where there is one, checkpoints "
        "in 5GB shards with index files (about 32 GiB on disk; building holds the whole "
        "pipeline, about 33 GB, in GPU memory, or host memory without a GPU).",
    )
    demo_parser.add_argument(
        "--max-shard-size",
        default=None,
        type=_shard_size,
        help="Split each checkpoint into shards of at most this size with an index file "
        "(e.g. 5GB, 200KB), as published checkpoints are (default: one file each, 5GB "
        "for --size full).",
    )
    demo_parser.add_argument(
        "--weights",
        choices=["trained", "random"],
        default=None,
        help="trained (the default for the tiny demos with seed 0): weights trained to draw "
        "a circle or a square in red, green, blue or yellow on a white, black or blue "
        "background, the DiT one per class label 0-21, the Flux at 128x128 one per prompt such "
        "as 'a red circle on a white background'; random: drawn from --seed (the default "
        "otherwise).",
    )
    demo_parser.add_argument(
        "--seed", type=int, default=0, help="Seed of random weights (default: 0)."
    )
    demo_parser.add_argument(
        "--overwrite", action="store_true", help="Replace the directory if it is not empty."
    )
    demo_parser.set_defaults(handler=_command_demo_model)

    generate_parser = commands.add_parser(
        "generate", parents=[common], help="Generate one image and write it as PNG (deterministic)."
    )
    generate_parser.add_argument(
        "--out",
        required=True,
        help="Output PNG path (checked before the model loads; never replaces a directory, "
        "FIFO or device; an existing file keeps its mode, a new one follows the umask).",
    )
    generate_parser.add_argument(
        "--make-parents",
        action="store_true",
        help="Create missing parent directories of --out (default: refuse).",
    )
    request_options = _add_model_fields(
        generate_parser,
        _REQUEST_PREFIX,
        GenerationRequest,
        "request options",
        own_flags=frozenset({"loras"}),
    )
    request_options.add_argument(
        "--use-lora",
        action="append",
        metavar="NAME[:SCALE]",
        help="A --lora adapter this image uses, at SCALE (default 1); repeat for several. "
        "Default: every --lora adapter at its scale.",
    )
    _add_config_options(generate_parser)
    generate_parser.set_defaults(handler=_command_generate)

    serve_parser = commands.add_parser(
        "serve",
        parents=[common],
        help="Serve generation over HTTP until SIGTERM (the container entrypoint).",
    )
    serve_parser.add_argument(
        "--host", default="0.0.0.0", help="Address to listen on (default: 0.0.0.0)."
    )
    serve_parser.add_argument(
        "--port", type=_port, default=8000, help="HTTP port of local rank 0 (default: 8000)."
    )
    serve_parser.add_argument(
        "--api-key",
        help=f"Require 'Authorization: Bearer <key>' on generation routes (default: "
        f"${API_KEY_ENV}, else off; health and metrics stay open). Prefer the variable: a "
        "flag is visible in the process list.",
    )
    serve_parser.add_argument(
        "--lora-load-dir",
        type=Path,
        help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --api-key), "
        "loading adapters from files or directories inside this directory while serving "
        "(default: off). A loaded adapter applies to the requests that name it.",
    )
    serve_parser.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=64,
        help="Requests waiting beyond this get 429 (default: 64).",
    )
    serve_parser.add_argument(
        "--default-steps",
        type=_positive_int,
        help="Denoising steps of a request that names none (default: 25).",
    )
    for side in ("width", "height"):
        serve_parser.add_argument(
            f"--default-{side}",
            type=_positive_int,
            help=f"Image {side} of a request that names none (default: the pipeline's).",
        )
    _add_config_options(serve_parser)
    serve_parser.set_defaults(handler=_command_serve)
    _add_cache_commands(commands, common)
    launch_parser = commands.add_parser(
        "launch",
        parents=[common],
        help="Run torchrun (arguments after --) and exit 0 when every rank finished its "
        "drain after SIGTERM, where torchrun itself would exit 1 (the Pod command).",
    )
    launch_parser.add_argument(
        "torchrun_arguments", nargs=argparse.REMAINDER, help="-- then torchrun's arguments."
    )
    launch_parser.set_defaults(handler=_command_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    numerics.pin_cpu_blas_numerics()  # before anything imports torch
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    try:
        return args.handler(args)
    except UserFixableError as error:
        # The one place user-fixable errors become exit 2 (dlo_worker.errors).
        line = f"dlo-worker {args.command}: error: {error}"
        print(line, file=sys.stderr)
        write_termination_message(line)
        return EXIT_USAGE
    except EngineStoppedError as error:
        line = f"dlo-worker {args.command}: error: {error}"
        print(line, file=sys.stderr)
        write_termination_message(line)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
