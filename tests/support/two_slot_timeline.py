"""A timeline model of DLO's two-slot pipeline, to judge residency placements on the CPU.

It follows the backend's rules: streamed block ``k`` is copied into slot ``k % 2`` once
the copy engine is free and block ``k - 2`` (the slot's previous occupant) has been
released; a block computes once the previous block finished and, if streamed, its copy
landed; resident blocks only compute. Back to back, the host runs ahead of the device,
so the first blocks of a forward are copied during the end of the previous one. The
model reproduced the H200 measurements of the count-spread placement (1.05x / 1.12x the
bound at 12 / 16 GiB on Flux-class, docs/benchmarks.md) before the byte-spread placement
replaced it.

``synchronized`` times each forward on its own, as a step followed by
``torch.cuda.synchronize()`` is: it starts once everything before it finished, and its
first copies start with it (where blocks stay resident, a forward's prefetches stay
within it, :mod:`dlo_worker.offload.schedule`).

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
    synchronized: bool = False,
) -> float:
    """Steady-state seconds per forward (the first two forwards are warm-up)."""
    streamed = [index for index in range(len(block_bytes)) if index not in resident]
    loads = [index for _ in range(forwards) for index in streamed]
    ready: dict[int, float] = {}
    released: list[float] = []
    copy_engine_free = 0.0
    clock = 0.0

    def copy(load: int) -> None:
        nonlocal copy_engine_free
        start = max(
            copy_engine_free, clock, released[load - positions] if load >= positions else 0.0
        )
        copy_engine_free = start + block_bytes[loads[load]] / bytes_per_second
        ready[load] = copy_engine_free

    load, forward_starts = 0, []
    for forward in range(forwards):
        forward_starts.append(clock)
        last_load = (forward + 1) * len(streamed) if synchronized else len(loads)
        for first in range(load, min(load + positions, last_load)):
            if first not in ready:
                copy(first)
        for index, seconds in enumerate(compute_seconds):
            if index in resident:
                clock += seconds
                continue
            clock = max(clock, ready[load]) + seconds
            released.append(clock)
            if load + positions < last_load:
                copy(load + positions)
            load += 1
        if synchronized:
            clock = max(clock, copy_engine_free)
    return (clock - forward_starts[2]) / (forwards - 2)
