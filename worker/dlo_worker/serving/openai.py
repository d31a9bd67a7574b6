"""The OpenAI-compatible images API: ``POST /v1/images/generations`` in our own terms.

Clients and gateways (the OpenAI SDKs, LiteLLM, API gateways) speak this shape, so the
worker accepts it beside its raw-PNG route. This module only translates (pure): the body
becomes a :class:`~dlo_worker.engine.request.GenerationRequest`, PNGs become the response, and
errors take OpenAI's ``{"error": {"message", "type", "param", "code"}}`` form.
"""

from __future__ import annotations

import base64
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dlo_worker.engine.request import (
    MAX_IMAGES_PER_REQUEST,
    MAX_PROMPT_CHARACTERS,
    GenerationRequest,
    LoraChoice,
)

IMAGES_PATH = "/v1/images/generations"
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


class ImagesRequest(BaseModel):
    """OpenAI's image-generation body, plus this worker's request fields as extensions
    (``negative_prompt``, ``seed``, ``steps``, ``guidance_scale``, ``true_cfg_scale``,
    ``loras``)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARACTERS)
    model: str | None = Field(
        default=None, description="Must name the served model when given (see GET /v1/models)."
    )
    n: int = Field(default=1, ge=1, le=MAX_IMAGES_PER_REQUEST)
    size: str | None = Field(
        default=None, description='"WIDTHxHEIGHT", e.g. "1024x1024"; "auto" or unset: default.'
    )
    response_format: Literal["b64_json"] = Field(
        default="b64_json",
        description='Only "b64_json": the worker keeps no files to link to ("url").',
    )
    negative_prompt: str | None = None
    seed: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    loras: tuple[LoraChoice, ...] | None = None

    @field_validator("size")
    @classmethod
    def _size_is_width_by_height(cls, value: str | None) -> str | None:
        if value is not None and value != "auto" and not _SIZE.match(value):
            raise ValueError(f'must be "WIDTHxHEIGHT" (e.g. "1024x1024") or "auto", got {value!r}')
        return value

    def generation_request(self) -> GenerationRequest:
        """The same request in the worker's terms; only the fields given are set, so the
        pipeline check sees exactly what the client asked for."""
        fields = self.model_dump(
            exclude_unset=True, exclude={"model", "n", "size", "response_format"}
        )
        fields = {name: value for name, value in fields.items() if value is not None}
        if self.n != 1:
            fields["num_images"] = self.n
        if self.size not in (None, "auto"):
            width, height = self.size.split("x")
            fields |= {"width": int(width), "height": int(height)}
        return GenerationRequest.model_validate(fields)


def images_response(pngs: list[bytes], created: int) -> dict:
    """OpenAI's response body: one ``b64_json`` entry per image."""
    return {
        "created": created,
        "data": [{"b64_json": base64.b64encode(png).decode("ascii")} for png in pngs],
    }


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str) -> dict:
    """OpenAI's error shape; ``param`` is the field a ``"field: ..."`` message names."""
    head, separator, _ = message.partition(":")
    param = head if separator and re.fullmatch(r"[a-z_.]+", head) else None
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": None,
        }
    }
