"""The Events the operator posts: what they say about which object (pure)."""

from __future__ import annotations

import datetime

from dlo_operator.events import MAX_MESSAGE_CHARACTERS, event_manifest

BODY = {
    "apiVersion": "dlo.dev/v1alpha1",
    "kind": "DiffusionDeployment",
    "metadata": {"name": "flux", "namespace": "team", "uid": "u-1", "resourceVersion": "42"},
}
NOW = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC)


def test_an_event_names_its_object_reason_and_kind() -> None:
    event = event_manifest(BODY, "EngineRestart", "engine 1 lost a rank", warning=True, now=NOW)
    assert event["involvedObject"] == {
        "apiVersion": "dlo.dev/v1alpha1",
        "kind": "DiffusionDeployment",
        "name": "flux",
        "namespace": "team",
        "uid": "u-1",
        "resourceVersion": "42",
    }
    assert event["metadata"] == {"generateName": "flux.", "namespace": "team"}
    assert (event["reason"], event["type"], event["count"]) == ("EngineRestart", "Warning", 1)
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-12-01T12:00:00Z"
    assert event["source"] == {"component": "dlo-operator"}
    normal = event_manifest(BODY, "EngineCreated", "creating engine 0", warning=False, now=NOW)
    assert normal["type"] == "Normal"


def test_a_long_message_is_cut_to_what_the_api_server_takes() -> None:
    event = event_manifest(BODY, "InvalidSpec", "x" * 5000, warning=True, now=NOW)
    assert len(event["message"]) == MAX_MESSAGE_CHARACTERS
    assert event["message"].endswith("...")
