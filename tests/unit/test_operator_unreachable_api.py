"""A pass cut off by an unreachable API server (a restart, a network partition) must not
leave bookkeeping behind that holds the deployment back once the server is back.

The API server here is a real TCP port with nothing listening: the client gets the same
connection error it gets while a real server restarts, with no answer to tell whether
the call took effect.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kubernetes import client
from urllib3.exceptions import HTTPError

from dlo_operator import apicalls
from dlo_operator.apicalls import TimedApiClient
from dlo_operator.controller import (
    DEPLOYMENT_INDEX,
    INDEXES,
    Controller,
    DeploymentKey,
    LastPass,
    pass_due,
)
from dlo_operator.expectations import EXPECTATION_TIMEOUT_S
from dlo_operator.reconcile import Actions, ObservedPod
from dlo_operator.render import Owner, render_children, render_engine_pods
from tests.support.deployments import deployment_spec
from tests.support.ports import free_port

OWNER = Owner(name="flux", namespace="serving", uid="1234")
KEY = DeploymentKey(OWNER.namespace, OWNER.name)


@pytest.fixture
def unreachable_api() -> Controller:
    """A controller whose client points at a port nobody listens on."""
    configuration = client.Configuration(host=f"https://127.0.0.1:{free_port()}")
    configuration.retries = 0
    return Controller(client.ApiClient(configuration))


def _rank(index: int) -> dict:
    return render_engine_pods(OWNER, deployment_spec(parallelism={"data": 4}), 0)[index]


def test_a_pod_creation_without_an_answer_is_not_expected_any_longer(
    unreachable_api: Controller,
) -> None:
    """Else the pass after the outage counts the Pod as created and starts nothing for
    a minute; creating it again is safe (a name that exists is answered 409)."""
    with pytest.raises(HTTPError):
        unreachable_api._apply(KEY, Actions(create_pods=[_rank(0)]))
    assert unreachable_api.expectations.overlay(KEY, [], now=time.monotonic()) == []


def test_a_child_creation_without_an_answer_is_not_taken_for_ours(
    unreachable_api: Controller,
) -> None:
    service = render_children(OWNER, deployment_spec())[0]
    with pytest.raises(HTTPError):
        unreachable_api._apply(KEY, Actions(apply_children=[service]))
    assert unreachable_api.creating_children == set()


def test_a_pod_deletion_without_an_answer_lapses_and_then_a_pass_is_due(
    unreachable_api: Controller,
) -> None:
    """The deletion may have taken effect: deleting again could count an engine's restart
    twice, so the Pod reads as terminating until the watch says otherwise; if no event
    comes, the expectation lapses and the timer runs the pass that deletes it again."""
    live = ObservedPod.from_manifest(_rank(1))
    with pytest.raises(HTTPError):
        unreachable_api._apply(KEY, Actions(delete_pods=[live.name]))
    expectations = unreachable_api.expectations
    now = time.monotonic()
    assert expectations.overlay(KEY, [live], now)[0].terminating
    steady = LastPass(at=now, refused=False)
    timer = {"first_tick": now, "running": False, "warming": False}
    assert not pass_due(steady, now + 1, **timer, lapsed=expectations.lapsed(KEY, now + 1))
    later = now + EXPECTATION_TIMEOUT_S
    assert pass_due(steady, later, **timer, lapsed=expectations.lapsed(KEY, later))


def test_a_call_the_api_server_never_answers_ends_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that accepts the connection and never answers (one that restarted
    mid-request, a dropped connection behind a load balancer): without a request timeout
    the pass would wait forever and hold every later pass over the deployment."""
    monkeypatch.setattr(apicalls, "REQUEST_TIMEOUT_S", (1.0, 1.0))
    # The deployment as the watch delivered it: the pass reads it from there and then
    # calls the API server to create its children.
    body = {
        "apiVersion": "dlo.dev/v1alpha1",
        "kind": "DiffusionDeployment",
        "metadata": {"name": OWNER.name, "namespace": OWNER.namespace, "uid": OWNER.uid},
        "spec": deployment_spec().model_dump(mode="json", by_alias=True),
    }
    indexes: dict = {index: {} for index in INDEXES}
    indexes[DEPLOYMENT_INDEX] = {KEY: [body]}
    outcome: list[BaseException | None] = []

    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never answers
        configuration = client.Configuration(host=f"https://127.0.0.1:{silent.getsockname()[1]}")
        configuration.retries = 0
        controller = Controller(TimedApiClient(configuration))
        controller.indexes.update(indexes)

        def one_pass() -> None:
            try:
                controller.sync(KEY)
                outcome.append(None)
            except BaseException as error:  # handed to the test's thread
                outcome.append(error)

        worker = threading.Thread(target=one_pass, daemon=True)
        worker.start()
        worker.join(timeout=15)
    assert not worker.is_alive(), "the pass still waits for an answer"
    assert isinstance(outcome[0], HTTPError), outcome
    # The timer's next tick retries it.
    assert controller.last_passes[KEY].refused
    assert not controller.passes.running(KEY)
