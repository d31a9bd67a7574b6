"""DLO's lifecycle on the CPU: no silent no-ops, the order blocks really run, all-or-nothing
enable, refused conflicts, repeatable enable/disable, and errors inside blocks."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from torch import nn

from dlo_worker.errors import UserFixableError
from dlo_worker.offload import (
    BackendState,
    DiscoveryError,
    DistributedLayerwiseOffloadBackend,
    OffloadConfig,
    OffloadSetupError,
    enable_dlo,
    ownership,
)
from dlo_worker.offload.feeds.staging import Packer
from dlo_worker.offload.ownership import MARK
from dlo_worker.offload.setup import StreamSetup
from dlo_worker.offload.slots import SlotPair
from tests.support.equivalence import run_equivalence
from tests.support.tiny_models import interleaved_stack, plain_stack, tiny_flux

CPU = torch.device("cpu")


def _hooks_left(model: nn.Module) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if module._forward_hooks or module._forward_pre_hooks
    ]


def _pack_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dlo-pack")]


def test_empty_block_lists_are_an_error_naming_the_dit_and_the_fix() -> None:
    case = tiny_flux(double_blocks=0, single_blocks=0)
    with pytest.raises(DiscoveryError, match=r"FluxTransformer2DModel.*empty.*block_paths"):
        enable_dlo(case.model, device=CPU)
    assert _hooks_left(case.model) == []


def test_parameter_free_lists_are_not_blocks() -> None:
    class OnlyActivations(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.activations = nn.ModuleList(nn.GELU() for _ in range(3))

    with pytest.raises(DiscoveryError, match=r"no homogeneous nn.ModuleList child holding weights"):
        enable_dlo(OnlyActivations(), device=CPU)
    with pytest.raises(DiscoveryError, match="hold no parameters"):
        enable_dlo(OnlyActivations(), device=CPU, block_paths=["activations"])
    # Beside real blocks, the activations are ignored.
    backend = enable_dlo(interleaved_stack().model, device=CPU)
    assert {dit.block_paths for dit in backend.plan.dits} == {("spatial", "temporal")}
    backend.disable()


def test_errors_a_user_can_fix_share_one_base_class() -> None:
    assert issubclass(DiscoveryError, UserFixableError)
    assert issubclass(OffloadSetupError, UserFixableError)


def test_an_interleaved_forward_is_prefetched_after_the_first_forward() -> None:
    result = run_equivalence("interleaved", CPU, forwards=1)
    first_forward_loads = result.stats.on_demand_loads
    assert first_forward_loads > 0  # attribute order was only a guess
    result = run_equivalence("interleaved", CPU, forwards=4)
    assert result.bitwise_equal
    assert result.stats.on_demand_loads == first_forward_loads  # none after the first
    assert result.stats.order_changes == 1


def _non_block_and_block_bytes(model: nn.Module) -> tuple[int, int]:
    block = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    layer_ids = {id(p) for layer in model.layers for p in layer.parameters()}
    non_block = sum(
        t.numel() * t.element_size()
        for t in [*model.parameters(), *model.buffers()]
        if id(t) not in layer_ids
    )
    return non_block, block


@pytest.mark.parametrize("keeping_resident", [False, True], ids=["all-streamed", "budget"])
def test_the_next_forward_is_prefetched_only_where_every_block_streams(
    keeping_resident: bool,
) -> None:
    """All streamed, the last blocks of a forward load the first two of the next (the
    step is bound by its copies; back to back the copy engine must not idle between
    forwards). With resident blocks (a budget for three of six equal blocks keeps blocks
    0, 1 and 4), each forward loads only its own blocks, the first as it starts: a step
    synchronized afterwards leaves no copy of the next in flight and pays for its own.
    No block is ever loaded on demand."""
    case = plain_stack(blocks=6)
    budget: dict[str, float] = {}
    if keeping_resident:
        non_block, block = _non_block_and_block_bytes(case.model)
        budget["gpu_memory_budget_gib"] = (non_block + 5 * block) / 2**30
    backend = enable_dlo(case.model, device=CPU, **budget)
    try:
        streamed = backend.stats().streamed_blocks
        assert streamed == (3 if keeping_resident else 6)
        assert backend.stats().blocks_loaded == 1  # the first streamed block, at enable
        for forwards in range(1, 4):
            case.forward()
            stats = backend.stats()
            ahead = 0 if keeping_resident else 2
            assert stats.blocks_loaded == forwards * streamed + ahead
            assert stats.on_demand_loads == 0
    finally:
        backend.disable()


def test_a_nested_block_list_streams_in_execution_order() -> None:
    """HunyuanVideo's token refiner blocks (a nested list) run before the main lists."""
    result = run_equivalence("hunyuan-video", CPU)
    assert result.bitwise_equal
    assert result.stats.streamed_blocks == 6
    assert result.stats.on_demand_loads == 0


STAGES = [
    (ownership, "check_parameters_are_not_shared"),
    (StreamSetup, "fill_host"),
    (SlotPair, "__init__"),
    (SlotPair, "load"),
]
"""Steps of enable, in order: after the mark, after the packer, after host memory, after
the hooks were installed (priming the first block)."""


@pytest.mark.parametrize(("owner", "step"), STAGES, ids=[step for _, step in STAGES])
def test_a_failed_enable_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, owner: object, step: str
) -> None:
    """Fault injection at one step boundary; everything acquired before it is released."""
    case = plain_stack(blocks=4)

    def fail(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(f"injected failure in {step}")

    monkeypatch.setattr(owner, step, fail)
    backend = DistributedLayerwiseOffloadBackend(OffloadConfig(use_allgather=False), CPU)
    with pytest.raises(RuntimeError, match="injected failure"):
        backend.enable(case.model)
    assert backend.state == BackendState.DISABLED
    assert _hooks_left(case.model) == []
    assert _pack_threads() == []
    assert not hasattr(case.model, MARK)
    assert backend.stats().host_bytes == backend.stats().device_slot_bytes == 0


def test_a_second_enable_and_foreign_offload_hooks_are_refused() -> None:
    case = plain_stack(blocks=3)
    backend = enable_dlo(case.model, device=CPU)
    with pytest.raises(OffloadSetupError, match="already streamed by another DLO backend"):
        enable_dlo(case.model, device=CPU)
    with pytest.raises(OffloadSetupError, match="already enabled on this backend"):
        backend.enable(case.model)
    backend.disable()

    from diffusers.hooks import apply_group_offloading

    grouped = plain_stack(blocks=3).model
    apply_group_offloading(
        grouped, onload_device=CPU, offload_type="block_level", num_blocks_per_group=1
    )
    with pytest.raises(OffloadSetupError, match="diffusers hooks"):
        enable_dlo(grouped, device=CPU)

    from accelerate.hooks import ModelHook, add_hook_to_module

    hooked = plain_stack(blocks=3).model
    add_hook_to_module(hooked.layers[1], ModelHook())
    with pytest.raises(OffloadSetupError, match=r"model.layers.1 carries accelerate hooks"):
        enable_dlo(hooked, device=CPU)


def _counts(stats: object) -> dict:
    timings = {"exposed_wait_seconds", "exposed_wait_seconds_per_block", "h2d_seconds", "h2d_gbps"}
    return {k: v for k, v in dataclasses.asdict(stats).items() if k not in timings}


def test_enable_disable_twice_gives_the_stats_of_once() -> None:
    original = interleaved_stack()
    models = [copy.deepcopy(original.model) for _ in range(2)]
    backend = DistributedLayerwiseOffloadBackend(OffloadConfig(use_allgather=False), CPU)
    counts = []
    for model in models:
        backend.enable(model)
        with torch.inference_mode():
            for _ in range(3):
                model(**original.inputs)
        counts.append(_counts(backend.stats()))
        backend.disable()
        assert backend.state == BackendState.DISABLED
        assert _hooks_left(model) == []
    assert counts[0] == counts[1]
    # The disabled model holds placeholders only: enabling it again would stream nothing.
    with pytest.raises(OffloadSetupError, match="would stream no weights"):
        backend.enable(models[0])


def test_an_exception_inside_a_block_leaves_the_backend_usable() -> None:
    case = interleaved_stack()
    resident = copy.deepcopy(case.model)
    backend = enable_dlo(case.model, device=CPU)
    case.model.fail_at = 1
    with torch.inference_mode(), pytest.raises(RuntimeError, match="block 1 failed"):
        case.model(**case.inputs)
    case.model.fail_at = None
    with torch.inference_mode():
        expected = resident(**case.inputs)
        for _ in range(2):
            assert torch.equal(case.model(**case.inputs), expected)
    # Back on their placeholders (one element each), none left in a slot.
    assert all(
        p.untyped_storage().nbytes() == p.element_size()
        for block in case.model.spatial
        for p in block.parameters()
    )
    backend.disable()


def test_packer_threads_end_with_disable() -> None:
    backend = enable_dlo(plain_stack(blocks=3).model, device=CPU)
    assert backend._enabled is not None
    assert isinstance(backend._enabled.packer, Packer)
    backend.disable()
    assert _pack_threads() == []


def test_a_gpu_memory_budget_keeps_as_many_blocks_resident_as_fit() -> None:
    """Budget = non-block weights + two slots + three of the six equal blocks."""
    case = plain_stack(blocks=6)
    non_block, block = _non_block_and_block_bytes(case.model)
    budget_gib = (non_block + 2 * block + 3 * block) / 2**30
    resident = copy.deepcopy(case.model)
    backend = enable_dlo(case.model, device=CPU, gpu_memory_budget_gib=budget_gib)
    with torch.inference_mode():
        assert torch.equal(case.model(**case.inputs), resident(**case.inputs))
    stats = backend.stats()
    backend.disable()
    assert (stats.resident_blocks, stats.streamed_blocks) == (3, 3)
    with pytest.raises(OffloadSetupError, match="raise it to at least"):
        enable_dlo(plain_stack(blocks=6).model, device=CPU, gpu_memory_budget_gib=1e-6)


def test_a_profiler_trace_names_each_blocks_streaming() -> None:
    """Issue 62: a torch.profiler trace of a DLO forward showed no sign of which block was
    loading or waited on. Each streamed block's steps are ranges named after it, nested as
    they run: the load, the wait and the repoint inside ``pre_forward``."""
    case = tiny_flux(0)
    backend = enable_dlo(case.model, device=CPU, use_allgather=False)
    try:
        with torch.no_grad():
            case.model(**case.inputs)  # learns the order: the next forward prefetches
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
                case.model(**case.inputs)
    finally:
        backend.disable()
    ranges = [event for event in trace.events() if event.name.startswith("DLO::")]
    names = {event.name for event in ranges}
    # Named as the backend names them: the DiT (a bare model: "model"), then the block.
    blocks = [f"model.transformer_blocks.{i}" for i in range(2)] + [
        f"model.single_transformer_blocks.{i}" for i in range(3)
    ]
    for block in blocks:
        for step in ("pre_forward", "wait", "repoint", "post_forward"):
            assert f"DLO::{step} {block}" in names, (step, block)
    # Prefetched: each block but the first is loaded while the one before it runs.
    loads = [event.name for event in ranges if event.name.startswith("DLO::load ")]
    assert loads.count("DLO::load model.transformer_blocks.1") == 1
    pre = {event.name.split(" ", 1)[1]: event for event in ranges if "pre_forward" in event.name}
    for event in ranges:
        step, block = event.name.removeprefix("DLO::").split(" ", 1)
        if step in ("wait", "repoint"):
            outer = pre[block].time_range
            assert outer.start <= event.time_range.start <= event.time_range.end <= outer.end
