"""Host storage of streamed block weights: one flat arena per dtype, page-locked on CUDA.

Each streamed block owns a contiguous range of its dtype's arena: the complete
flattened block (rank-local) or only this rank's zero-padded shard (AllGather).
One arena per dtype instead of one pinned tensor per block avoids the caching
host allocator's power-of-two rounding (a 416 MB block would pin 512 MB) and
registers the memory with the driver in a single call per dtype.
"""

from __future__ import annotations

import logging

import torch

from dlo_worker.errors import UserFixableError
from dlo_worker.offload.block import HostCopy, StreamedBlock, whole_buffers

logger = logging.getLogger(__name__)


class HostRegistrationError(RuntimeError, UserFixableError):
    """cudaHostRegister refused the arena (the memory cgroup or the driver said no)."""


class HostArena:
    """Flat host tensors per dtype, registered with CUDA when streaming to a GPU."""

    def __init__(self, numel_by_dtype: dict[torch.dtype, int], *, page_lock: bool) -> None:
        self._tensors = {
            dtype: torch.empty(numel, dtype=dtype) for dtype, numel in numel_by_dtype.items()
        }
        self._cursor = dict.fromkeys(self._tensors, 0)
        self._registered: list[torch.Tensor] = []
        if page_lock:
            self._register_all()

    def _register_all(self) -> None:
        cudart = torch.cuda.cudart()
        for dtype, tensor in self._tensors.items():
            if tensor.numel() == 0:
                continue
            status = cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
            if int(status) != 0:
                self.close()
                raise HostRegistrationError(
                    f"cudaHostRegister of {tensor.nbytes / 2**30:.2f} GiB ({dtype}) failed with "
                    f"CUDA error {int(status)}; raise the pod's memory limit or lower the "
                    "number of streamed blocks"
                )
            self._registered.append(tensor)

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The next ``numel`` unused elements of ``dtype``'s arena."""
        start = self._cursor[dtype]
        self._cursor[dtype] = start + numel
        return self._tensors[dtype][start : start + numel]

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self._tensors.values())

    @property
    def page_locked(self) -> bool:
        return bool(self._registered)

    def close(self) -> None:
        """Unregister and drop the arena (the caller has synchronized outstanding copies)."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for tensor in self._registered:
                status = cudart.cudaHostUnregister(tensor.data_ptr())
                if int(status) != 0:
                    logger.error(
                        "cudaHostUnregister failed",
                        extra={"fields": {"status": int(status), "bytes": tensor.nbytes}},
                    )
            self._registered.clear()
        self._tensors.clear()


class ArenaFeed:
    """The feed of blocks packed into the arena: their range is copied as it is."""

    def copies(self, block: StreamedBlock, _slot_index: int) -> list[HostCopy]:
        return whole_buffers(block.arena_views)

    def copied(self, *_args: object) -> None:
        """Nothing to hand back: the arena range stays the block's."""


ARENA = ArenaFeed()
