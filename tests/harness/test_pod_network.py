"""The real nodes' pod network (pure parts): never one the host already routes elsewhere."""

from __future__ import annotations

from ipaddress import IPv4Network

import pytest

from tests.harness.nodes import NetworkError, choose_pod_network, node_pod_cidr

SERVICES = "10.0.0.0/16"


def test_a_host_with_no_private_routes_gets_flannels_default() -> None:
    host = [IPv4Network("127.0.0.0/8"), IPv4Network("192.0.2.0/24")]
    assert choose_pod_network(host, SERVICES) == IPv4Network("10.244.0.0/16")


def test_a_host_that_is_itself_a_flannel_pod_gets_the_next_network() -> None:
    """The CI runner's failure: its own address in 10.244.1.0/24 took the route of node 1's
    bridge, and node 1's Pods answered nothing ("no route to host")."""
    host = [IPv4Network("10.244.1.0/24"), IPv4Network("10.244.0.0/16")]
    network = choose_pod_network(host, SERVICES)
    assert network == IPv4Network("10.245.0.0/16")
    assert not any(network.overlaps(taken) for taken in host)


def test_a_host_route_inside_a_candidate_skips_it() -> None:
    host = [IPv4Network("10.244.7.9/32"), IPv4Network("10.245.0.0/20")]
    assert choose_pod_network(host, SERVICES) == IPv4Network("10.246.0.0/16")


def test_a_wide_host_route_skips_every_candidate_it_covers() -> None:
    host = [IPv4Network("10.0.0.0/8")]
    assert choose_pod_network(host, "192.168.0.0/24") == IPv4Network("172.16.0.0/16")


def test_the_service_range_is_never_a_pod_network() -> None:
    assert choose_pod_network([], "10.244.0.0/15") == IPv4Network("10.246.0.0/16")


def test_a_host_with_every_candidate_taken_is_refused_naming_what_takes_them() -> None:
    host = [IPv4Network("10.0.0.0/8"), IPv4Network("172.16.0.0/12")]
    with pytest.raises(NetworkError, match=r"10\.0\.0\.0/8.*172\.16\.0\.0/12.*192\.168"):
        choose_pod_network(host, "192.168.0.0/16")


def test_node_cidrs_are_consecutive_24s_of_the_network() -> None:
    network = IPv4Network("10.245.0.0/16")
    assert [node_pod_cidr(network, index) for index in (0, 1, 2)] == [
        "10.245.0.0/24",
        "10.245.1.0/24",
        "10.245.2.0/24",
    ]
