"""``bench/flux_dlo.py`` keeps its report when one row fails: issue 61 saw the last row
(diffusers' model-level offload at 2048x2048) run out of memory on an 80 GB H100 and
lose every row measured before it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).parents[2] / "bench"


@pytest.fixture(scope="module")
def flux_dlo() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("flux_dlo", BENCH / "flux_dlo.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_a_failed_row_is_recorded_with_its_reason_and_cleaned_up(
    flux_dlo: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    cleaned: list[str] = []

    def out_of_memory() -> dict:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    row = flux_dlo.attempt("model offload 2048x2048", out_of_memory, lambda: cleaned.append("x"))
    assert row == {"failed": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert cleaned == ["x"]
    assert "# model offload 2048x2048: OutOfMemoryError" in capsys.readouterr().err
    assert flux_dlo.attempt("fine", lambda: {"step_s": 1.0}, lambda: cleaned.append("y")) == {
        "step_s": 1.0
    }
    assert cleaned == ["x"]


def test_the_report_prints_the_rows_kept_and_names_each_failed_one(
    flux_dlo: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = {
        "resident_s": 0.18,
        "resident_peak_gib": 23.0,
        "transfer_bound_s": 0.43,
        "dlo_s": 0.44,
        "dlo_peak_gib": 3.0,
        "dlo_over_resident": 2.4,
        "dlo_over_transfer_bound": 1.02,
        "dlo_over_limit": 1.02,
        "resident_back_to_back_s": 0.18,
        "dlo_back_to_back_s": 0.43,
        "dlo_back_to_back_over_limit": 1.0,
    }
    report = {
        "gpu": "H100",
        "torch": "2.11",
        "world_size": 1,
        "pinned_h2d_gbps": 53.0,
        "dlo": {
            "block_gib": 22.0,
            "host_gib": 22.0,
            "process_rss_gib": 30.0,
            "slot_gib": 0.9,
            "setup_s": 9.0,
            "achieved_h2d_gbps": 52.0,
            "exposed_wait_s_per_block": 0.0,
        },
        "results": {1024: kept, 2048: {"failed": "resident: OutOfMemoryError: x"}},
        "diffusers_model_offload": {
            1024: {"first_step_s": 1.0, "step_s": 0.2, "move_out_s": 0.5, "peak_gib": 24.0},
            2048: {"failed": "OutOfMemoryError: CUDA out of memory"},
        },
    }
    flux_dlo.print_report(report)
    printed = capsys.readouterr().out
    assert "results 2048: failed (resident: OutOfMemoryError: x)" in printed
    assert "diffusers_model_offload 2048: failed (OutOfMemoryError" in printed
    assert "1024x1024: resident 0.180 s" in printed
    assert "diffusers model-level offload, 1024x1024: step 0.200 s" in printed
