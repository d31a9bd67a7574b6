"""Every prefetch decision: the order streamed blocks actually run, learned per DiT forward.

Attribute order (the registry's lists, or the fallback's) is only a first guess: many
DiTs interleave their lists, call one in reverse, or run a nested list (a token refiner)
before the main ones. Each DiT forward is therefore recorded: the blocks whose hooks fire,
in order. While a forward follows the learned order, the block after the current one is
prefetched (the last block's successor is the first block of the next forward, already
on its way during the last block). When a forward departs from the learned order, the
recording replaces it at the end of that forward, so from the next forward on every block
is prefetched again (``relearned`` counts these changes; a model whose order is fixed
relearns at most once). A slot is refilled as soon as the block in it is released: with
resident blocks in between, the next streamed block's copy overlaps their compute too.
With AllGather, the shards of the next ``lookahead`` blocks are copied early (``ahead``):
blocks whose copies outlast their compute (Flux's double-stream blocks over two GPUs)
then borrow copy time from blocks whose compute outlasts their copies.

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
    cursor: int = 0
    """Position in ``blocks`` of the next block expected in the current forward."""
    recording: list[StreamedBlock] | None = None
    """Blocks of the current forward so far; ``None`` outside a forward."""

    def after(self, position: int, steps: int) -> StreamedBlock:
        return self.blocks[(position + steps) % len(self.blocks)]


@dataclass(frozen=True)
class Prediction:
    """What to load after the block about to run."""

    successor: StreamedBlock | None = None
    """Prefetch this into the other slot now."""
    then: StreamedBlock | None = None
    """The block after ``successor``: loaded as soon as the current block's slot is released
    (so its copy also overlaps any resident blocks in between)."""
    later: StreamedBlock | None = None
    """The block after ``then`` (a staged host source starts packing it)."""
    ahead: tuple[StreamedBlock, ...] = ()
    """The next ``lookahead`` blocks, nearest first (AllGather copies their shards early)."""


@dataclass
class Schedule:
    """The execution orders of every DiT that shares the two slots."""

    orders: dict[int, ExecutionOrder]
    """By ``id`` of the DiT module."""
    lookahead: int = 0
    """How many upcoming blocks each prediction lists in ``ahead``."""
    relearned: int = 0
    _active: ExecutionOrder | None = field(default=None, repr=False)

    @classmethod
    def in_attribute_order(
        cls, dits: dict[int, list[StreamedBlock]], *, lookahead: int = 0
    ) -> Schedule:
        return cls(
            {key: ExecutionOrder(list(blocks)) for key, blocks in dits.items() if blocks},
            lookahead=lookahead,
        )

    def first(self) -> Prediction:
        """The block to prime before the first forward (the first DiT's first block)."""
        if not self.orders:
            return Prediction()
        order = next(iter(self.orders.values()))
        return Prediction(order.blocks[0], order.after(0, 1))

    def forward_started(self, dit_key: int) -> Prediction:
        """Start recording; returns the DiT's first block (to load now if it is not
        already in a slot: a switch between two DiTs, a forward after an error)."""
        order = self.orders.get(dit_key)
        if order is None:
            return Prediction()
        order.cursor, order.recording = 0, []
        self._active = order
        return Prediction(order.blocks[0], order.after(0, 1))

    def forward_finished(self, dit_key: int) -> Prediction:
        """Adopt the recorded order if it differs; returns the first block of the next
        forward (to load now if the last block's prediction did not already)."""
        order = self.orders.get(dit_key)
        if order is None or order.recording is None:
            return Prediction()
        if order.recording and order.recording != order.blocks:
            order.blocks = order.recording
            self.relearned += 1
        order.recording = None
        if self._active is order:
            self._active = None
        return Prediction(order.blocks[0], order.after(0, 1))

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
        return Prediction(
            order.after(position, 1),
            order.after(position, 2),
            order.after(position, 3),
            tuple(order.after(position, step) for step in range(1, self.lookahead + 1)),
        )

    @staticmethod
    def _position(order: ExecutionOrder, block: StreamedBlock) -> int | None:
        """Where ``block`` sits in the learned order, searching forward from the cursor."""
        blocks = order.blocks
        for position in range(order.cursor, len(blocks)):
            if blocks[position] is block:
                return position
        return None
