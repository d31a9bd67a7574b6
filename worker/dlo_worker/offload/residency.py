"""Which streamed blocks stay resident on the device (pure; no torch, no I/O).

Resident blocks compute while the copy engine streams the next streamed block, so
where they sit decides whether every copy overlaps compute. With only two slots the
copy engine runs at most one block ahead of compute; a stretch of the order that
streams more bytes than its compute can hide stalls compute, and a later stretch with
spare compute cannot give that time back.

The blocks of a DiT do about the same work each (same hidden size, same tokens) while
their bytes can differ widely: a Flux double-stream block holds 2.4x the bytes of a
single-stream block for the same FLOPs, because its text-stream and modulation weights
see few tokens. A budget is therefore spread by *bytes per position*: the streamed
bytes up to any point of the order stay within an even share of the streamed total
for the positions before that point, rather than an even share of the streamed block
count (which, on Flux, put a third of the blocks but half of the bytes into the first
third of the forward).
"""

from __future__ import annotations

_TARGET_STEPS = 256
"""Streamed-byte targets tried between the minimum the budget forces and everything."""


def spread_evenly(total: int, count: int) -> set[int]:
    """Indices of ``count`` of ``total`` blocks spaced evenly through the order.

    Used for an explicit block count (``resident_layers``): every streamed copy then has
    resident compute to hide behind, whereas leading resident blocks leave the copy
    engine idle while they run and later copies exposed.
    """
    count = min(max(count, 0), total)
    return {((2 * i + 1) * total) // (2 * count) for i in range(count)}


def resident_within_budget(block_bytes: list[int], available_bytes: int) -> set[int]:
    """Indices of the blocks to keep resident in ``available_bytes``, in execution order.

    Among placements whose streamed bytes are spread evenly over the positions of the
    order (one per streamed-byte target), the one keeping the most bytes resident wins:
    fewer streamed bytes lower the transfer bound, even spreading keeps the step at it.
    Budget left over by that placement then keeps further blocks, spread through the
    order (a block made resident only removes a copy); where no even spread fits, that is
    the whole placement.
    """
    total = sum(block_bytes)
    if available_bytes >= total:
        return set(range(len(block_bytes)))
    least_streamed = total - max(available_bytes, 0)
    best: set[int] = set()
    best_bytes = 0
    for step in range(_TARGET_STEPS + 1):
        target = least_streamed + (total - least_streamed) * step / _TARGET_STEPS
        resident = _resident_streaming_evenly(block_bytes, target)
        resident_bytes = sum(block_bytes[index] for index in resident)
        if best_bytes < resident_bytes <= available_bytes:
            best, best_bytes = resident, resident_bytes
    return best | _fill_spread(block_bytes, best, available_bytes - best_bytes)


def _fill_spread(block_bytes: list[int], resident: set[int], left: int) -> set[int]:
    """More blocks to keep in ``left`` bytes beside ``resident``: the largest first (each
    removes the longest copy), and of blocks of one size, as many as fit spread evenly
    through their positions.

    This is the whole placement where no even spread of the streamed bytes fits (FP8
    Flux below about 2.4 GiB: its double-stream blocks hold 2.4x the bytes of the single
    ones for the same compute, and half of them must stay for an even spread). Taking
    equal blocks in order instead kept the first ones, and the copies of the
    double-stream blocks after them queued up all the same.
    """
    chosen: set[int] = set()
    for size in sorted(set(block_bytes), reverse=True):
        candidates = [
            index
            for index, nbytes in enumerate(block_bytes)
            if nbytes == size and index not in resident
        ]
        if size <= 0:
            chosen.update(candidates)
            continue
        count = min(len(candidates), left // size)
        chosen.update(candidates[position] for position in spread_evenly(len(candidates), count))
        left -= count * size
    return chosen


def _resident_streaming_evenly(block_bytes: list[int], streamed_target: float) -> set[int]:
    """Stream a block only where the streamed bytes up to and including it stay within an
    even share of ``streamed_target`` for the positions *before* it; keep the rest.

    With blocks resident, a forward's copies start as it starts
    (:mod:`~dlo_worker.offload.schedule`), so a block's copy has the compute of the blocks
    before it to hide behind, never its own.
    Spreading so that the copies lag the compute keeps the first block resident and hides
    the first copy behind it: a step timed on its own (synchronized) then matches one run
    back to back. Rounding to the nearest share instead streamed the first block, whose
    copy then stalled the start of every synchronized step.
    """
    count = len(block_bytes)
    resident: set[int] = set()
    streamed = 0
    for index, nbytes in enumerate(block_bytes):
        if streamed + nbytes <= streamed_target * index / count:
            streamed += nbytes
        else:
            resident.add(index)
    return resident
