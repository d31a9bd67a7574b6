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
bytes up to any point of the order stay close to an even share of the streamed total,
rather than an even share of the streamed block count (which, on Flux, put a third of
the blocks but half of the bytes into the first third of the forward).
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
    Budget left over by that placement then keeps whichever further blocks still fit
    (a block made resident only removes a copy).
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
    for index in sorted(range(len(block_bytes)), key=lambda i: -block_bytes[i]):
        if index not in best and best_bytes + block_bytes[index] <= available_bytes:
            best.add(index)
            best_bytes += block_bytes[index]
    return best


def _resident_streaming_evenly(block_bytes: list[int], streamed_target: float) -> set[int]:
    """Stream a block whenever that keeps the streamed bytes so far closest to an even
    share of ``streamed_target`` (error diffusion along the order); keep the rest."""
    count = len(block_bytes)
    resident: set[int] = set()
    streamed = 0
    for index, nbytes in enumerate(block_bytes):
        if streamed + nbytes / 2 <= streamed_target * (index + 1) / count:
            streamed += nbytes
        else:
            resident.add(index)
    return resident
