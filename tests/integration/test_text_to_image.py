"""Text-to-image on the Flux demo: prompt, negative prompt, size, several images and the
OpenAI route, resident and under DLO (single process and a DP=2 AllGather engine), bitwise.

The reference is a resident single-process server. A DP=2 AllGather engine serves the
same requests concurrently; a slow request first lets the rest queue, so lockstep waves
group requests of different sizes and image counts (the rank logs prove it), while a
request with true CFG (an extra transformer pass per step) waits for its own wave.
"""

from __future__ import annotations

import base64
import io
import re
import sys
from pathlib import Path

import pytest
import requests
from PIL import Image

from tests.support.generate import digest, generate_command
from tests.support.in_process import run_dlo_worker
from tests.support.ports import free_port
from tests.support.serving import Server, lockstep_engine_serves, serve_command
from tests.support.serving import digest as digest_bytes

CAT = {"prompt": "a red cat", "steps": 3, "width": 64, "height": 64, "seed": 1}
REQUESTS = {
    "cat": CAT,
    "pair": {**CAT, "width": 96, "height": 48, "seed": 2, "num_images": 2},
    "negative": {**CAT, "negative_prompt": "blurry", "true_cfg_scale": 3.0},
    "dog": {**CAT, "prompt": "a blue dog"},
}
OPENAI = {"prompt": "a red cat", "size": "96x48", "n": 2, "seed": 2, "steps": 3}


def images_of(response: requests.Response) -> list[bytes]:
    """The PNGs of a ``/v1/generate`` (PNG, or JSON for several) or OpenAI response."""
    assert response.status_code == 200, response.text
    if response.headers["Content-Type"] == "image/png":
        return [response.content]
    body = response.json()
    encoded = body["images"] if "images" in body else [item["b64_json"] for item in body["data"]]
    return [base64.b64decode(text) for text in encoded]


def send(server: Server, name: str) -> list[bytes]:
    if name == "openai":
        response = requests.post(f"{server.url}/v1/images/generations", json=OPENAI, timeout=600)
    else:
        response = server.generate(REQUESTS[name])
    return images_of(response)


@pytest.fixture(scope="module")
def resident(flux_model_dir: Path) -> dict[str, list[bytes]]:
    port = free_port()
    server = Server(
        [sys.executable, "-m", "dlo_worker", *serve_command(flux_model_dir, port)], port
    )
    try:
        server.wait_ready()
        images = {name: send(server, name) for name in [*REQUESTS, "openai"]}
        refused = requests.post(
            f"{server.url}/v1/images/generations",
            json={**OPENAI, "size": "65x64"},
            timeout=60,
        )
        unsupported = server.generate({**CAT, "negative_prompt": "blurry"})
        with_label = server.generate({**CAT, "class_label": 3})
    finally:
        server.stop()
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == "width"
    assert "65 is not a multiple of 8" in refused.json()["error"]["message"]
    assert unsupported.status_code == 422
    assert "true_cfg_scale > 1" in unsupported.json()["error"]
    assert with_label.status_code == 422
    assert "takes no class_label" in with_label.json()["error"]
    return images


def test_prompt_negative_prompt_size_and_count_reach_the_pipeline(
    resident: dict[str, list[bytes]],
) -> None:
    digests = {name: [digest_bytes(png) for png in pngs] for name, pngs in resident.items()}
    assert digests["cat"] != digests["dog"]  # the prompt conditions the image
    assert digests["cat"] != digests["negative"]  # so does the negative prompt
    assert len(set(digests["pair"])) == 2
    for png in resident["pair"]:
        assert Image.open(io.BytesIO(png)).size == (96, 48)
    assert Image.open(io.BytesIO(resident["cat"][0])).size == (64, 64)
    # The OpenAI route runs the same request as the raw route: the same bytes.
    assert digests["openai"] == digests["pair"]


def test_generate_with_dlo_writes_the_served_bytes(
    flux_model_dir: Path, tmp_path: Path, resident: dict[str, list[bytes]]
) -> None:
    request = REQUESTS["negative"]
    out = tmp_path / "negative.png"
    argv = generate_command(
        flux_model_dir, out, request["seed"], "--enable-distributed-layerwise-offload"
    )
    argv[argv.index("--steps") + 1] = str(request["steps"])
    argv += ["--prompt", request["prompt"], "--negative-prompt", request["negative_prompt"]]
    argv += ["--true-cfg-scale", "3", "--width", "64", "--height", "64", "--num-images", "2"]
    result = run_dlo_worker(argv)
    assert result.returncode == 0, result.stderr
    assert "dlo stats" in result.stderr
    assert digest(out) != digest(tmp_path / "negative-1.png")
    single = run_dlo_worker(
        [*argv[: argv.index("--num-images")], "--out", str(tmp_path / "one.png")]
    )
    assert single.returncode == 0, single.stderr
    assert digest(tmp_path / "one.png") == digest_bytes(resident["negative"][0])


def waves_by_rank(log: str) -> dict[int, tuple[str, str, bool]]:
    """wave number -> (width, num_images, discarded) from one rank's ``request done`` lines."""
    waves = {}
    for line in log.splitlines():
        if 'msg="request done"' in line:
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            waves[int(fields["wave"])] = (
                fields["width"],
                fields["num_images"],
                fields["discarded"] == "True",
            )
    return waves


def test_an_allgather_engine_groups_mixed_sizes_in_lockstep_and_matches_resident_bytes(
    flux_model_dir: Path, tmp_path: Path, resident: dict[str, list[bytes]]
) -> None:
    # Arrival order fixed: cat and pair share a wave (mixed sizes), negative (true CFG)
    # runs alone, then openai and dog share one (mixed sizes again).
    names = ["cat", "pair", "negative", "openai", "dog"]
    slow = {**CAT, "steps": 400}
    served, logs = lockstep_engine_serves(flux_model_dir, tmp_path / "logs", slow, names, send)
    for name, pngs in served.items():
        assert pngs == resident[name], name
    leader, follower = waves_by_rank(logs[0]), waves_by_rank(logs[1])
    assert leader.keys() == follower.keys()
    mixed = [
        number
        for number in leader
        if not leader[number][2]
        and not follower[number][2]
        and leader[number][:2] != follower[number][:2]
    ]
    assert mixed, (leader, follower)  # one lockstep wave ran different sizes or counts
