"""The one error of LoRA adapters that cannot apply as given."""

from __future__ import annotations

from dlo_worker.errors import UserFixableError


class LoraSetupError(RuntimeError, UserFixableError):
    """A LoRA adapter cannot be loaded as given (the message names the flag's value or the
    request's field, the file and the reason)."""
