"""Build the worker and operator images from ``docker/*.Dockerfile`` with buildah.

No image registry is reachable here, so the ``FROM`` image is made from Debian's own
packages: debootstrap of the release the public ``python:3.11-slim`` image is built on
(bookworm, whose Python is 3.11), shaped like it (``python`` and ``pip`` on ``PATH``, no
PEP 668 marker, so the Dockerfiles' ``pip install`` runs unchanged) and committed to
buildah's storage. The Dockerfiles take it through their ``BASE_IMAGE`` build argument,
whose default stays the public image for users.

Each image is then saved as an OCI archive under the cluster cache, keyed by a digest of
everything that went into it (the Dockerfile, the build files, the sources it copies,
the base image's key), so an unchanged tree is a no-op and any change rebuilds. Archives
are written to a temporary name and renamed into place under a lock, so a killed build
never leaves a half-written image behind.

    python -m tests.cluster images
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.harness.build import BuildError, Progress, cache_root

REPOSITORY = Path(__file__).resolve().parents[2]
RECIPE_REVISION = "1"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-pip", "python-is-python3", "ca-certificates")
HOST_PACKAGES = {"buildah": "buildah", "debootstrap": "debootstrap", "runc": "runc"}
"""Commands the build needs, and the Debian package of each (buildah only recommends an
OCI runtime, and ``RUN`` steps need one)."""
IMAGES = {"worker": "docker/worker.Dockerfile", "operator": "docker/operator.Dockerfile"}
RUNTIME = ("--runtime", "runc")
"""buildah prefers crun when installed, and crun refuses this machine's hybrid cgroups."""
COPIED_SOURCES = ("pyproject.toml", "setup.py", "README.md", "worker", "operator")
"""What the Dockerfiles copy from the repository (their build context's inputs)."""


@dataclass(frozen=True)
class BuiltImage:
    """One image in buildah's storage and its OCI archive (for a container runtime)."""

    name: str
    reference: str
    archive: Path


LOCAL_CA_DIRECTORY = Path("/usr/local/share/ca-certificates")
"""Certificate authorities this machine trusts beyond Debian's (e.g. an egress proxy's);
the base image trusts them too, so ``pip install`` inside the build reaches PyPI as the
host does."""


def local_certificates() -> list[Path]:
    return sorted(LOCAL_CA_DIRECTORY.rglob("*.crt")) if LOCAL_CA_DIRECTORY.is_dir() else []


def base_key() -> str:
    certificates = [path.read_text() for path in local_certificates()]
    material = "\n".join(
        [RECIPE_REVISION, DEBIAN_SUITE, DEBIAN_MIRROR, *BASE_PACKAGES, *certificates]
    )
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def source_digest(root: Path = REPOSITORY) -> str:
    """A digest of the files the Dockerfiles copy (bytecode and build leftovers excluded)."""
    digest = hashlib.sha256()
    for entry in COPIED_SOURCES:
        path = root / entry
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            relative = file.relative_to(root)
            if (
                "__pycache__" in relative.parts
                or any(part.endswith(".egg-info") for part in relative.parts)
                or relative.suffix == ".so"  # built in place; .dockerignore leaves it out
            ):
                continue
            digest.update(str(relative).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def image_key(name: str, root: Path = REPOSITORY) -> str:
    material = "\n".join(
        [RECIPE_REVISION, base_key(), (root / IMAGES[name]).read_text(), source_digest(root)]
    )
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def _run(command: list[str], *, cwd: Path | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
        raise BuildError(f"`{' '.join(command)}` failed:\n{tail}")
    return result.stdout.strip()


def missing_host_tools() -> list[str]:
    """The Debian packages of the commands the build needs and this machine lacks."""
    return [package for command, package in HOST_PACKAGES.items() if not shutil.which(command)]


def ensure_host_tools(progress: Progress) -> None:
    """Install buildah, debootstrap and runc from the package mirror when they are missing
    (root only: otherwise say which packages to install)."""
    missing = missing_host_tools()
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise BuildError(
            f"building images needs {', '.join(missing)}: install them "
            f"(apt-get install {' '.join(missing)}) or run this as root on Debian"
        )
    progress(f"installing {', '.join(missing)} from the package mirror ...")
    _run(["apt-get", "update", "-qq"])
    _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing])


def _image_exists(reference: str) -> bool:
    result = subprocess.run(
        ["buildah", "inspect", "--type", "image", reference], capture_output=True, check=False
    )
    return result.returncode == 0


def _remove_leftover_containers() -> None:
    """Working containers a killed build left (of the base image being made, or of a
    Dockerfile's stages): each holds a writable layer until removed. Called under the
    build lock, before any build, when no test uses a container of these images."""
    listed = _run(["buildah", "containers", "--format", "{{.ContainerID}} {{.ImageName}}"])
    leftovers = [
        fields[0]
        for fields in (line.split() for line in listed.splitlines())
        if fields and (len(fields) == 1 or fields[1].startswith(("localhost/dlo-", "scratch")))
    ]
    if leftovers:
        _run(["buildah", "rm", *leftovers])


class ImageBuilder:
    """Builds the base image and every image of :data:`IMAGES` that is missing."""

    def __init__(self, progress: Progress = print, root: Path = REPOSITORY) -> None:
        self.progress = progress
        self.repository = root
        self.cache = cache_root() / "images"

    @property
    def base_reference(self) -> str:
        return f"localhost/dlo-base:{base_key()}"

    def archive(self, name: str) -> Path:
        return self.cache / image_key(name, self.repository) / f"{name}.oci.tar"

    def reference(self, name: str) -> str:
        return f"localhost/dlo-{name}:{image_key(name, self.repository)}"

    @property
    def pause(self) -> BuiltImage:
        """The sandbox image of real nodes: the base image, sleeping."""
        reference = f"localhost/dlo-pause:{base_key()}"
        return BuiltImage("pause", reference, self.cache / base_key() / "pause.oci.tar")

    def expected(self) -> dict[str, BuiltImage]:
        """Every image of the current sources, by name, built or not."""
        images = {
            name: BuiltImage(name, self.reference(name), self.archive(name)) for name in IMAGES
        }
        images["pause"] = self.pause
        return images

    def missing(self) -> list[str]:
        """The images of the current sources not yet built and archived."""
        return [
            name
            for name, image in self.expected().items()
            if not (image.archive.is_file() and _image_exists(image.reference))
        ]

    def ensure(self) -> dict[str, BuiltImage]:
        """Every image built and archived (idempotent); returns them by name."""
        built = self.expected()
        if not self.missing():
            return built
        ensure_host_tools(self.progress)
        self.cache.mkdir(parents=True, exist_ok=True)
        with (self.cache / ".build.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _remove_leftover_containers()
            self._ensure_base()
            for image in built.values():
                if not _image_exists(image.reference):
                    if image.name == "pause":
                        self._make_pause(image)
                    else:
                        self._build(image)
                if not image.archive.is_file():
                    self._save(image)
            self._prune({self.base_reference, *(image.reference for image in built.values())})
        return built

    def _prune(self, keep: set[str]) -> None:
        """Drop images and archives of earlier keys (a worker image is several GB)."""
        listed = _run(["buildah", "images", "--format", "{{.Name}}:{{.Tag}}"]).splitlines()
        stale = [
            reference
            for reference in listed
            if reference.startswith(
                (
                    "localhost/dlo-base:",
                    "localhost/dlo-pause:",
                    *(f"localhost/dlo-{n}:" for n in IMAGES),
                )
            )
            and reference not in keep
        ]
        if stale:
            _run(["buildah", "rmi", *stale])
        current = {Path(self.archive(name)).parent.name for name in IMAGES} | {base_key()}
        for directory in self.cache.iterdir():
            if directory.is_dir() and directory.name not in current:
                shutil.rmtree(directory, ignore_errors=True)

    def _ensure_base(self) -> None:
        if _image_exists(self.base_reference):
            return
        started = time.monotonic()
        self.progress(f"making the base image ({DEBIAN_SUITE} + Python 3.11, debootstrap) ...")
        with tempfile.TemporaryDirectory(dir=self.cache) as scratch:
            rootfs = Path(scratch) / "rootfs"
            _run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    DEBIAN_SUITE,
                    str(rootfs),
                    DEBIAN_MIRROR,
                ]
            )
            for certificate in local_certificates():
                target = rootfs / certificate.relative_to("/").as_posix()
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(certificate, target)
            if local_certificates():
                _run(["chroot", str(rootfs), "update-ca-certificates"])
            # Like python:3.11-slim: pip installs into the system Python, no apt lists kept.
            for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
                marker.unlink()
            shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
            (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True)
            shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
            tarball = Path(scratch) / "rootfs.tar"
            _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tarball), "."])
            container = _run(["buildah", "from", "scratch"])
            try:
                _run(["buildah", "add", container, str(tarball), "/"])
                _run(
                    [
                        "buildah",
                        "config",
                        "--env",
                        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "--env",
                        "LANG=C.UTF-8",
                        "--cmd",
                        "python3",
                        container,
                    ]
                )
                _run(["buildah", "commit", "--rm", container, self.base_reference])
            except BuildError:
                subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
                raise
        self.progress(f"base image {self.base_reference} in {time.monotonic() - started:.0f} s")

    def _make_pause(self, image: BuiltImage) -> None:
        container = _run(["buildah", "from", self.base_reference])
        try:
            _run(
                [
                    "buildah",
                    "config",
                    "--entrypoint",
                    '["/bin/sleep", "infinity"]',
                    "--cmd",
                    "",
                    container,
                ]
            )
            _run(["buildah", "commit", "--rm", container, image.reference])
        except BuildError:
            subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
            raise

    def _build(self, image: BuiltImage) -> None:
        started = time.monotonic()
        self.progress(f"building {image.reference} from {IMAGES[image.name]} ...")
        _run(
            [
                "buildah",
                "build",
                *RUNTIME,
                "--network",
                "host",
                "--build-arg",
                f"BASE_IMAGE={self.base_reference}",
                "-f",
                IMAGES[image.name],
                "-t",
                image.reference,
                ".",
            ],
            cwd=self.repository,
        )
        self.progress(f"{image.reference} built in {time.monotonic() - started:.0f} s")

    def _save(self, image: BuiltImage) -> None:
        image.archive.parent.mkdir(parents=True, exist_ok=True)
        partial = image.archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        _run(["buildah", "push", image.reference, f"oci-archive:{partial}:{image.reference}"])
        os.replace(partial, image.archive)
        self.progress(f"{image.reference} saved to {image.archive}")
