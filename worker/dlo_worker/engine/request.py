"""One generation request: what to draw, and the knobs that make it reproducible.

Kept apart from :mod:`dlo_worker.config` because a worker serves many requests
with one configuration; the CLI's ``generate`` and the HTTP server share it.
The schema bounds every field; :func:`request_problems` then checks a request
against what the loaded pipeline actually uses (:class:`RequestLimits`), so a field
the model would ignore or overflow is refused instead of silently dropped. JSON bodies
are validated strictly (:func:`dlo_worker.serving.app`): a number must be a JSON number, never
a string or a boolean; the CLI's flags arrive as text and are parsed as numbers.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dlo_worker.config.values import MAX_LORA_SCALE

MAX_IMAGES_PER_REQUEST = 8
MAX_PROMPT_CHARACTERS = 10_000
MAX_LORAS_PER_REQUEST = 8


@dataclass(frozen=True)
class AdapterChange:
    """A LoRA adapter loaded or unloaded while serving (``serve --lora-load-dir``). It
    travels through the request queue like a request, so every rank of the engine makes it
    between the same two waves, after every request queued before it."""

    name: str
    path: Path | None
    """The adapter's file or directory to load; None unloads ``name``."""
    max_rank: int | None = None
    """``--max-lora-rank``: a loaded adapter's rank may not exceed it."""


class LoraChoice(BaseModel):
    """One LoRA adapter a request runs with: a name the worker loaded it under (``--lora
    NAME=PATH``) and its scale."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64, description="A loaded adapter's name.")
    scale: float = Field(
        default=1.0,
        ge=-MAX_LORA_SCALE,
        le=MAX_LORA_SCALE,
        allow_inf_nan=False,
        description=f"Its scale, -{MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g}.",
    )


class GenerationRequest(BaseModel):
    """A single request for ``num_images`` images. The same request on the same worker
    gives the same bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(default=25, ge=1, le=1000, description="Denoising steps.")
    seed: int = Field(default=0, ge=0, lt=2**63, description="Seed of the initial noise.")
    guidance_scale: float = Field(
        default=4.0,
        ge=0.0,
        le=100.0,
        allow_inf_nan=False,
        description="Guidance scale, 0-100: classifier-free (<= 1 disables it) or, for "
        "guidance-distilled models such as FLUX.1-dev, the embedded guidance.",
    )
    class_label: int = Field(
        default=207, ge=0, description="Class id for class-conditional pipelines (DiT)."
    )
    prompt: str = Field(
        default="",
        max_length=MAX_PROMPT_CHARACTERS,
        description="Text prompt for text-conditional pipelines.",
    )
    negative_prompt: str | None = Field(
        default=None,
        max_length=MAX_PROMPT_CHARACTERS,
        description="What the image should not show (text-conditional pipelines with "
        "classifier-free guidance; guidance-distilled ones need true_cfg_scale > 1).",
    )
    true_cfg_scale: float | None = Field(
        default=None,
        ge=1.0,
        le=100.0,
        allow_inf_nan=False,
        description="True classifier-free guidance with negative_prompt, for "
        "guidance-distilled pipelines (Flux); > 1 runs a second transformer pass per step.",
    )
    width: int | None = Field(
        default=None, ge=1, le=8192, description="Image width in pixels (pipeline default)."
    )
    height: int | None = Field(
        default=None, ge=1, le=8192, description="Image height in pixels (pipeline default)."
    )
    num_images: int = Field(
        default=1, ge=1, le=MAX_IMAGES_PER_REQUEST, description="Images for this request."
    )
    loras: tuple[LoraChoice, ...] | None = Field(
        default=None,
        max_length=MAX_LORAS_PER_REQUEST,
        description="LoRA adapters for this request, each a loaded adapter's name with a "
        "scale; [] for none. Left out: every --lora adapter at its scale.",
    )


def wave_key(request: GenerationRequest) -> tuple[int, float, float, bool]:
    """What must match for requests to share a lockstep (AllGather) wave: everything that
    can change how many times the transformer's blocks run.

    The number of steps fixes the denoising loop; guidance can add an unconditional pass
    on some pipelines, and a negative prompt with ``true_cfg_scale`` > 1 adds one on
    guidance-distilled ones. Size, ``num_images``, seeds and conditioning change only the
    activations, never the block sequence, so such requests share waves; so do LoRA
    adapters, which each rank keeps on its device and applies inside the blocks.
    """
    return (
        request.steps,
        request.guidance_scale,
        request.true_cfg_scale or 1.0,
        request.negative_prompt is not None,
    )


class Guidance(enum.StrEnum):
    """How a pipeline uses ``guidance_scale``."""

    CLASSIFIER_FREE = "classifier-free"
    """A second, negative/unconditional pass when ``guidance_scale`` > 1 (DiT, SD3)."""
    EMBEDDED = "embedded"
    """Guidance-distilled (FLUX.1-dev): the scale is an input of the transformer."""
    UNUSED = "unused"
    """Neither (e.g. FLUX.1-schnell): ``guidance_scale`` would be ignored."""


@dataclass(frozen=True)
class RequestDefaults:
    """The server's values for fields a request leaves out (``serve --default-*``).

    Applied before the request is checked, so a default is held to the same limits as a
    value the client sent; :func:`defaults_problems` checks them once at start-up.
    """

    steps: int | None = None
    width: int | None = None
    height: int | None = None
    loras: tuple[LoraChoice, ...] | None = None
    """Every ``--lora`` adapter at its scale (``None`` without adapters)."""

    def apply(self, request: GenerationRequest) -> GenerationRequest:
        given = request.model_dump(exclude_unset=True)
        defaults = {
            field: value
            for field, value in vars(self).items()
            if value is not None and field not in given
        }
        if not defaults:
            return request
        return GenerationRequest.model_validate({**defaults, **given})


NO_DEFAULTS = RequestDefaults()
"""Every field a request leaves out takes the schema's default."""


def defaults_problems(defaults: RequestDefaults, limits: RequestLimits) -> list[str]:
    """What the loaded pipeline refuses in the server's defaults, naming their flags."""
    return [
        _in_flag_terms(problem, fields=vars(defaults))
        for problem in request_problems(defaults.apply(GenerationRequest()), limits)
    ]


def _in_flag_terms(problem: str, fields: Iterable[str]) -> str:
    """A request problem about defaulted fields, naming ``--default-<field>`` instead."""
    for field in fields:
        problem = problem.replace(f"leave {field} out", f"leave --default-{field} out")
    if problem.startswith("width x height"):
        return problem.replace("width x height", "--default-width x --default-height", 1)
    return f"--default-{problem}"


@dataclass(frozen=True)
class RequestLimits:
    """What the loaded pipeline accepts (derived once after loading; pure to check)."""

    pipeline: str
    conditioning: str
    """``class`` (class-conditional, e.g. DiT) or ``prompt`` (text-to-image)."""
    num_classes: int | None = None
    guidance: Guidance = Guidance.CLASSIFIER_FREE
    takes_negative_prompt: bool = False
    takes_true_cfg_scale: bool = False
    """Guidance-distilled pipelines (Flux) run true CFG with a negative prompt when
    ``true_cfg_scale`` > 1."""
    takes_size: bool = False
    """Whether ``width``/``height`` reach the pipeline; if not it draws ``default_size``."""
    takes_num_images: bool = False
    default_size: tuple[int, int] | None = None
    """(width, height) the pipeline draws without a size."""
    adapters: tuple[str, ...] = ()
    """The names of the LoRA adapters requests choose from (``--lora``, not fused)."""
    fused_adapters: tuple[str, ...] = ()
    """The names of the adapters fused into the weights (``--fuse-lora``): they always
    apply, and a request cannot choose them."""
    size_multiple: int = 8
    """A side in pixels is a whole number of latent patches of this many pixels."""
    max_side: int = 2048
    token_split: int = 1
    """The SP size: sequence parallelism splits the image's patches (tokens) evenly over
    the SP ranks, so their count must divide by it."""


def request_problems(request: GenerationRequest, limits: RequestLimits) -> list[str]:
    """One message per field the loaded pipeline cannot take, naming the allowed values."""
    given = request.model_fields_set
    return [
        *_conditioning_problems(request, given, limits),
        *_guidance_problems(request, given, limits),
        *_size_problems(request, given, limits),
        *_lora_problems(request, limits),
    ]


def _lora_problems(request: GenerationRequest, limits: RequestLimits) -> list[str]:
    if not request.loras:  # none, or the server's default; [] runs none
        return []
    if not limits.adapters and not limits.fused_adapters:
        return [
            "loras: this worker loaded no LoRA adapters; leave loras out, or start it "
            "with --lora NAME=PATH"
        ]
    names = [choice.name for choice in request.loras]
    problems = []
    if fused := [name for name in dict.fromkeys(names) if name in limits.fused_adapters]:
        problems.append(
            f"loras: {', '.join(fused)} fused into the weights at start (--fuse-lora) and "
            "always applied; leave it out"
        )
    if unknown := [
        name
        for name in dict.fromkeys(names)
        if name not in limits.adapters and name not in limits.fused_adapters
    ]:
        problems.append(
            f"loras: {', '.join(unknown)} not loaded; choose from {', '.join(limits.adapters)}"
        )
    if repeated := [name for name in dict.fromkeys(names) if names.count(name) > 1]:
        problems.append(f"loras: {', '.join(repeated)} named more than once; name each once")
    return problems


def _conditioning_problems(
    request: GenerationRequest, given: set[str], limits: RequestLimits
) -> list[str]:
    name = limits.pipeline
    if limits.conditioning == "class":
        problems = [
            f"{field}: {name} is class-conditional and takes no {field}; send class_label"
            for field in ("prompt", "negative_prompt")
            if field in given and getattr(request, field)
        ]
        if limits.num_classes is not None and request.class_label >= limits.num_classes:
            problems.append(
                f"class_label: {request.class_label} is not a class of this model "
                f"(0-{limits.num_classes - 1})"
            )
        return problems
    if "class_label" in given:
        return [f"class_label: {name} is conditioned on a prompt and takes no class_label"]
    return []


def _guidance_problems(
    request: GenerationRequest, given: set[str], limits: RequestLimits
) -> list[str]:
    name = limits.pipeline
    problems = []
    if limits.guidance is Guidance.UNUSED and "guidance_scale" in given:
        problems.append(f"guidance_scale: {name} is not guidance-conditioned; leave it out")
    true_cfg = request.true_cfg_scale or 1.0
    if request.true_cfg_scale is not None and not limits.takes_true_cfg_scale:
        problems.append(f"true_cfg_scale: {name} takes no true_cfg_scale; leave it out")
    elif true_cfg > 1.0 and request.negative_prompt is None:
        problems.append("true_cfg_scale: > 1 needs a negative_prompt to guide against")
    if request.negative_prompt is None or limits.conditioning == "class":
        return problems
    if not limits.takes_negative_prompt:
        problems.append(f"negative_prompt: {name} takes no negative prompt")
    elif limits.takes_true_cfg_scale:
        if true_cfg <= 1.0:
            problems.append(
                f"negative_prompt: {name} uses a negative prompt only with true_cfg_scale > 1;"
                " send true_cfg_scale (e.g. 4)"
            )
    elif limits.guidance is not Guidance.CLASSIFIER_FREE or request.guidance_scale <= 1.0:
        problems.append(
            "negative_prompt: has no effect unless guidance_scale > 1; raise guidance_scale"
        )
    return problems


def _size_problems(request: GenerationRequest, given: set[str], limits: RequestLimits) -> list[str]:
    name = limits.pipeline
    problems = []
    if request.num_images > 1 and not limits.takes_num_images:
        problems.append(f"num_images: {name} draws one image per request; send 1")
    for field in ("width", "height"):
        value = getattr(request, field)
        if value is None:
            continue
        if not limits.takes_size:
            fixed = "x".join(map(str, limits.default_size)) if limits.default_size else "one"
            problems.append(f"{field}: {name} draws {fixed} images only; leave {field} out")
        elif value % limits.size_multiple or not 0 < value <= limits.max_side:
            problems.append(
                f"{field}: {value} is not a multiple of {limits.size_multiple} from "
                f"{limits.size_multiple} to {limits.max_side}"
            )
    if problems or limits.token_split == 1 or not limits.takes_size:
        return problems
    width, height = (
        getattr(request, field) or (limits.default_size or (0, 0))[index]
        for index, field in enumerate(("width", "height"))
    )
    tokens = (width // limits.size_multiple) * (height // limits.size_multiple)
    if tokens % limits.token_split:
        problems.append(
            f"width x height: {width}x{height} is {tokens} patches of {limits.size_multiple}"
            f"x{limits.size_multiple} pixels, which do not split evenly over the "
            f"{limits.token_split} sequence-parallel ranks; choose a size whose patch count "
            f"is a multiple of {limits.token_split}"
        )
    return problems
