"""The ring of staging buffers: packs run ahead of the copies into free buffers, in order,
each after the copy out of its buffer finished; a load nobody predicted evicts the oldest
prefetched block; every packed buffer holds the block's exact bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlo_worker.offload.block import MappedPiece, StreamedBlock
from dlo_worker.offload.feeds.staging import HostStaging, Packer
from dlo_worker.offload.layout import layout_of, slot_capacity
from dlo_worker.offload.slots import TransferCounters


def make_blocks(count: int) -> list[StreamedBlock]:
    """Blocks whose mapped pieces are distinct host tensors (two per block, with a gap)."""
    blocks = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        named = [
            ("weight", torch.randn(7, 5, generator=generator)),
            ("bias", torch.randn(3, generator=generator)),
        ]
        layout = layout_of(named)
        (dtype_layout,) = layout.by_dtype.values()
        pieces = [
            MappedPiece(span.offset, span.numel, tensor.reshape(-1))
            for span, (_, tensor) in zip(dtype_layout.spans, named, strict=True)
        ]
        blocks.append(
            StreamedBlock(
                name=f"blocks.{index}",
                module=nn.Identity(),
                layout=layout,
                parameters=[],
                mapped={torch.float32: pieces},
            )
        )
    return blocks


def expected_bytes(block: StreamedBlock) -> torch.Tensor:
    (pieces,) = block.mapped.values()
    packed = torch.zeros(block.layout.by_dtype[torch.float32].numel)
    for offset, numel, source in pieces:
        packed[offset : offset + numel] = source
    return packed


class CopyEnd:
    """Stands in for the CUDA event that ends a device copy: records who waited on it."""

    def __init__(self, waits: list[str], name: str) -> None:
        self.waits, self.name = waits, name

    def synchronize(self) -> None:
        self.waits.append(self.name)


@pytest.fixture
def packer():
    packer = Packer(2)
    yield packer
    packer.close()


def staging_for(blocks: list[StreamedBlock], packer: Packer, depth: int) -> HostStaging:
    capacity = slot_capacity([block.layout for block in blocks], 1)
    staging = HostStaging(capacity, packer, TransferCounters(), page_lock=False, depth=depth)
    for block in blocks:
        block.feed = staging
    return staging


def load(staging: HostStaging, block: StreamedBlock, upcoming, event=None) -> torch.Tensor:
    (copy,) = staging.copies(block, 0)
    data = copy.tensor.clone()
    staging.copied(block, 0, event, tuple(upcoming))
    return data


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_packs_run_depth_minus_one_blocks_ahead_in_ring_order(depth, packer) -> None:
    blocks = make_blocks(8)
    staging = staging_for(blocks, packer, depth)
    for index, block in enumerate(blocks):
        upcoming = blocks[index + 1 :]
        assert torch.equal(load(staging, block, upcoming), expected_bytes(block))
        held = {buffer.block.name for buffer in staging.buffers if buffer.block is not None}
        assert held == {block.name for block in upcoming[: depth - 1]}
    # Every block was packed once: nothing prefetched was evicted.
    assert staging._counters.pack_bytes == sum(block.layout.nbytes for block in blocks)
    staging.close()


def test_a_pack_into_a_buffer_waits_for_the_copy_out_of_it(packer) -> None:
    blocks = make_blocks(4)
    staging = staging_for(blocks, packer, 2)
    waits: list[str] = []
    load(staging, blocks[0], blocks[1:], CopyEnd(waits, "copy of blocks.0"))
    assert waits == []  # blocks.1 went to the other, never used buffer
    load(staging, blocks[1], blocks[2:], CopyEnd(waits, "copy of blocks.1"))
    staging.copies(blocks[2], 0)  # waits for blocks.2's pack into blocks.0's buffer
    assert set(waits) == {"copy of blocks.0"}
    staging.close()


def test_a_load_nobody_predicted_evicts_the_oldest_prefetch_and_stays_exact(packer) -> None:
    blocks = make_blocks(6)
    staging = staging_for(blocks, packer, 3)
    load(staging, blocks[0], blocks[1:3])
    assert [b.block for b in staging.buffers] == [None, blocks[1], blocks[2]]
    # The model ran blocks.5 instead: the free buffer takes it, the prefetches stay.
    assert torch.equal(load(staging, blocks[5], ()), expected_bytes(blocks[5]))
    assert [b.block for b in staging.buffers] == [None, blocks[1], blocks[2]]
    # And blocks.4: no buffer is free, so the oldest prefetch (blocks.1) gives way.
    assert torch.equal(load(staging, blocks[4], ()), expected_bytes(blocks[4]))
    assert [b.block for b in staging.buffers] == [None, None, blocks[2]]
    for block in (blocks[1], blocks[2]):
        assert torch.equal(load(staging, block, ()), expected_bytes(block))
    staging.close()


def test_fewer_than_two_buffers_is_refused(packer) -> None:
    with pytest.raises(ValueError, match="at least two"):
        staging_for(make_blocks(1), packer, 1)
