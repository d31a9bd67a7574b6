"""``serve --lora`` on the Flux demo: each request chooses its adapters and scales (raw
and OpenAI routes), bitwise equal to the resident server, also from a DP=2 AllGather
engine whose lockstep waves mix requests with different adapters; bad choices are 422
naming the field; ``GET /v1/loras`` and ``dlo_lora_adapters`` report what is loaded.

``serve --lora-load-dir``: adapters loaded and unloaded while a DP=2 AllGather engine
serves, behind the API key. Every rank makes each change between the same two waves (the
rank logs prove it), images equal the resident server that loaded them at start, a bad
file is 400 naming it and leaves nothing loaded, and an unload waits for the requests
queued before it while new requests stop naming the adapter at once."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.integration.test_text_to_image import images_of
from tests.support.in_process import run_dlo_worker
from tests.support.launch import rank_logs, torchrun_command
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


KEY = {"Authorization": "Bearer s3cret"}
DLO = ("--enable-distributed-layerwise-offload", "--data-parallel-size", "2")


@pytest.fixture(scope="module")
def load_dir(
    flux_model_dir: Path, lora_flags: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Adapter ``b`` of the resident server's (a directory), a truncated file, and an
    adapter of rank 8."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("load-dir")
    transformer = FluxTransformer2DModel.from_pretrained(flux_model_dir / "transformer")
    write_flux_lora(transformer, root / "rank8", seed=9, rank=8)
    b = Path(lora_flags[3].removeprefix("b="))
    (root / "b").mkdir()
    (root / "b" / "pytorch_lora_weights.safetensors").write_bytes(
        (b / "pytorch_lora_weights.safetensors").read_bytes()
    )
    weights = (root / "b" / "pytorch_lora_weights.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(weights[:300])
    return root


def _change(server: Server, action: str, body: dict, headers: dict = KEY) -> requests.Response:
    return requests.post(
        f"{server.url}/v1/{action}_lora_adapter", json=body, headers=headers, timeout=600
    )


def _generate(server: Server, body: dict) -> requests.Response:
    return requests.post(f"{server.url}/v1/generate", json=body, headers=KEY, timeout=600)


def test_an_allgather_engine_loads_and_unloads_adapters_on_every_rank_between_waves(
    flux_model_dir: Path,
    lora_flags: list[str],
    load_dir: Path,
    resident: dict[str, list[bytes]],
    tmp_path: Path,
) -> None:
    port = free_port()
    flags = (*DLO, *lora_flags[:2], "--lora-load-dir", str(load_dir), "--api-key", "s3cret")
    flags = (*flags, "--max-lora-rank", "4")
    server = Server(torchrun_command(serve_command(flux_model_dir, port, *flags), tmp_path), port)
    try:
        server.wait_ready()
        unauthorized = _change(server, "load", {"lora_name": "b", "lora_path": "b"}, headers={})
        loaded = _change(server, "load", {"lora_name": "b", "lora_path": "b"})
        refused = {
            name: _change(server, "load", body)
            for name, body in {
                "again": {"lora_name": "b", "lora_path": "b"},
                "outside": {"lora_name": "c", "lora_path": "../b"},
                "missing": {"lora_name": "c", "lora_path": "nowhere"},
                "truncated": {"lora_name": "c", "lora_path": "truncated.safetensors"},
                "bad name": {"lora_name": "c d", "lora_path": "b"},
                "rank": {"lora_name": "c", "lora_path": "rank8"},
            }.items()
        }
        served = {
            name: images_of(_generate(server, REQUESTS[name]))
            for name in ("a", "mix", "none", "explicit default")
        }
        a_alone = images_of(_generate(server, {**BASE, "loras": [{"name": "a", "scale": 0.7}]}))
        listed = requests.get(f"{server.url}/v1/loras", headers=KEY, timeout=5).json()["data"]
        # An unload queued behind a request that runs b waits for it; a request sent after
        # the unload was queued cannot name b any more.
        slow = {**BASE, "steps": 200, "loras": [{"name": "b"}]}
        outcomes: dict[str, requests.Response] = {}
        holder = threading.Thread(target=lambda: outcomes.update(slow=_generate(server, slow)))
        holder.start()
        time.sleep(1)
        unloader = threading.Thread(
            target=lambda: outcomes.update(unload=_change(server, "unload", {"lora_name": "b"}))
        )
        unloader.start()
        time.sleep(0.5)
        late = _generate(server, REQUESTS["mix"])
        assert holder.is_alive(), "the slow request ended before the unload was queued"
        for thread in (holder, unloader):
            thread.join(timeout=300)
        unknown = _change(server, "unload", {"lora_name": "b"})
        after = requests.get(f"{server.url}/v1/loras", headers=KEY, timeout=5).json()["data"]
        default = images_of(_generate(server, {**BASE}))
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    finally:
        output = server.stop()  # torchrun exits 1 on SIGTERM; the ranks' logs say they drained
    assert unauthorized.status_code == 401, output
    assert loaded.status_code == 200, loaded.text
    assert refused["again"].status_code == 409
    assert "lora_name: b is already loaded" in refused["again"].text
    assert "lora_path: ../b is outside --lora-load-dir" in refused["outside"].text
    assert "lora_path: nowhere does not exist" in refused["missing"].text
    assert "lora_path " in refused["truncated"].text
    assert "truncated.safetensors: cannot load it (" in refused["truncated"].text
    assert refused["bad name"].status_code == 422
    assert "its rank is 8, above --max-lora-rank 4" in refused["rank"].text
    # Named as the route's field, not as a --lora flag (issue 61).
    assert refused["rank"].json()["error"].startswith("lora_path ")
    failed = ("outside", "missing", "truncated", "rank")
    assert all(refused[name].status_code == 400 for name in failed)
    for name, pngs in served.items():
        assert pngs == resident[name], name
    assert listed == [
        {"id": "a", "object": "lora", "fused": False, "default_scale": 0.7},
        {"id": "b", "object": "lora", "fused": False, "default_scale": None},
    ]
    assert outcomes["slow"].status_code == 200
    assert outcomes["unload"].status_code == 200, outcomes["unload"].text
    assert late.status_code == 422
    assert "loras: b not loaded; choose from a" in late.text
    assert unknown.status_code == 404
    assert [entry["id"] for entry in after] == ["a"]
    assert default == a_alone  # a request naming none runs the --lora adapter alone now
    assert "dlo_lora_adapters 1.0" in metrics
    assert 'dlo_lora_changes_total{action="load",outcome="ok"} 1.0' in metrics
    assert 'dlo_lora_changes_total{action="load",outcome="failed"} 2.0' in metrics
    assert 'dlo_lora_changes_total{action="unload",outcome="ok"} 1.0' in metrics
    logs = rank_logs(tmp_path)
    for rank in (0, 1):  # every rank made each change, between the same waves
        log = logs[rank]
        assert log.count('msg="lora adapter loaded" name=b') == 1, log
        assert log.count('msg="lora adapter unloaded" name=b') == 1, log
        assert 'msg="lora adapter loaded" name=c' not in log
        assert 'msg="engine drained"' in log
        # Loading beside another adapter is normal: neither diffusers nor PEFT warns of it.
        assert "missing keys" not in log, log
        assert "peft_config" not in log, log


def test_compiled_blocks_switch_adapters_and_scales_without_recompiling(
    flux_model_dir: Path, lora_flags: list[str], tmp_path: Path
) -> None:
    """Rank-local DLO with --compile: requests choosing other adapters and scales reuse
    the compiled graphs (no recompile), a choice draws the same bytes whenever it comes,
    and they are the resident compiled worker's."""
    from tests.integration.test_generate_dlo import run_single

    port = free_port()
    flags = (*DLO[:1], "--dlo-no-use-allgather", "--compile", *lora_flags)
    server = Server(
        [sys.executable, "-m", "dlo_worker", *serve_command(flux_model_dir, port, *flags)], port
    )
    order = ["a", "mix", "none", "explicit default", "a"]
    try:
        server.wait_ready()
        served = [images_of(server.generate(REQUESTS[name])) for name in order]
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    finally:
        output = server.stop()
    assert server.process.returncode == 0, output
    assert served[0] == served[-1]  # the same choice, after three others
    assert len({pngs[0] for pngs in served}) == 4  # each choice reached the graphs
    assert "dlo_compile_recompiles 0.0" in metrics, metrics
    assert re.search(r"dlo_compiled_blocks [1-9]", metrics)
    out = tmp_path / "mix.png"
    generate_flags = ("--prompt", "a red cat", "--width", "32", "--height", "32", "--steps", "2")
    mix = ("--use-lora", "a:0.5", "--use-lora", "b:-1")
    run_single(flux_model_dir, out, 4, *generate_flags, "--compile", *lora_flags, *mix)
    assert served[1] == [out.read_bytes()]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ((), "--lora-load-dir needs --api-key"),
        (("--api-key", "k", "--compile"), "--lora-load-dir with --compile is not run"),
        (
            ("--api-key", "k", "--dlo-no-use-allgather", "--dlo-gpu-memory-budget-gib", "1"),
            "--lora-load-dir with --dlo-gpu-memory-budget-gib",
        ),
    ],
)
def test_lora_loading_that_cannot_run_exits_2_before_loading(
    flags: tuple[str, ...], message: str, flux_model_dir: Path, tmp_path: Path
) -> None:
    command = serve_command(
        flux_model_dir,
        free_port(),
        "--enable-distributed-layerwise-offload",
        "--lora-load-dir",
        str(tmp_path),
        *flags,
    )
    result = run_dlo_worker(command)  # refused before it serves: in this process
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
