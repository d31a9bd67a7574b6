"""Registering mapped host weights, all or nothing: range planning (pure) and the lifecycle.

The platform's registration calls are outside this system and need a GPU, so a
recording registrar stands in for them here; the views are real tensors mapped from a
safetensors file on disk. tests/gpu/test_registered_transfer_cuda.py runs the same
lifecycle against cudaHostRegister.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dlo_worker.offload.block import MappedPiece, coalesce
from dlo_worker.offload.feeds import registration
from dlo_worker.offload.feeds.registration import (
    HostRange,
    PlatformRegistrationError,
    RegisteredRanges,
    RegistrationRefusedError,
    RegistrationRollbackError,
    SharedFileViews,
    ViewExtent,
    extent_of,
    mapping_of,
    page_ranges,
    read_mappings,
)
from dlo_worker.offload.layout import layout_of, streamed_parameters

PAGE = 4096


def test_views_widen_to_whole_pages_and_merge_within_their_mapping() -> None:
    mapping = (0x10000, 0x10000 + 10 * PAGE)
    extents = [
        ViewExtent(*mapping, 0x10000 + 100, 0x10000 + 200),  # inside page 0
        ViewExtent(*mapping, 0x10000 + PAGE + 8, 0x10000 + 2 * PAGE + 1),  # pages 1-2
        ViewExtent(*mapping, 0x10000 + 6 * PAGE, 0x10000 + 7 * PAGE),  # page 6 alone
        ViewExtent(*mapping, 0x10000 + 50, 0x10000 + 60),  # overlaps the first
    ]
    assert page_ranges(extents, PAGE) == [
        HostRange(0x10000, 0x10000 + 3 * PAGE),
        HostRange(0x10000 + 6 * PAGE, 0x10000 + 7 * PAGE),
    ]


def test_adjacent_mappings_are_never_merged_and_ranges_stay_inside_their_mapping() -> None:
    first = (0x10000, 0x10000 + PAGE + 10)  # its last page is partial
    second = (0x10000 + 2 * PAGE, 0x10000 + 4 * PAGE)
    extents = [
        ViewExtent(*first, 0x10000 + PAGE, 0x10000 + PAGE + 10),
        ViewExtent(*second, 0x10000 + 2 * PAGE, 0x10000 + 2 * PAGE + 4),
        ViewExtent(*second, 0x10000 + 3 * PAGE, 0x10000 + 3 * PAGE),  # empty: ignored
    ]
    assert page_ranges(extents, PAGE) == [
        HostRange(0x10000 + PAGE, 0x10000 + 2 * PAGE),
        HostRange(0x10000 + 2 * PAGE, 0x10000 + 3 * PAGE),
    ]


@pytest.fixture
def mapped_views(tmp_path: Path) -> list[torch.Tensor]:
    """Views of two safetensors files mapped from disk, as a checkpoint mapping hands out."""
    views = []
    for index in range(2):
        path = tmp_path / f"shard-{index}.safetensors"
        save_file({f"w{k}": torch.full((3000,), float(k)) for k in range(3)}, str(path))
        with safe_open(str(path), framework="pt") as handle:
            views += [handle.get_tensor(f"w{k}") for k in range(3)]
    return views


def test_tensors_of_one_file_are_grouped_by_its_mapping(
    mapped_views: list[torch.Tensor],
) -> None:
    """safetensors gives each tensor its own storage inside the file's one mapping; the
    mapping groups them, so tensors sharing a page never become two overlapping ranges."""
    mappings = read_mappings()
    extents = [extent_of(view, mappings) for view in mapped_views]
    assert len({view.untyped_storage().data_ptr() for view in mapped_views}) == 6
    assert len({(e.mapping_start, e.mapping_stop) for e in extents}) == 2
    ranges = page_ranges(extents)
    assert len(ranges) == 2  # one per file
    assert all(r.start % registration.PAGE_BYTES == 0 for r in ranges)


def test_private_file_mappings_are_read_through_a_shared_mapping(
    mapped_views: list[torch.Tensor],
) -> None:
    """safetensors maps files copy-on-write; pinning such a mapping makes the kernel copy
    every page, so registration reads the same bytes through a MAP_SHARED mapping."""
    private = read_mappings()
    assert not any(mapping_of(view, private).shared for view in mapped_views)
    translator = SharedFileViews()
    shared = [translator.view_of(view, mapping_of(view, private)) for view in mapped_views]
    after = read_mappings()
    for original, view in zip(mapped_views, shared, strict=True):
        assert torch.equal(original, view)
        assert (view.dtype, view.shape) == (original.dtype, original.shape)
        assert view.data_ptr() != original.data_ptr()
        assert view.data_ptr() % registration.PAGE_BYTES == original.data_ptr() % (
            registration.PAGE_BYTES
        )
        mapping = mapping_of(view, after)
        assert mapping.shared
        assert mapping.path == mapping_of(original, private).path


def test_a_registered_checkpoint_block_is_one_copy_per_file(tmp_path: Path) -> None:
    """safetensors writes tensors sorted by name and the layout packs a block by name, so
    the shared views of a block's tensors (one storage per file) coalesce into one copy
    whenever tensor sizes keep the alignment."""
    block = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 128)
    )
    path = tmp_path / "block.safetensors"
    save_file(dict(block.state_dict()), str(path))
    named = streamed_parameters(block)
    (layout,) = layout_of(named).by_dtype.values()
    translator = SharedFileViews()
    with safe_open(str(path), framework="pt") as handle:
        private = read_mappings()
        pieces = []
        for span in layout.spans:
            view = handle.get_tensor(span.name)
            shared = translator.view_of(view, mapping_of(view, private)).reshape(-1)
            pieces.append(MappedPiece(span.offset, span.numel, shared))
    (merged,) = coalesce(pieces)
    assert (merged.offset, merged.numel) == (0, layout.numel)
    expected = torch.cat([parameter.detach().reshape(-1) for _, parameter in named])
    assert torch.equal(merged.view, expected)


def test_registration_hands_back_the_shared_views(mapped_views: list[torch.Tensor]) -> None:
    registered = register(mapped_views, RecordingRegistrar())
    mappings = read_mappings()
    assert all(mapping_of(view, mappings).shared for view in registered.views)
    assert all(map(torch.equal, registered.views, mapped_views))
    registered.release()


def test_private_memory_is_not_registered() -> None:
    registrar = RecordingRegistrar()
    with pytest.raises(RegistrationRefusedError) as refused:
        register([torch.zeros(5000)], registrar)
    assert refused.value.reason == "not-mapped"
    assert registrar.calls == []


class RecordingRegistrar:
    """Stands in for the device driver: records calls, fails where told to."""

    name = "recording"

    def __init__(
        self,
        *,
        unsupported: str | None = None,
        fail_register_at: int | None = None,
        fail_unregister: bool = False,
        pinned: bool = True,
    ) -> None:
        self.unsupported = unsupported
        self.fail_register_at = fail_register_at
        self.fail_unregister = fail_unregister
        self.pinned = pinned
        self.calls: list[tuple[str, int]] = []
        self.registered: set[int] = set()

    def unsupported_reason(self) -> str | None:
        self.calls.append(("query", 0))
        return self.unsupported

    def register(self, start: int, nbytes: int) -> None:
        if len([c for c in self.calls if c[0] == "register"]) == self.fail_register_at:
            self.calls.append(("register-failed", start))
            raise PlatformRegistrationError("CUDA error 712 (already registered)")
        self.calls.append(("register", start))
        self.registered.add(start)

    def unregister(self, start: int) -> None:
        self.calls.append(("unregister", start))
        if self.fail_unregister:
            raise PlatformRegistrationError("CUDA error 713 (not registered)")
        self.registered.remove(start)

    def is_pinned(self, view: torch.Tensor) -> bool:
        return self.pinned


def register(views: list[torch.Tensor], registrar: RecordingRegistrar, **options: float):
    arguments = {"budget_bytes": 1 << 30, "timeout_s": 60.0} | options
    return RegisteredRanges.register(views, registrar, **arguments)


def test_everything_is_registered_then_released_in_reverse(
    mapped_views: list[torch.Tensor],
) -> None:
    registrar = RecordingRegistrar()
    registered = register(mapped_views, registrar)
    starts = [start for call, start in registrar.calls if call == "register"]
    assert len(starts) == 2
    mappings = read_mappings()
    extents = [extent_of(view, mappings) for view in mapped_views]
    assert registered.nbytes == sum(r.nbytes for r in page_ranges(extents))
    registered.release()
    assert [start for call, start in registrar.calls if call == "unregister"] == starts[::-1]
    assert registrar.registered == set()
    registered.release()  # idempotent
    assert len(registrar.calls) == 5


def test_the_budget_is_checked_before_any_platform_call(
    mapped_views: list[torch.Tensor],
) -> None:
    registrar = RecordingRegistrar()
    with pytest.raises(RegistrationRefusedError) as refused:
        register(mapped_views, registrar, budget_bytes=PAGE)
    assert refused.value.reason == "budget"
    assert "--dlo-runtime-cache-pin-limit-gib" in str(refused.value)
    assert registrar.calls == []


def test_an_unsupported_platform_is_refused_before_registering(
    mapped_views: list[torch.Tensor],
) -> None:
    registrar = RecordingRegistrar(unsupported="no read-only registration here")
    with pytest.raises(RegistrationRefusedError) as refused:
        register(mapped_views, registrar)
    assert (refused.value.reason, registrar.calls) == ("unsupported", [("query", 0)])


def test_a_failure_in_the_middle_unregisters_what_was_registered(
    mapped_views: list[torch.Tensor],
) -> None:
    registrar = RecordingRegistrar(fail_register_at=1)
    with pytest.raises(RegistrationRefusedError) as refused:
        register(mapped_views, registrar)
    assert refused.value.reason == "failed"
    assert "CUDA error 712" in str(refused.value)
    assert [call for call, _ in registrar.calls] == [
        "query",
        "register",
        "register-failed",
        "unregister",
    ]
    assert registrar.registered == set()


def test_views_not_seen_as_pinned_roll_back(mapped_views: list[torch.Tensor]) -> None:
    registrar = RecordingRegistrar(pinned=False)
    with pytest.raises(RegistrationRefusedError) as refused:
        register(mapped_views, registrar)
    assert refused.value.reason == "not-pinned"
    assert registrar.registered == set()


def test_a_registration_past_its_deadline_rolls_back(mapped_views: list[torch.Tensor]) -> None:
    registrar = RecordingRegistrar()
    with pytest.raises(RegistrationRefusedError) as refused:
        register(mapped_views, registrar, timeout_s=-1.0)
    assert refused.value.reason == "timeout"
    assert registrar.registered == set()


def test_a_failed_rollback_is_fatal_and_keeps_the_views_mapped(
    mapped_views: list[torch.Tensor],
) -> None:
    registrar = RecordingRegistrar(fail_register_at=1, fail_unregister=True)
    retained_before = len(registration._RETAINED)
    with pytest.raises(RegistrationRollbackError) as failed:
        register(mapped_views, registrar)
    assert "must exit" in str(failed.value)
    assert len(registration._RETAINED) == retained_before + 1
    retained = registration._RETAINED[-1]  # the registered (shared) views stay mapped
    assert len(retained) == len(mapped_views)
    assert all(mapping_of(view, read_mappings()).shared for view in retained)
