"""Build the local control plane's binaries from Go modules, cached outside the repository.

No release binary can be downloaded here, but Go modules can: each tool is built
from its module inside a small wrapper module. ``k8s.io/kubernetes`` cannot be
required as-is (its go.mod points every ``k8s.io/*`` staging module at a local
directory), so the wrapper replaces each staging module with its published
``v0.X.Y`` twin. Versions live in ``versions.json`` beside this file; the cache
key is a digest of them and of this recipe, so a version bump rebuilds and an
unchanged one is a no-op. Builds land in a temporary file that is renamed into
place, under a lock, so a killed or concurrent build never leaves a broken binary.

    python -m tests.cluster build
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VERSIONS_FILE = Path(__file__).with_name("versions.json")
RECIPE_REVISION = "1"
KUBERNETES_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
NODE_BINARIES = ("kubelet", "kube-proxy", "coredns")
"""Built only where real nodes will run (``build --real-nodes``, ``up --real-nodes``)."""
KUBERNETES_PACKAGES = (*KUBERNETES_BINARIES, "kubelet", "kube-proxy")
"""Every binary of ``k8s.io/kubernetes/cmd``: built by one ``go build`` (they share most of
their packages, and one invocation overlaps one binary's link with another's compile)."""
STAMPED = {"kube-score": "kube_score", "coredns": "coredns"}
"""Tools outside the cache key (a bump rebuilds only that tool): binary name -> version
field, checked against a stamp file next to the binary."""
COREDNS_PLUGINS = ("bind", "errors", "kubernetes", "forward", "cache")
"""The plugins :func:`tests.harness.nodes.corefile` uses. CoreDNS is built with these
alone, as its documentation describes for a custom build: its cloud backends (AWS, Azure,
Google, etcd, gRPC, dnstap) made its build take five minutes on two cores."""

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """A tool failed to build; the message carries the command and the tail of its output."""


@dataclass(frozen=True)
class Versions:
    kubernetes: str
    etcd: str
    kwok: str
    helm: str
    kube_score: str
    """A linter for manifests (run on the chart and on rendered worker Pods)."""
    coredns: str
    """Cluster DNS of the real nodes."""

    @classmethod
    def load(cls, path: Path = VERSIONS_FILE) -> Versions:
        return cls(**json.loads(path.read_text()))

    def control_plane(self) -> dict[str, str]:
        """The versions that key the cache directory (a linter bump rebuilds only itself)."""
        return {k: v for k, v in self.__dict__.items() if k not in STAMPED.values()}

    @property
    def staging_version(self) -> str:
        """``v1.34.4`` -> ``v0.34.4``: the published version of every staging module."""
        return "v0" + self.kubernetes.removeprefix("v1")


def cache_root() -> Path:
    configured = os.environ.get("DLO_CLUSTER_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "diffusion-dlo" / "cluster"


def build_key(versions: Versions) -> str:
    material = json.dumps(versions.control_plane(), sort_keys=True) + RECIPE_REVISION
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def bin_dir(versions: Versions) -> Path:
    return cache_root() / build_key(versions) / "bin"


def staging_replaces(kubernetes_go_mod: str, staging_version: str) -> dict[str, str]:
    """Each ``k8s.io/X => ./staging/src/k8s.io/X`` line, as ``k8s.io/X staging_version``."""
    pattern = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/src/\1\s*$", re.MULTILINE)
    return {module: staging_version for module in pattern.findall(kubernetes_go_mod)}


def wrapper_go_mod(module: str, requires: dict[str, str], replaces: dict[str, str]) -> str:
    """The text of a wrapper go.mod (pure)."""
    lines = [f"module {module}", "", "go 1.24", ""]
    lines += ["require ("] + [f"\t{path} {version}" for path, version in requires.items()] + [")"]
    if replaces:
        lines += ["", "replace ("]
        lines += [f"\t{path} => {path} {version}" for path, version in sorted(replaces.items())]
        lines += [")"]
    return "\n".join(lines) + "\n"


def kubernetes_ldflags(version: str) -> str:
    """Version stamps so ``kube-apiserver --version`` reports the real release."""
    major, minor = version.removeprefix("v").split(".")[:2]
    stamps = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in stamps.items()]
    return " ".join(flags)


def build_steps(missing: list[str]) -> list[tuple[str, ...]]:
    """The builds that make ``missing``, in order (pure): the Kubernetes binaries together
    in one step, first, then every other tool on its own."""
    kubernetes = tuple(name for name in missing if name in KUBERNETES_PACKAGES)
    others = [(name,) for name in missing if name not in KUBERNETES_PACKAGES]
    return [kubernetes, *others] if kubernetes else others


def coredns_main(plugins: tuple[str, ...]) -> str:
    """A CoreDNS main package with only ``plugins`` (pure): what CoreDNS's own ``coredns.go``
    is, with its all-plugins import replaced by these."""
    imports = "".join(f'\t_ "github.com/coredns/coredns/plugin/{name}"\n' for name in plugins)
    return (
        "package main\n\nimport (\n"
        '\t_ "github.com/coredns/coredns/core/dnsserver"\n'
        f"{imports}"
        '\t"github.com/coredns/coredns/coremain"\n'
        ")\n\nfunc main() { coremain.Run() }\n"
    )


ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


def _go_env() -> dict[str, str]:
    """Static binaries from the machine's own Go; go.sum is written on first resolution."""
    env = dict(os.environ)
    env.setdefault("GOFLAGS", "-mod=mod")
    env["CGO_ENABLED"] = "0"
    env.setdefault("GOTOOLCHAIN", "local")
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> None:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
        raise BuildError(f"`{' '.join(command)}` failed in {cwd}:\n{tail}")


PROGRESS_INTERVAL_S = 60.0


def _go_build(
    arguments: list[str], cwd: Path, env: dict[str, str], label: str, progress: Progress
) -> None:
    """``go build -v <arguments>``, saying every minute how many packages it has compiled
    (``-v`` names each one as it is built): the first build of the Kubernetes binaries
    takes ten minutes on two cores, and a silent step that long looks hung."""
    command = ["go", "build", "-v", *arguments]
    started = last_report = time.monotonic()
    compiled = 0
    output: list[str] = []
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line.rstrip())
            compiled += not line.startswith(("#", " ", "go: "))
            if time.monotonic() - last_report >= PROGRESS_INTERVAL_S:
                last_report = time.monotonic()
                progress(
                    f"{label}: {compiled} packages compiled in {last_report - started:.0f} s ..."
                )
    if process.returncode != 0:
        tail = "\n".join(output[-25:])
        raise BuildError(f"`{' '.join(command)}` failed in {cwd}:\n{tail}")


def _go_mod_text(module: str, version: str, env: dict[str, str], cwd: Path) -> str:
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise BuildError(f"cannot download {module}@{version}: {result.stdout}{result.stderr}")
    return Path(json.loads(result.stdout)["GoMod"]).read_text()


def _install(built: Path, target: Path) -> None:
    built.chmod(0o755)
    os.replace(built, target)


class Builder:
    """Builds whatever is missing in :func:`bin_dir` for the pinned versions."""

    def __init__(self, versions: Versions | None = None, progress: Progress = print) -> None:
        self.versions = versions or Versions.load()
        self.progress = progress
        self.root = cache_root() / build_key(self.versions)
        self.bin = self.root / "bin"
        self.env = _go_env()

    def missing(self, extra: tuple[str, ...] = ()) -> list[str]:
        wanted = (*KUBERNETES_BINARIES, "etcd", "kwok", "helm", "kube-score", *extra)
        missing = [name for name in wanted if not (self.bin / name).is_file()]
        for name in STAMPED:
            if name in wanted and name not in missing and self._stamp(name) != self._version(name):
                missing.append(name)
        return missing

    def _version(self, name: str) -> str:
        """The stamp: the version, and for CoreDNS the plugins it is built with."""
        version: str = getattr(self.versions, STAMPED[name])
        return f"{version} {','.join(COREDNS_PLUGINS)}" if name == "coredns" else version

    def _stamp(self, name: str) -> str:
        stamp = self.bin / f".{name}.version"
        return stamp.read_text().strip() if stamp.is_file() else ""

    def ensure(self, extra: tuple[str, ...] = ()) -> Path:
        """Build every missing binary (idempotent), with ``extra`` ones such as
        :data:`NODE_BINARIES`; returns the bin directory."""
        if not self.missing(extra):
            return self.bin
        if shutil.which("go") is None:
            raise BuildError("the go command is not on PATH; install Go >= 1.24")
        self.bin.mkdir(parents=True, exist_ok=True)
        with (self.root / ".build.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            steps = build_steps(self.missing(extra))
            for index, names in enumerate(steps, 1):
                started = time.monotonic()
                label = f"[{index}/{len(steps)}] {', '.join(names)}"
                self.progress(f"{label}: building ...")
                if names[0] in KUBERNETES_PACKAGES:
                    self._build_kubernetes(names)
                else:
                    self._build(names[0])
                self.progress(f"{label}: built in {time.monotonic() - started:.0f} s")
        return self.bin

    def _workspace(self, name: str, go_mod: str, files: dict[str, str] | None = None) -> Path:
        workspace = self.root / "src" / name
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / "go.mod").write_text(go_mod)
        for file_name, text in (files or {}).items():
            (workspace / file_name).write_text(text)
        return workspace

    def _build_kubernetes(self, names: tuple[str, ...]) -> None:
        """``names`` from ``k8s.io/kubernetes/cmd`` in one ``go build`` into a scratch
        directory, each then renamed into place."""
        v = self.versions
        scratch = self.root / "src"
        scratch.mkdir(parents=True, exist_ok=True)
        replaces = staging_replaces(
            _go_mod_text("k8s.io/kubernetes", v.kubernetes, self.env, scratch), v.staging_version
        )
        workspace = self._workspace(
            "kubernetes",
            wrapper_go_mod(
                "dlo.dev/cluster/kubernetes", {"k8s.io/kubernetes": v.kubernetes}, replaces
            ),
        )
        partial = self.bin / ".kubernetes.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        _go_build(
            [
                "-trimpath",
                "-ldflags",
                kubernetes_ldflags(v.kubernetes),
                "-o",
                f"{partial}/",
                *(f"k8s.io/kubernetes/cmd/{name}" for name in names),
            ],
            workspace,
            self.env,
            ", ".join(names),
            self.progress,
        )
        for name in names:
            _install(partial / name, self.bin / name)
        partial.rmdir()

    def _build(self, name: str) -> None:
        v = self.versions
        if name == "etcd":
            workspace = self._workspace(
                "etcd",
                wrapper_go_mod("dlo.dev/cluster/etcd", {"go.etcd.io/etcd/server/v3": v.etcd}, {}),
                {"main.go": ETCD_MAIN},
            )
            package, ldflags = ".", "-s -w"
        elif name == "kwok":
            workspace = self._workspace(
                "kwok", wrapper_go_mod("dlo.dev/cluster/kwok", {"sigs.k8s.io/kwok": v.kwok}, {})
            )
            package = "sigs.k8s.io/kwok/cmd/kwok"
            ldflags = f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={v.kwok}"
        elif name == "helm":
            workspace = self._workspace(
                "helm", wrapper_go_mod("dlo.dev/cluster/helm", {"helm.sh/helm/v3": v.helm}, {})
            )
            package = "helm.sh/helm/v3/cmd/helm"
            ldflags = f"-s -w -X helm.sh/helm/v3/internal/version.version={v.helm}"
        elif name == "kube-score":
            workspace = self._workspace(
                "kube-score",
                wrapper_go_mod(
                    "dlo.dev/cluster/kube-score", {"github.com/zegl/kube-score": v.kube_score}, {}
                ),
            )
            package = "github.com/zegl/kube-score/cmd/kube-score"
            ldflags = f"-s -w -X main.version={v.kube_score.removeprefix('v')}"
        elif name == "coredns":
            workspace = self._workspace(
                "coredns",
                wrapper_go_mod(
                    "dlo.dev/cluster/coredns", {"github.com/coredns/coredns": v.coredns}, {}
                ),
                {"main.go": coredns_main(COREDNS_PLUGINS)},
            )
            package, ldflags = ".", "-s -w"
        else:
            raise BuildError(f"unknown tool {name}")
        if package == ".":
            _run(["go", "mod", "tidy"], workspace, self.env)
        built = self.bin / f".{name}.partial"
        _go_build(
            ["-trimpath", "-ldflags", ldflags, "-o", str(built), package],
            workspace,
            self.env,
            name,
            self.progress,
        )
        _install(built, self.bin / name)
        if name in STAMPED:
            (self.bin / f".{name}.version").write_text(self._version(name))
