"""The CLI spelling of the configuration: each field is ``--`` + its name with dashes
(:func:`flag_for`), so flags, rule messages and the operator's rendered command lines
agree; and pydantic's errors read back in flag terms."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from dlo_worker.config.schema import WorkerConfig

# Flags whose spelling is not simply "--" + the field name with dashes.
NEGATIVE_FLAGS = {"dlo_use_allgather": "--dlo-no-use-allgather"}


def flag_for(field_name: str) -> str:
    """The CLI flag of a configuration field (the one-to-one mapping the CLI is built from)."""
    return "--" + field_name.replace("_", "-")


def _flag_value(value: object) -> str:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def to_flags(config: WorkerConfig) -> list[str]:
    """The CLI flags that reproduce ``config`` (non-default fields only); the inverse of
    parsing. The operator renders worker command lines with it."""
    flags: list[str] = []
    for group_name in type(config).model_fields:
        group = getattr(config, group_name)
        for name, field in type(group).model_fields.items():
            value = getattr(group, name)
            if value == field.default:
                continue
            if isinstance(value, bool):
                flags.append(flag_for(name) if value else NEGATIVE_FLAGS[name])
            else:
                flags += [flag_for(name), _flag_value(value)]
    return flags


def _field_flag(location: tuple[int | str, ...]) -> str | None:
    names = [part for part in location if isinstance(part, str)]
    return flag_for(names[-1]) if names else None


def describe_validation_error(error: ValidationError) -> str:
    """Render a pydantic error as one line naming each offending flag."""
    parts: list[str] = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        flag = _field_flag(item["loc"])
        if item["type"] == "value_error" or flag is None:
            parts.append(message)
        elif item["type"] == "extra_forbidden":
            parts.append(f"{flag} is not a known option")
        else:
            parts.append(f"{flag}: {message[0].lower()}{message[1:]} (got {item['input']!r})")
    return "; ".join(parts)
