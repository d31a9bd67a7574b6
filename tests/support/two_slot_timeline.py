"""A timeline model of DLO's two-slot pipeline, to judge residency placements on the CPU.

It follows the backend's rules: streamed block ``k`` is copied into slot ``k % 2`` once
the copy engine is free and block ``k - 2`` (the slot's previous occupant) has been
released; a block computes once the previous block finished and, if streamed, its copy
landed; resident blocks only compute. Forwards repeat, so the first blocks of a forward
are copied during the end of the previous one. The model reproduced the H200
measurements of the count-spread placement (1.05x / 1.12x the bound at 12 / 16 GiB on
Flux-class, docs/benchmarks.md) before the byte-spread placement replaced it.

``positions`` asks what more device buffers would give: block ``k`` then waits for block
``k - positions`` instead (how much lookahead FP8 streaming needs, docs/benchmarks.md).
"""

from __future__ import annotations


def step_seconds(
    block_bytes: list[int],
    resident: set[int],
    compute_seconds: list[float],
    bytes_per_second: float,
    *,
    forwards: int = 6,
    positions: int = 2,
) -> float:
    """Steady-state seconds per forward (the first two forwards are warm-up)."""
    streamed = [index for index in range(len(block_bytes)) if index not in resident]
    loads = [index for _ in range(forwards) for index in streamed]
    ready: list[float] = []
    released: list[float] = []
    copy_engine_free = 0.0

    def copy(load: int) -> None:
        nonlocal copy_engine_free
        start = max(copy_engine_free, released[load - positions] if load >= positions else 0.0)
        copy_engine_free = start + block_bytes[loads[load]] / bytes_per_second
        ready.append(copy_engine_free)

    for load in range(min(positions, len(loads))):
        copy(load)
    clock, load, forward_starts = 0.0, 0, []
    for _ in range(forwards):
        forward_starts.append(clock)
        for index, seconds in enumerate(compute_seconds):
            if index in resident:
                clock += seconds
                continue
            clock = max(clock, ready[load]) + seconds
            released.append(clock)
            if load + positions < len(loads):
                copy(load + positions)
            load += 1
    return (clock - forward_starts[2]) / (forwards - 2)
