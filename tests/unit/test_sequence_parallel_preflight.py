"""What sequence parallelism refuses before any weight is read: a DiT class without a
context-parallel plan, and attention heads that do not divide over the SP ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlo_worker.config import ParallelOptions
from dlo_worker.errors import UserFixableError
from dlo_worker.loader.diffusers_loader import DIT_COMPONENTS
from dlo_worker.pipeline.sequence_parallel import (
    SequenceParallelError,
    check_model,
    supported_classes,
)


def test_a_dit_class_without_a_plan_is_refused_naming_it_and_those_with_one(
    demo_model_dir: Path,
) -> None:
    with pytest.raises(SequenceParallelError) as raised:
        check_model(demo_model_dir, DIT_COMPONENTS, ParallelOptions(sequence_parallel_size=2))
    message = str(raised.value)
    assert message.startswith("--sequence-parallel-size 2: DiTTransformer2DModel (transformer)")
    assert "FluxTransformer2DModel" in message
    assert "WanTransformer3DModel" in message
    assert isinstance(raised.value, UserFixableError)  # the CLI exits 2 with the message


def test_heads_must_divide_over_the_sp_ranks(flux_model_dir: Path) -> None:
    check_model(flux_model_dir, DIT_COMPONENTS, ParallelOptions(sequence_parallel_size=2))
    with pytest.raises(SequenceParallelError, match="has 2 attention heads"):
        check_model(flux_model_dir, DIT_COMPONENTS, ParallelOptions(sequence_parallel_size=4))


def test_without_sp_nothing_is_checked(demo_model_dir: Path) -> None:
    check_model(demo_model_dir, DIT_COMPONENTS, ParallelOptions())


def test_the_classes_with_a_plan_include_the_ones_users_deploy() -> None:
    classes = supported_classes()
    assert {"FluxTransformer2DModel", "WanTransformer3DModel"} <= set(classes)
    assert "DiTTransformer2DModel" not in classes
