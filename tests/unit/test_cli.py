"""The dlo-worker command line: flags map onto the configuration; errors are one line, exit 2."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlo_worker.cli.main import build_parser, main
from dlo_worker.config import (
    NEGATIVE_FLAGS,
    ModelOptions,
    OffloadOptions,
    ParallelOptions,
    WorkerConfig,
)

DESIGN_DOC_FLAGS = [
    "--enable-distributed-layerwise-offload",
    "--dlo-no-use-allgather",
    "--dlo-resident-layers",
    "--dlo-enable-runtime-cache",
    "--dlo-runtime-cache-root",
    "--dlo-runtime-cache-lock-timeout",
    "--dlo-runtime-cache-pin-limit-gib",
    "--data-parallel-size",
    "--sequence-parallel-size",
    "--tensor-parallel-size",
    "--use-hsdp",
    "--quantization",
]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def option_strings(subcommand: str) -> set[str]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return {
        flag for action in subparsers.choices[subcommand]._actions for flag in action.option_strings
    }


@pytest.mark.parametrize("subcommand", ["config", "generate", "serve"])
def test_every_config_field_has_exactly_its_flag(subcommand: str) -> None:
    flags = option_strings(subcommand)
    for model in (ModelOptions, ParallelOptions, OffloadOptions):
        for name in model.model_fields:
            assert "--" + name.replace("_", "-") in flags
            if name in NEGATIVE_FLAGS:
                assert NEGATIVE_FLAGS[name] in flags
    assert set(DESIGN_DOC_FLAGS) <= flags


def test_config_prints_effective_configuration_as_json(capsys) -> None:
    code, out, _ = run(
        capsys,
        "config",
        "--enable-distributed-layerwise-offload",
        "--data-parallel-size",
        "2",
        "--sequence-parallel-size",
        "2",
    )
    assert code == 0
    report = json.loads(out)
    assert report["config"]["parallel"]["data_parallel_size"] == 2
    assert report["effective"]["dlo_sharding_group"] == "data-parallel"
    assert report["effective"]["dlo_sharding_size"] == 2
    assert report["effective"]["transfer_mode"] == "allgather"
    assert report["effective"]["host_backing_candidates"] == ["checkpoint-mmap", "ordinary"]


def test_no_allgather_flag_forces_sharding_size_one(capsys) -> None:
    code, out, _ = run(
        capsys,
        "config",
        "--enable-distributed-layerwise-offload",
        "--dlo-no-use-allgather",
        "--data-parallel-size",
        "4",
        "--dlo-resident-layers",
        "2",
    )
    effective = json.loads(out)["effective"]
    assert code == 0
    assert (effective["dlo_sharding_size"], effective["transfer_mode"]) == (1, "rank-local")
    assert effective["dlo_resident_layers"] == 2


def test_invalid_combination_exits_2_with_one_line(capsys) -> None:
    code, out, err = run(
        capsys,
        "config",
        "--enable-distributed-layerwise-offload",
        "--use-hsdp",
        "--sequence-parallel-size",
        "2",
    )
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("dlo-worker config: error: --use-hsdp")
    assert "--dlo-no-use-allgather" in lines[0]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--dlo-runtime-cache-lock-timeout", "nan"], "--dlo-runtime-cache-lock-timeout"),
        (["--data-parallel-size", "two"], "--data-parallel-size"),
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--dtype", "float8"], "--dtype"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_flag(capsys, argv, named) -> None:
    code, _, err = run(capsys, "config", "--enable-distributed-layerwise-offload", *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert named in err


def test_dlo_takes_priority_warning_is_logged(capsys) -> None:
    code, out, err = run(
        capsys, "config", "--enable-distributed-layerwise-offload", "--enable-cpu-offload"
    )
    assert code == 0
    assert json.loads(out)["effective"]["offload_policy"] == "dlo"
    assert "level=warning" in err
    assert "--enable-cpu-offload is disabled" in err


def test_generate_requires_model(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "generate", "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert "--model is required" in err


def test_generate_rejects_missing_model_directory(capsys, tmp_path) -> None:
    missing = tmp_path / "nowhere"
    code, _, err = run(
        capsys, "generate", "--model", str(missing), "--out", str(tmp_path / "x.png")
    )
    assert code == 2
    assert f"--model {missing}: no such directory" in err
    assert "dlo-worker demo-model" in err


def test_generate_rejects_a_directory_without_model_index(capsys, tmp_path) -> None:
    code, _, err = run(
        capsys, "generate", "--model", str(tmp_path), "--out", str(tmp_path / "x.png")
    )
    assert code == 2
    assert "no model_index.json" in err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--steps", "0"], "--steps"),
        (["--guidance-scale", "inf"], "--guidance-scale"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_generate_rejects_bad_request_values(capsys, tmp_path, argv, named) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--out", "x.png", *argv)
    assert code == 2
    assert named in err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--port", "70000"], "--port: must be a TCP port"),
        (["--max-queued-requests", "0"], "--max-queued-requests: must be at least 1"),
        (["--enable-cpu-offload", "--device", "cpu"], "--enable-cpu-offload moves weights"),
        (["--enable-layerwise-offload", "--device", "cpu"], "and --device is cpu"),
        (
            ["--sequence-parallel-size", "2"],
            "DiTTransformer2DModel (transformer) has no context-parallel plan",
        ),
        (
            ["--sequence-parallel-size", "2", "--enable-cpu-offload", "--device", "cuda"],
            "diffusers' offload modes are not run under sequence parallelism",
        ),
        (
            ["--quantization", "int8"],
            "--quantization int8 is not executed by this worker release",
        ),
        (
            ["--quantization", "fp8", "--enable-layerwise-offload", "--device", "cuda"],
            "--quantization fp8 is not run under diffusers' offload modes",
        ),
        (["--tensor-parallel-size", "2"], "tensor parallelism needs"),
        (
            ["--sequence-parallel-size", "2", "--use-hsdp"],
            "--use-hsdp: HSDP needs each DiT wrapped in FSDP2",
        ),
    ],
)
def test_serve_rejects_bad_options_before_loading(capsys, demo_model_dir, argv, named) -> None:
    code, _, err = run(capsys, "serve", "--model", str(demo_model_dir), *argv)
    assert code == 2
    assert named in err


def test_serve_reports_a_port_in_use(capsys, demo_model_dir) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run(
            capsys,
            "serve",
            "--model",
            str(demo_model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
        )
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err
    assert "choose another --port" in err


def test_invalid_combination_fails_before_torch_is_imported(tmp_path) -> None:
    probe = (
        "import sys\n"
        "from dlo_worker.cli.main import main\n"
        "code = main(['generate', '--model', sys.argv[1], '--out', 'x.png',\n"
        "             '--enable-distributed-layerwise-offload', '--dlo-resident-layers', '1'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported before validation'\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2, result.stderr
    assert "--dlo-resident-layers requires --dlo-no-use-allgather" in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--default-steps", "1001"], "--default-steps: Input should be less than or equal"),
        (["--default-width", "9000"], "--default-width: Input should be less than or equal"),
        (["--api-key", ""], "--api-key (or $DLO_API_KEY) is empty"),
    ],
)
def test_serve_flags_that_need_no_model_fail_before_torch_is_imported(
    flags: list[str], message: str, demo_model_dir: Path
) -> None:
    """Issue 61: these were refused only after the model directory was checked (torch and
    diffusers imported, seconds)."""
    probe = (
        "import sys\n"
        "from dlo_worker.cli.main import main\n"
        "code = main(['serve', '--model', sys.argv[1], '--device', 'cpu', *sys.argv[2:]])\n"
        "assert 'torch' not in sys.modules, 'torch was imported before validation'\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(demo_model_dir), *flags],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_console_script_reports_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dlo_worker", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.startswith("dlo-worker ")


def test_configuration_doc_lists_every_option_and_its_flag() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for model in (ModelOptions, ParallelOptions, OffloadOptions):
        for name in model.model_fields:
            assert f"| `{name}` | `--{name.replace('_', '-')}`" in doc, name


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--enable-distributed-layerwise-offload", "--data-parallel-size", "4"],
        [
            "--enable-distributed-layerwise-offload",
            "--dlo-no-use-allgather",
            "--dlo-resident-layers",
            "2",
            "--dlo-enable-runtime-cache",
            "--dlo-runtime-cache-root",
            "/var/cache/x",
            "--dlo-runtime-cache-lock-timeout",
            "30.5",
            "--dlo-runtime-cache-pin-limit-gib",
            "12",
            "--tensor-parallel-size",
            "2",
            "--dlo-block-paths",
            "transformer_blocks,single_transformer_blocks",
        ],
        [
            "--model",
            "/models/m",
            "--dtype",
            "bfloat16",
            "--device",
            "cuda",
            "--quantization",
            "fp8",
            "--enable-distributed-layerwise-offload",
            "--sequence-parallel-size",
            "2",
        ],
        [
            "--use-hsdp",
            "--sequence-parallel-size",
            "4",
            "--hsdp-replicate-size",
            "2",
            "--enable-distributed-layerwise-offload",
            "--dlo-no-use-allgather",
        ],
        # Repeated and comma-separated both add adapters.
        ["--lora", "a=/loras/a:0.5", "--lora", "b=/loras/b.safetensors,c=/x:y/c:-1"],
    ],
)
def test_to_flags_is_the_inverse_of_parsing(capsys, argv: list[str]) -> None:
    from dlo_worker.config import to_flags

    code, out, _ = run(capsys, "config", *argv)
    assert code == 0
    config = WorkerConfig.model_validate(json.loads(out)["config"])
    code, again, _ = run(capsys, "config", *to_flags(config))
    assert code == 0
    assert json.loads(again)["config"] == json.loads(out)["config"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="--device auto resolves to the CPU only here")
@pytest.mark.parametrize("flag", ["--enable-cpu-offload", "--enable-layerwise-offload"])
def test_a_diffusers_offload_mode_on_an_automatic_cpu_device_is_refused_before_loading(
    capsys, demo_model_dir, tmp_path, flag: str
) -> None:
    out = tmp_path / "x.png"
    code, _, err = run(capsys, "generate", "--model", str(demo_model_dir), "--out", str(out), flag)
    assert code == 2
    assert (
        f"{flag} moves weights between host memory and a CUDA device, and the device is cpu" in err
    )
    assert not out.exists()


def test_the_error_line_is_the_containers_termination_message(
    capsys, tmp_path, monkeypatch
) -> None:
    """A start-up failure was visible only in the logs of Pods deleted seconds later; the
    kubelet shows this file's text as the terminated container's message."""
    termination_log = tmp_path / "termination-log"
    termination_log.touch()  # the kubelet provides the file in a container
    monkeypatch.setenv("DLO_TERMINATION_LOG", str(termination_log))
    code, _, err = run(capsys, "serve", "--model", str(tmp_path))
    assert code == 2
    (line,) = err.strip().splitlines()
    assert termination_log.read_text() == line + "\n"
    assert "not a diffusers pipeline directory" in line


def test_lora_adapters_parse_from_the_flag(capsys) -> None:
    code, out, _ = run(capsys, "config", "--lora", "a=/loras/a:0.5", "--lora", "b=/x:y/b")
    assert code == 0
    config = WorkerConfig.model_validate(json.loads(out)["config"])
    assert [(a.name, str(a.path), a.scale) for a in config.model.lora_adapters] == [
        ("a", "/loras/a", 0.5),
        ("b", "/x:y/b", 1.0),  # a colon inside the path, no scale
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a", "--lora expects NAME=PATH[:SCALE], got 'a'"),
        ("a b=/p", "the name must be 1-64 letters"),
        # diffusers keeps an adapter's layers under module names that a '.' would split.
        ("a.b=/p", "the name must be 1-64 letters, digits, '_' or '-'"),
        ("a=", "--lora expects NAME=PATH[:SCALE]"),
        ("a=:0.5", "give the adapter's file or directory after '='"),
        ("a=/p:inf", "the scale must be a number from -10 to 10"),
        ("a=/p,a=/q", "--lora names a more than once; one each"),
    ],
)
def test_bad_lora_values_exit_2_naming_the_flag(capsys, value: str, message: str) -> None:
    code, _, err = run(capsys, "config", "--lora", value)
    assert code == 2
    assert message in err
