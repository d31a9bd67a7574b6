"""One generation request: what to draw, and the knobs that make it reproducible.

Kept apart from :mod:`dlo_worker.config` because a worker serves many requests
with one configuration; the CLI's ``generate`` and the HTTP server share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator


class GenerationRequest(BaseModel):
    """A single image request. The same request on the same worker gives the same bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(default=25, ge=1, le=1000, description="Denoising steps.")
    seed: int = Field(default=0, ge=0, lt=2**63, description="Seed of the initial noise.")
    guidance_scale: float = Field(
        default=4.0,
        ge=0.0,
        le=100.0,
        description="Classifier-free guidance scale, 0-100 (<= 1 disables it).",
    )
    class_label: int = Field(
        default=207, ge=0, description="Class id for class-conditional pipelines (DiT)."
    )
    prompt: str = Field(default="", description="Text prompt for text-conditional pipelines.")

    @field_validator("guidance_scale")
    @classmethod
    def _guidance_is_finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"--guidance-scale must be a finite number, got {value!r}")
        return value


@dataclass(frozen=True)
class RequestLimits:
    """What the loaded pipeline accepts (derived once after loading; pure to check)."""

    pipeline: str
    conditioning: str
    """``class`` (class-conditional, e.g. DiT) or ``prompt`` (text-to-image)."""
    num_classes: int | None = None


def request_problems(request: GenerationRequest, limits: RequestLimits) -> list[str]:
    """One message per field the loaded pipeline cannot take, naming the allowed values."""
    problems = []
    given = request.model_fields_set
    if limits.conditioning == "class":
        if "prompt" in given and request.prompt:
            problems.append(
                f"prompt: {limits.pipeline} is class-conditional and takes no prompt; "
                "send class_label"
            )
        if limits.num_classes is not None and request.class_label >= limits.num_classes:
            problems.append(
                f"class_label: {request.class_label} is not a class of this model "
                f"(0-{limits.num_classes - 1})"
            )
    elif "class_label" in given:
        problems.append(
            f"class_label: {limits.pipeline} is conditioned on a prompt and takes no "
            "class_label; send prompt"
        )
    return problems
