"""Fixtures: one control plane per test session, one namespace per test. The tests that
run containers on real nodes live in :mod:`tests.cluster.real_nodes`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from dlo_operator.crd import custom_resource_definition
from tests.cluster.helpers import eventually
from tests.harness.control_plane import ClusterState, down, up


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    directory = tmp_path_factory.mktemp("cluster")
    state = up(
        directory, nodes=4, build=False, owned=True, progress=lambda line: print(line, flush=True)
    )
    try:
        yield state
    finally:
        down(directory, progress=lambda line: print(line, flush=True))


@pytest.fixture(scope="session")
def api_client(cluster: ClusterState):
    from kubernetes import config

    return config.new_client_from_config(config_file=cluster.kubeconfig)


@pytest.fixture
def namespace(api_client) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name)


@pytest.fixture(scope="session")
def cluster_bin(cluster: ClusterState) -> Path:
    from tests.harness.build import Builder

    return Builder().bin


@pytest.fixture(scope="session")
def crd(api_client) -> None:
    extensions = client.ApiextensionsV1Api(api_client)
    body = custom_resource_definition()
    name = body["metadata"]["name"]
    try:
        extensions.create_custom_resource_definition(body)
    except client.ApiException as error:
        if error.status != 409:
            raise
        current = extensions.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        extensions.replace_custom_resource_definition(name, body)
    eventually(
        lambda: any(
            c.type == "Established" and c.status == "True"
            for c in extensions.read_custom_resource_definition(name).status.conditions or []
        )
    )
