"""Every prefetch decision: the order streamed blocks actually run, learned per DiT forward.

Attribute order (the registry's lists, or the fallback's) is only a first guess: many
DiTs interleave their lists, call one in reverse, or run a nested list (a token refiner)
before the main ones. Each DiT forward is therefore recorded: the blocks whose hooks
fire, in order. While a forward follows the learned order, the block after the current
one is prefetched. Where a DiT streams every block, its step is bound by the copies, and
the copy engine must not idle between forwards: the last block's successor is the first
block of the next forward, already on its way during the last block. Where blocks stay
resident, the step has compute to hide copies behind, and prefetches stay within their
forward: its first block is loaded as it starts, so a forward whose stream is
synchronized before the next (a timed step, the end of a request) leaves no copy of the
next one in flight and pays only for its own (:mod:`~dlo_worker.offload.residency` keeps
the first block resident wherever a budget spreads the copies evenly, hiding that first
copy too). When a forward departs from the learned order, the recording replaces it at
the end of that forward, so from the next forward on every block is prefetched again
(``relearned`` counts these changes; a model whose order is fixed relearns at most
once). A slot is refilled as soon as the block in it is released: with resident blocks
in between, the next streamed block's copy overlaps their compute too. Each prediction
also lists the ``lookahead`` blocks after the successor (``following``): with AllGather
their shards are copied early, so blocks whose copies outlast their compute (Flux's
double-stream blocks over two GPUs) borrow copy time from blocks whose compute outlasts
their copies; a staging feed packs them into its free staging buffers.

A block that runs outside any DiT forward (a module used on its own) is loaded on demand
and nothing is prefetched after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dlo_worker.offload.block import StreamedBlock


@dataclass(eq=False)
class ExecutionOrder:
    """One DiT's streamed blocks in the order they ran last, and the forward in progress."""

    blocks: list[StreamedBlock]
    continues_into_next: bool = True
    """The first blocks of the next forward are loaded during this one's end: true where
    the DiT streams every block."""
    cursor: int = 0
    """Position in ``blocks`` of the next block expected in the current forward."""
    recording: list[StreamedBlock] | None = None
    """Blocks of the current forward so far; ``None`` outside a forward."""

    def after(self, position: int, steps: int) -> StreamedBlock | None:
        """The block ``steps`` after ``position``: in the next forward past this one's end,
        or ``None`` there where prefetches stay within their forward."""
        index = position + steps
        if index >= len(self.blocks) and not self.continues_into_next:
            return None
        return self.blocks[index % len(self.blocks)]


@dataclass(frozen=True)
class Prediction:
    """What to load after the block about to run."""

    successor: StreamedBlock | None = None
    """Prefetch this into the other slot now."""
    following: tuple[StreamedBlock, ...] = ()
    """The blocks expected after ``successor``, nearest first. The first is loaded as soon
    as the current block's slot is released (so its copy also overlaps any resident blocks
    in between); the rest are copied (AllGather shards) or packed (staging) early."""

    @property
    def then(self) -> StreamedBlock | None:
        return self.following[0] if self.following else None


@dataclass
class Schedule:
    """The execution orders of every DiT that shares the two slots."""

    orders: dict[int, ExecutionOrder]
    """By ``id`` of the DiT module."""
    lookahead: int = 1
    """How many blocks after the successor each prediction lists in ``following``."""
    relearned: int = 0
    _active: ExecutionOrder | None = field(default=None, repr=False)

    @classmethod
    def in_attribute_order(
        cls,
        dits: dict[int, list[StreamedBlock]],
        *,
        lookahead: int = 1,
        keeping_resident: frozenset[int] = frozenset(),
    ) -> Schedule:
        """``keeping_resident``: the DiTs (by key) that keep some blocks on the device."""
        return cls(
            {
                key: ExecutionOrder(list(blocks), continues_into_next=key not in keeping_resident)
                for key, blocks in dits.items()
                if blocks
            },
            lookahead=lookahead,
        )

    def first(self) -> Prediction:
        """The block to prime before the first forward (the first DiT's first block)."""
        if not self.orders:
            return Prediction()
        return self._from(next(iter(self.orders.values())), -1)

    def forward_started(self, dit_key: int) -> Prediction:
        """Start recording; returns the DiT's first block (to load now if it is not
        already in a slot: a switch between two DiTs, a forward after an error)."""
        order = self.orders.get(dit_key)
        if order is None:
            return Prediction()
        order.cursor, order.recording = 0, []
        self._active = order
        return self._from(order, -1)

    def forward_finished(self, dit_key: int) -> Prediction:
        """Adopt the recorded order if it differs; returns the first block of the next
        forward (to load now if the last block's prediction did not already), unless
        prefetches stay within their forward."""
        order = self.orders.get(dit_key)
        if order is None or order.recording is None:
            return Prediction()
        if order.recording and order.recording != order.blocks:
            order.blocks = order.recording
            self.relearned += 1
        order.recording = None
        if self._active is order:
            self._active = None
        return self._from(order, -1) if order.continues_into_next else Prediction()

    def block_started(self, block: StreamedBlock) -> Prediction:
        """Record ``block`` and predict what follows it."""
        order = self._active
        if order is None or order.recording is None:
            return Prediction()
        order.recording.append(block)
        position = self._position(order, block)
        if position is None:
            return Prediction()
        order.cursor = position + 1
        return self._from(order, position)

    def _from(self, order: ExecutionOrder, position: int) -> Prediction:
        """The blocks after ``position`` (-1: before the first block)."""
        following = (order.after(position, step) for step in range(2, self.lookahead + 2))
        return Prediction(
            order.after(position, 1),
            tuple(block for block in following if block is not None),
        )

    @staticmethod
    def _position(order: ExecutionOrder, block: StreamedBlock) -> int | None:
        """Where ``block`` sits in the learned order, searching forward from the cursor."""
        blocks = order.blocks
        for position in range(order.cursor, len(blocks)):
            if blocks[position] is block:
                return position
        return None
