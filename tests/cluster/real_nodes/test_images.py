"""The worker and operator images, built for real from docker/*.Dockerfile with buildah on
a locally made Debian base, run what the operator renders: as user 65532, with their
entrypoints, and the worker image generates the same bytes as ``dlo-worker`` on the host."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.images import RUNTIME, BuiltImage, ImageBuilder, missing_host_tools
from tests.support.generate import HostReference, demo_flags, digest
from tests.support.serving import digest as digest_bytes

WORKER_UID = 65532


@pytest.fixture(scope="session")
def images() -> dict[str, BuiltImage]:
    missing = missing_host_tools()
    if missing and os.geteuid() != 0:
        pytest.skip(f"building images needs root or these packages installed: {missing}")
    builder = ImageBuilder()
    if unbuilt := builder.missing():
        pytest.fail(
            f"images {', '.join(unbuilt)} not built: run `python -m tests.cluster images` "
            "first (the test command does)",
            pytrace=False,
        )
    return builder.expected()


@pytest.fixture
def container(images: dict[str, BuiltImage], request) -> Iterator[str]:
    """A working container of the image named by the test's parameter."""
    name = request.param
    created = subprocess.run(
        ["buildah", "from", images[name].reference], capture_output=True, text=True, check=True
    ).stdout.strip()
    yield created
    subprocess.run(["buildah", "rm", created], capture_output=True, check=False)


def image_config(reference: str) -> dict:
    inspected = subprocess.run(
        ["buildah", "inspect", "--type", "image", reference],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(inspected)["OCIv1"]["config"]


def run_in(container: str, *command: str, volume: Path | None = None) -> str:
    mount = ["--volume", f"{volume}:/data"] if volume is not None else []
    result = subprocess.run(
        ["buildah", "run", *RUNTIME, *mount, container, "--", *command],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_each_image_runs_as_the_user_the_operator_renders(images) -> None:
    worker = image_config(images["worker"].reference)
    operator = image_config(images["operator"].reference)
    assert worker["User"] == operator["User"] == f"{WORKER_UID}:{WORKER_UID}"
    assert worker["Entrypoint"] == ["dlo-worker", "serve"]
    assert operator["Entrypoint"] == ["dlo-operator"]
    assert "HOME=/home/dlo" in worker["Env"]


@pytest.mark.parametrize("container", ["operator"], indirect=True)
def test_the_operator_image_starts_its_entrypoint(container: str) -> None:
    assert run_in(container, "id", "-u").strip() == str(WORKER_UID)
    assert "--namespace" in run_in(container, "dlo-operator", "--help")
    # kopf names the operator after its user: the uid needs a passwd entry.
    getuser = "import getpass; print(getpass.getuser())"
    assert run_in(container, "env", "-u", "USER", "python3", "-c", getuser).strip() == "dlo"


@pytest.mark.parametrize("container", ["worker"], indirect=True)
def test_the_worker_image_carries_the_native_staging_ring(container: str) -> None:
    """Built in the Dockerfile's build stage, into the wheel the runtime stage installs."""
    locate = "from dlo_worker.native import staging_ring_library; print(staging_ring_library())"
    library = run_in(container, "python3", "-c", locate).strip()
    assert library.startswith("/usr/")
    assert "_staging_ring" in library
    assert library.endswith(".so")
    load = "from dlo_worker.offload.feeds.ring import load_library; load_library(); print('ok')"
    assert run_in(container, "python3", "-c", load).strip() == "ok"
    effective = json.loads(
        run_in(container, "dlo-worker", "config", "--enable-distributed-layerwise-offload")
    )["effective"]
    assert effective["dlo_staging"] == "ring"


@pytest.mark.parametrize("container", ["worker"], indirect=True)
@pytest.mark.parametrize("flags", [[], ["--compile"]], ids=["eager", "compiled"])
def test_the_worker_image_generates_the_hosts_bytes(
    container: str, tmp_path: Path, flags: list[str], host: HostReference
) -> None:
    """The image's torch and diffusers produce the same PNG as the host's for the demo.
    ``--compile`` builds kernels while the worker runs (inductor's C++ on the CPU, Triton's
    launcher on a GPU): the image carries their compiler and Python headers."""
    tmp_path.chmod(0o777)  # the image's user writes here
    run_in(container, "dlo-worker", "demo-model", "/data/model", volume=tmp_path)
    run_in(
        container,
        "dlo-worker",
        "generate",
        "--model",
        "/data/model",
        *demo_flags(),
        *flags,
        "--out",
        "/data/image.png",
        volume=tmp_path,
    )
    # the host's own demo model: the image's demo-model writes the same
    assert digest(tmp_path / "image.png") == digest_bytes(host.png(*flags))
