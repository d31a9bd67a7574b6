"""API writes whose answer the operator does not use.

The kubernetes client turns every answer into its generated models (a created Pod is a
``V1Pod`` tree built field by field in Python). A pass creates or patches several
objects and reads none of the answers back: the watches deliver them. Under a thousand
deployments that deserialisation was a large share of the operator's CPU, taken from the
API server on a small control plane. :func:`write` skips it; a refusal still raises
``ApiException`` carrying the API server's message, as before.

Every call has a timeout (:class:`TimedApiClient`, made by :func:`api_client`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes import config as kube_config

FIELD_MANAGER = "dlo-operator"
"""The field manager of every server-side apply (the fields the operator owns)."""
APPLY = {
    "field_manager": FIELD_MANAGER,
    "force": True,
    "_content_type": "application/apply-patch+yaml",
}
"""Keyword arguments that make a client ``patch_*`` call a server-side apply. ``force``:
the operator's rendering wins a field another manager also set (an older release's)."""


def write(call: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """``call(*args, **kwargs)`` with its answer read and discarded, not deserialised;
    returns the HTTP status (201 when an apply created the object)."""
    response = call(*args, _preload_content=False, **kwargs)
    response.drain_conn()
    response.release_conn()
    return int(response.status)


REQUEST_TIMEOUT_S = (5.0, 30.0)
"""Connect and read timeouts of every API call a pass makes. Without them a call the
API server never answers (it restarted mid-request, or a partition dropped the
connection) blocks its pass for good, and with it every later pass over the deployment."""


class TimedApiClient(client.ApiClient):
    """The kubernetes client with :data:`REQUEST_TIMEOUT_S` on every call that sets none
    (the client's own default is to wait forever)."""

    def call_api(self, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        kwargs["_request_timeout"] = (
            REQUEST_TIMEOUT_S if _request_timeout is None else _request_timeout
        )
        return super().call_api(*args, **kwargs)


def api_client() -> TimedApiClient:
    """A client with in-cluster credentials, else the kubeconfig's."""
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    return TimedApiClient()
