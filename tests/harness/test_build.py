"""The control-plane build recipe (pure parts): wrapper modules, replaces, version stamps."""

from __future__ import annotations

import dataclasses
import re

from tests.harness.build import (
    COREDNS_PLUGINS,
    Versions,
    build_key,
    build_steps,
    coredns_main,
    kubernetes_ldflags,
    staging_replaces,
    wrapper_go_mod,
)
from tests.harness.nodes import corefile

KUBERNETES_GO_MOD = """module k8s.io/kubernetes

require (
\tk8s.io/api v0.0.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/kube-openapi => k8s.io/kube-openapi v0.0.0-2025
)
"""

PINNED = Versions(
    kubernetes="v1.34.4",
    etcd="v3.6.16",
    kwok="v0.7.0",
    helm="v3.19.5",
    kube_score="v1.20.0",
    coredns="v1.14.7",
)


def test_every_staging_module_is_replaced_by_its_published_twin() -> None:
    assert staging_replaces(KUBERNETES_GO_MOD, "v0.34.4") == {
        "k8s.io/api": "v0.34.4",
        "k8s.io/client-go": "v0.34.4",
    }


def test_staging_version_follows_the_kubernetes_release() -> None:
    versions = PINNED
    assert versions.staging_version == "v0.34.4"


def test_wrapper_go_mod_requires_and_replaces() -> None:
    text = wrapper_go_mod("dlo.dev/x", {"k8s.io/kubernetes": "v1.34.4"}, {"k8s.io/api": "v0.34.4"})
    assert "module dlo.dev/x" in text
    assert "\tk8s.io/kubernetes v1.34.4" in text
    assert "\tk8s.io/api => k8s.io/api v0.34.4" in text


def test_version_stamps_report_the_real_release() -> None:
    flags = kubernetes_ldflags("v1.34.4")
    assert "-X k8s.io/component-base/version.gitVersion=v1.34.4" in flags
    assert "-X k8s.io/component-base/version.gitMinor=34" in flags
    assert "-X k8s.io/client-go/pkg/version.gitMajor=1" in flags


def test_cache_key_changes_with_any_control_plane_version() -> None:
    base = PINNED
    assert build_key(base) == build_key(base)
    assert build_key(base) != build_key(dataclasses.replace(base, helm="v3.19.6"))
    # A linter bump rebuilds the linter alone (Builder.missing compares its stamp).
    assert build_key(base) == build_key(dataclasses.replace(base, kube_score="v1.21.0"))
    assert build_key(base) == build_key(dataclasses.replace(base, coredns="v1.14.8"))


def test_the_kubernetes_binaries_build_together_first_and_other_tools_alone() -> None:
    missing = ["kube-apiserver", "etcd", "kubelet", "coredns", "kubectl"]
    assert build_steps(missing) == [
        ("kube-apiserver", "kubelet", "kubectl"),
        ("etcd",),
        ("coredns",),
    ]
    assert build_steps(["helm"]) == [("helm",)]
    assert build_steps([]) == []


def test_coredns_is_built_with_the_plugins_the_corefile_uses() -> None:
    """Every directive of the real nodes' Corefile is a plugin of the build (CoreDNS
    refuses a Corefile naming a plugin it lacks), and nothing more is imported."""
    main = coredns_main(COREDNS_PLUGINS)
    imported = set(re.findall(r'"github.com/coredns/coredns/plugin/(\w+)"', main))
    assert imported == set(COREDNS_PLUGINS)
    directives = {
        line.split()[0]
        for line in corefile("10.0.0.1", 53, "/kubeconfig").splitlines()[1:]
        if line.strip() and line.startswith("    ") and not line.startswith("        ")
    } - {"}"}
    assert directives == set(COREDNS_PLUGINS)
    assert "coremain.Run()" in main
