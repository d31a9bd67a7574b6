"""``serve --lora`` on the Flux demo: each request chooses its adapters and scales (raw
and OpenAI routes), bitwise equal to the resident server, also from a DP=2 AllGather
engine whose lockstep waves mix requests with different adapters; bad choices are 422
naming the field; ``GET /v1/loras`` and ``dlo_lora_adapters`` report what is loaded."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import requests

from tests.integration.test_text_to_image import images_of
from tests.support.lora import write_flux_lora
from tests.support.ports import free_port
from tests.support.serving import Server, lockstep_engine_serves, serve_command

BASE = {"prompt": "a red cat", "steps": 2, "width": 32, "height": 32, "seed": 4}
REQUESTS = {
    "default": BASE,
    "a": {**BASE, "loras": [{"name": "a"}]},
    "mix": {**BASE, "loras": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": -1.0}]},
    "none": {**BASE, "loras": []},
    "explicit default": {**BASE, "loras": [{"name": "a", "scale": 0.7}, {"name": "b"}]},
}
OPENAI = {"prompt": "a red cat", "steps": 2, "size": "32x32", "seed": 4, "loras": [{"name": "a"}]}


@pytest.fixture(scope="module")
def lora_flags(flux_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(flux_model_dir / "transformer")
    root = tmp_path_factory.mktemp("loras")
    a = write_flux_lora(transformer, root / "a", seed=1)
    b = write_flux_lora(transformer, root / "b", seed=2)
    return ["--lora", f"a={a}:0.7", "--lora", f"b={b}"]


def _send(server: Server, name: str) -> list[bytes]:
    if name == "openai":
        url = f"{server.url}/v1/images/generations"
        return images_of(requests.post(url, json=OPENAI, timeout=600))
    return images_of(server.generate(REQUESTS[name]))


@pytest.fixture(scope="module")
def resident(flux_model_dir: Path, lora_flags: list[str]) -> dict[str, list[bytes]]:
    port = free_port()
    command = [sys.executable, "-m", "dlo_worker", *serve_command(flux_model_dir, port)]
    server = Server([*command, *lora_flags], port)
    try:
        server.wait_ready()
        served = {name: _send(server, name) for name in [*REQUESTS, "openai"]}
        listed = requests.get(f"{server.url}/v1/loras", timeout=5).json()
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
        refusals = {
            problem: server.generate({**BASE, "loras": loras})
            for problem, loras in {
                "unknown": [{"name": "c"}],
                "repeated": [{"name": "a"}, {"name": "a", "scale": 2.0}],
                "scale": [{"name": "a", "scale": 11.0}],
                "shape": ["a"],
            }.items()
        }
    finally:
        output = server.stop()
    assert server.process.returncode == 0, output
    assert listed["data"] == [
        {"id": "a", "object": "lora", "fused": False, "default_scale": 0.7},
        {"id": "b", "object": "lora", "fused": False, "default_scale": 1.0},
    ]
    assert "dlo_lora_adapters 2.0" in metrics
    assert refusals["unknown"].status_code == 422
    assert "loras: c not loaded; choose from a, b" in refusals["unknown"].text
    assert "loras: a named more than once" in refusals["repeated"].text
    assert all(response.status_code == 422 for response in refusals.values())
    # A request naming no adapters runs every --lora adapter at its scale.
    assert served["default"] == served["explicit default"]
    assert served["openai"] == served["a"]  # the OpenAI route runs the same request
    distinct = {served[name][0] for name in ("default", "a", "mix", "none")}
    assert len(distinct) == 4  # each choice reached the pipeline
    return served


def test_a_request_without_adapters_matches_generate_without_lora(
    flux_model_dir: Path, resident: dict[str, list[bytes]], tmp_path: Path
) -> None:
    from tests.integration.test_generate_dlo import run_single

    out = tmp_path / "none.png"
    flags = ("--prompt", "a red cat", "--width", "32", "--height", "32")
    run_single(flux_model_dir, out, 4, *flags, "--steps", "2")
    assert resident["none"] == [out.read_bytes()]


def test_an_allgather_engine_mixes_adapters_in_lockstep_waves_bitwise(
    flux_model_dir: Path, lora_flags: list[str], resident: dict[str, list[bytes]], tmp_path: Path
) -> None:
    names = ["a", "mix", "none", "default", "openai"]
    slow = {**BASE, "steps": 300}
    served, logs = lockstep_engine_serves(
        flux_model_dir, tmp_path / "logs", slow, names, _send, *lora_flags
    )
    for name, pngs in served.items():
        assert pngs == resident[name], name
    adapters = [
        {int(wave): loras for wave, loras in re.findall(r"wave=(\d+) .*?loras=(\S+)", log)}
        for log in (logs[0], logs[1])
    ]
    mixed = [wave for wave in adapters[0] if adapters[0][wave] != adapters[1].get(wave)]
    assert mixed, adapters  # one lockstep wave ran different adapters on its two ranks
