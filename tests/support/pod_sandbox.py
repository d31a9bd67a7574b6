"""Run one container of a rendered Pod the way a container runtime would, on this machine.

There is no container runtime here, so this takes what the Pod's securityContext, volumes
and environment say and applies it with the kernel's own mechanisms (root and Linux needed):

- a private mount namespace (``unshare --mount``) whose root filesystem is read-only when
  ``readOnlyRootFilesystem`` is set;
- every emptyDir a fresh tmpfs at its mountPath; every hostPath bind-mounted at its
  mountPath, read-only where the mount says so;
- the user and group of ``runAsUser``/``runAsGroup``, ``fsGroup`` as the only
  supplementary group, and exactly the capabilities ``drop: [ALL]`` + ``add`` leave:
  bounding, inheritable and ambient sets set as a runtime does, so a capability added for a
  non-root user is in the bounding set only and never effective;
- ``no_new_privs`` for ``allowPrivilegeEscalation: false``;
- exactly the container's environment (``$(VAR)`` expanded in the command as the kubelet
  does) plus the image's PATH.

What it cannot apply: the seccomp profile, cgroup limits and a network namespace. Paths the
process needs from this machine (the Python installation, the virtual environment, the
repository) stay reachable even where an ancestor is private (``/root`` is 0700 here) or
covered by an emptyDir: they are bind-mounted back read-only, as an image's layers would be.

    unshare --mount --propagation private python -m tests.support.pod_sandbox PLAN.json
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class ContainerPlan:
    """Everything needed to start one container's process (JSON-serialisable)."""

    argv: list[str]
    env: dict[str, str]
    uid: int
    gid: int
    groups: list[int]
    capabilities: list[str]
    no_new_privs: bool
    read_only_root: bool
    empty_dirs: list[str] = field(default_factory=list)
    binds: list[tuple[str, str, bool]] = field(default_factory=list)
    """(source on this machine, mountPath, read-only)."""
    scaffolds: list[str] = field(default_factory=list)
    """Existing directories covered by an empty tmpfs so missing mountPaths can be made."""
    reachable: list[str] = field(default_factory=list)


def plan_container(
    pod: dict[str, Any],
    container: dict[str, Any],
    *,
    host_paths: dict[str, str],
    env_overrides: dict[str, str],
    argv_overrides: dict[str, str],
    scaffolds: list[str],
) -> ContainerPlan:
    """The plan for ``container`` of ``pod``, with this machine's differences made explicit.

    ``host_paths`` maps hostPath volume names to directories here; ``env_overrides`` and
    ``argv_overrides`` (``--flag`` -> value) replace what cannot hold on one machine
    (cluster DNS names, fixed ports, the GPU device).
    """
    pod_security = pod["spec"].get("securityContext", {})
    security = {**pod_security, **container.get("securityContext", {})}
    dropped = security.get("capabilities", {}).get("drop", [])
    if dropped != ["ALL"]:
        raise ValueError(f"only drop: [ALL] is modelled, not {dropped}")
    env = {item["name"]: item["value"] for item in container.get("env", [])}
    env.update(env_overrides)
    volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
    empty_dirs, binds = [], []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            empty_dirs.append(mount["mountPath"])
        elif "hostPath" in volume or "persistentVolumeClaim" in volume:
            binds.append(
                (host_paths[mount["name"]], mount["mountPath"], bool(mount.get("readOnly")))
            )
        else:
            raise ValueError(f"volume {mount['name']} is not modelled")
    argv = [_VARIABLE.sub(lambda m: env[m.group(1)], part) for part in container["command"]]
    for flag, value in argv_overrides.items():
        argv[argv.index(flag) + 1] = value
    uid = security.get("runAsUser", 0)
    return ContainerPlan(
        argv=argv,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", **env},
        uid=uid,
        gid=security.get("runAsGroup", 0),
        groups=[pod_security["fsGroup"]] if "fsGroup" in pod_security else [],
        capabilities=[c.lower() for c in security.get("capabilities", {}).get("add", [])],
        no_new_privs=security.get("allowPrivilegeEscalation") is False,
        read_only_root=bool(security.get("readOnlyRootFilesystem")),
        empty_dirs=empty_dirs,
        binds=binds,
        scaffolds=scaffolds,
        reachable=sorted({sys.base_prefix, sys.prefix, str(Path(__file__).parents[2])}),
    )


def command(plan: ContainerPlan, plan_path: Path) -> list[str]:
    """The command line that starts ``plan`` (write the plan to ``plan_path`` first)."""
    plan_path.write_text(json.dumps(asdict(plan)))
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        sys.executable,
        "-m",
        "tests.support.pod_sandbox",
        str(plan_path),
    ]


def _mount(*arguments: str) -> None:
    subprocess.run(["mount", *arguments], check=True)


def _private_ancestor(path: str) -> str | None:
    """The highest ancestor that others may not traverse, if any."""
    current = Path("/")
    for part in Path(path).parts[1:]:
        current = current / part
        if current.is_dir() and not os.stat(current).st_mode & stat.S_IXOTH:
            return str(current)
    return None


def _covers(path: str, cover: str) -> bool:
    return path == cover or path.startswith(cover.rstrip("/") + "/")


def _mount_point(path: str, mounted: list[str]) -> None:
    """Make a missing mount point, but only inside a tmpfs of ours: never on this machine."""
    if Path(path).is_dir():
        return
    if not any(_covers(path, cover) for cover in mounted):
        raise SystemExit(f"{path} does not exist here: add a scaffold above it")
    Path(path).mkdir(parents=True)


def _enter(plan: ContainerPlan) -> None:
    """Build the mount table (as root, in the new namespace), then become the container."""
    covers = [*plan.scaffolds, *plan.empty_dirs]
    covers += [p for p in map(_private_ancestor, plan.reachable) if p]
    # Reachable paths hidden by a cover come back at their own place (recursively: /usr may
    # hold the driver's mount), read-only like an image layer.
    hidden = [p for p in plan.reachable if any(_covers(p, cover) for cover in covers)]
    keep = [(path, path, True) for path in hidden] + [tuple(b) for b in plan.binds]
    # Hold every bind source open, cover, then bind the sources through their descriptors.
    held = [os.open(source, os.O_PATH | os.O_DIRECTORY) for source, _, _ in keep]
    mounted: list[str] = []
    for cover in sorted(set(covers), key=lambda p: p.count("/")):
        _mount_point(cover, mounted)
        mode = "1777" if cover in plan.empty_dirs else "0755"
        _mount("-t", "tmpfs", "-o", f"mode={mode}", "cover", cover)
        mounted.append(cover)
    for descriptor, (_, target, read_only) in zip(held, keep, strict=True):
        _mount_point(target, mounted)
        _mount("--no-canonicalize", "--rbind", f"/proc/{os.getpid()}/fd/{descriptor}", target)
        if read_only:
            _mount("-o", "remount,bind,ro", target)
        os.close(descriptor)
    if plan.read_only_root:
        _mount("-o", "remount,bind,ro", "/")
    capabilities = ",".join(f"+{c}" for c in plan.capabilities)
    setpriv = [
        "setpriv",
        f"--reuid={plan.uid}",
        f"--regid={plan.gid}",
        f"--groups={','.join(map(str, plan.groups))}" if plan.groups else "--clear-groups",
        f"--bounding-set=-all{',' + capabilities if capabilities else ''}",
        "--inh-caps=-all",
        "--ambient-caps=-all",
    ]
    if plan.no_new_privs:
        setpriv.append("--no-new-privs")
    os.chdir("/")
    os.execvpe("setpriv", [*setpriv, "--", *plan.argv], plan.env)


if __name__ == "__main__":
    _enter(ContainerPlan(**json.loads(Path(sys.argv[1]).read_text())))
