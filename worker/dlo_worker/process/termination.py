"""The container's termination message: the one line that says why the worker stopped.

Kubernetes shows the text of ``/dev/termination-log`` as a terminated container's
message (and, with ``terminationMessagePolicy: FallbackToLogsOnError``, the last log lines
when the file is empty); the operator reports it in the deployment's status. Outside a
container the file does not exist and nothing is written (``$DLO_TERMINATION_LOG`` names
another file, for tests).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

TERMINATION_LOG = Path("/dev/termination-log")
TERMINATION_LOG_ENV = "DLO_TERMINATION_LOG"

logger = logging.getLogger(__name__)


def write_termination_message(line: str, *, replace: bool = True) -> None:
    """Record ``line`` as the container's termination message; with ``replace`` False only
    where no message was recorded yet (a rank's own line beats its launcher's)."""
    path = Path(os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG))
    try:
        if not path.exists() or (not replace and path.stat().st_size):
            return
        path.write_text(line.strip() + "\n")
    except OSError as error:  # the message is a courtesy: never mask the error itself
        logger.debug("termination message not written", extra={"fields": {"why": str(error)}})
