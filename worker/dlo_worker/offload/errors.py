"""The backend's refusals a user can fix (each message names the fix)."""

from __future__ import annotations

from dlo_worker.errors import UserFixableError


class OffloadSetupError(RuntimeError, UserFixableError):
    """The model cannot be streamed as asked (shared parameters, bad group, second enable)."""


class UnsupportedHostBackingError(ValueError, UserFixableError):
    """The object passed as ``host_weights`` is not a HostWeights this backend can consume."""


class AdapterFusingError(RuntimeError, UserFixableError):
    """A LoRA adapter was to be fused into weights DLO streams."""
