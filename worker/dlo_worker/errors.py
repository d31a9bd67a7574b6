"""The one base class of errors a user can fix (torch-free, a leaf module).

Every exception that means "this input, option, file or environment is wrong, and the
message says how to fix it" derives from :class:`UserFixableError`. The CLI maps it to
one line on stderr and exit status 2 in one place (``dlo_worker.cli.main.main``). An
engine that lost a rank (:class:`EngineStoppedError`) exits 1 with one line: nothing is
wrong with the input, and its traceback would only show the collective that failed.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserFixableError(Exception):
    """Bad input or environment; the message names the field or file and the fix."""


class EngineStoppedError(RuntimeError):
    """A rank of the engine's group is gone (killed, out of memory, its node lost): the
    engine cannot run another wave. The leader answers every request it held with 503."""
