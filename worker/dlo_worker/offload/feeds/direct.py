"""The feed of blocks whose mapped views are registered with the device driver.

With registration (:mod:`dlo_worker.offload.feeds.registration`) the copy engine reads the
mapping itself, so a load is one copy per mapped piece straight into its offset in the
slot: no pack, no staging buffer. A runtime-cache entry stores each block in the slot's
own layout, so its pieces coalesce into one copy per dtype; a checkpoint mapping gives
one copy per tensor.
"""

from __future__ import annotations

from dlo_worker.offload.block import HostCopy, StreamedBlock


class DirectFeed:
    """:class:`~dlo_worker.offload.block.BlockFeed` of registered mapped views."""

    def copies(self, block: StreamedBlock, _slot_index: int) -> list[HostCopy]:
        return [
            HostCopy(dtype, piece.offset, piece.view)
            for dtype, pieces in block.mapped.items()
            for piece in pieces
        ]

    def copied(self, *_args: object) -> None:
        """Nothing to hand back: the mapping stays registered until ``disable``."""


DIRECT = DirectFeed()
