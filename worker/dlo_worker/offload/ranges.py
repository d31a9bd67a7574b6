"""Named profiler ranges on DLO's hot path, so a ``torch.profiler`` trace shows streaming.

Each range is ``DLO::<step> <block>`` (FSDP2 names its ranges ``FSDP::all_gather``,
``FSDP::pre_forward`` the same way): ``pre_forward`` (everything before the block runs,
holding ``load``, ``all_gather``, ``wait`` and ``repoint``), ``load`` (enqueueing its copy
or gather into a slot), ``all_gather`` (rebuilding it from every rank's shard), ``wait``
(ordering compute after its copy), ``repoint`` (its parameters into the slot) and
``post_forward`` (releasing the slot and starting the next load). They are host ranges:
on CUDA the copies and gathers they enqueue appear on the copy and communication streams
beside them. With no profiler running a range costs one check of a flag, nothing more.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def profiled(step: str, block: str) -> AbstractContextManager[object]:
    """The range ``DLO::<step> <block>`` while a profiler records, else nothing."""
    if not torch.autograd._profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function(f"DLO::{step} {block}")
