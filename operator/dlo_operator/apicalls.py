"""API writes whose answer the operator does not use.

The kubernetes client turns every answer into its generated models (a created Pod is a
``V1Pod`` tree built field by field in Python). A pass creates or patches several
objects and reads none of the answers back: the watches deliver them. Under a thousand
deployments that deserialisation was a large share of the operator's CPU, taken from the
API server on a small control plane. :func:`write` skips it; a refusal still raises
``ApiException`` carrying the API server's message, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def write(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``call(*args, **kwargs)`` with its answer read and discarded, not deserialised."""
    response = call(*args, _preload_content=False, **kwargs)
    response.drain_conn()
    response.release_conn()
