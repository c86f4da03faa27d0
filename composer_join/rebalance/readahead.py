"""Rebalancing without ``len()``: ranks read ahead, report their buffer levels, and dry ranks receive batches.

:class:`ReadAheadRebalancer` is ``mode='rebalance'`` for a fit in which some or all ranks' train
dataloaders have no ``len()`` (streams, filtered ``IterableDataset``s, token-budget batching).
Nobody can plan the epoch ahead, so the ranks decide step by step, from what they already
exchange: the per-step agreement of the :class:`~composer_join.join.iterator.JoinLoader` (one small
all-reduce per step, which unsized loaders run anyway) carries three more columns per rank
(:class:`~composer_join.core.plan.RankStatus` ``held``, ``drained``, ``unsendable``).

Each rank keeps a *read-ahead buffer* of at most :data:`READ_AHEAD` (2) of its own batches beyond
the one it trains next. After forming step ``t``'s batch it refills the buffer from its own
dataloader and reports ``held`` (batches in the buffer, ``0..2``) and ``drained`` (its
dataloader has ended) in step ``t``'s row. ``held < 2`` only once ``drained``.

**The rule** (:func:`assign`, computed identically on every rank from step ``t - 1``'s rows):

1. If every rank reported ``held = 0``, the epoch is over (every rank and buffer is empty).
2. Every rank with ``held >= 1`` trains the first batch of its buffer, its own next batch.
3. Every other rank (``held = 0``: it is dry), in increasing rank order, receives one batch from
   the *donor* with the largest surplus, ties to the lowest rank. A rank ``q`` with ``held >= 1``
   has surplus ``held_q - 1 - g_q`` (``g_q``: batches it was already assigned to give at this
   step); it is a donor if that is ``>= 1``, or if it is not ``drained`` (it will read a fresh
   batch to give), and it has given fewer than :data:`MAX_GIFTS` (32) batches at this step: a donor reads and
   sends at most 32 batches a step. If there is no donor the rank idles: it shadows this step.
4. A donor gives its batches in order: first those in its buffer, then fresh ones from its
   dataloader, to its receivers in increasing rank order. If its dataloader ends while it reads a
   fresh one, the remaining receivers idle this step (nothing is lost: the next rows say so).
5. Step 0 uses the rows of the epoch's start: every rank fills its buffer, and the ranks exchange
   ``(held, drained)`` once (one all-reduce of ``2 * W`` integers per epoch, on every rank).
6. If some rank reported ``unsendable`` (one of its batches cannot be sent: e.g. it holds a
   lambda), there are no more transfers for the rest of the fit: rank 0 logs a warning, and
   ranks that run dry shadow, as in ``mode='shadow'``.
7. A step assigned from rows in which every rank holds ``>= 2`` needs no agreement
   (:func:`agreement_needed`): every rank trains its own batch there and at the next step,
   whatever this step's rows say. The JoinLoader plans it locally (:attr:`ReadAheadRebalancer.agreed`
   is False), and the next step is assigned from ``held - 1``, what every rank is known to hold.
   A read error on such a step is raised at the next agreed step, so no rank stops alone.

Under tensor parallelism the rule runs over data-parallel members (:mod:`composer_join.core.layout`: a TP
group's ranks hold the same batches and rows) and each member's cell is spread to its ranks: rank ``k`` of a
dry group receives from rank ``k`` of the giving group.

So every batch of every rank is trained exactly once, by one rank; a rank that trains a received
batch counts in ``A_t`` like one that trains its own. Transfers are point to point (a
:class:`~composer_join.rebalance.transfer.BatchChannel`, as the sized scheme's, whose first message also says
when no batch follows), inside the ``next()`` the JoinLoader calls once per step on every rank.
A donor only sends, a receiver only receives, each from one donor: no cycle, no deadlock.

Resumption: the rule depends only on the data, so when Composer spins the dataloader to a
mid-epoch checkpoint, every rank replays the same rows and transfers, and the same batches land
on the same ranks at the same steps (spun batches are discarded, none skipped, none repeated).

Cost over the sized scheme: the agreement on every step but those of rule 7 (so every other step
while all buffers are full; ``8 * 13 * W`` bytes, overlapped with the previous step's training),
one all-reduce of ``2 * W`` integers at each epoch's start, and up to two batches of read-ahead
per rank.
"""

from __future__ import annotations

import collections
import heapq
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional

import numpy as np
import torch

from composer_join.core.batches import map_tensors
from composer_join.core.catalogue import READAHEAD_LEVELS
from composer_join.core.errors import UnevenInputsError
from composer_join.core.exchange import TorchExchange
from composer_join.core.layout import Layout
from composer_join.core.plan import StepPlan
from composer_join.core.protocol import Exchange
from composer_join.core.source import IDLE, Opener
from composer_join.rebalance.rebalance import Rebalancer
from composer_join.rebalance.transfer import BatchChannel

__all__ = [
    'MAX_GIFTS',
    'READ_AHEAD',
    'ReadAheadRebalancer',
    'agreement_needed',
    'assign',
    'assign_levels',
    'rebalanced_without_len',
]

log = logging.getLogger(__name__)

READ_AHEAD = 2
"""Batches a rank holds in its read-ahead buffer at most, beyond the one it trains next."""

MAX_GIFTS = 32
"""Batches a donor gives at most in one step (rule 3): a bound on what it reads and sends while a step trains.

Without ``len()`` nobody knows who holds the spare batches until ranks run dry, so at an epoch's tail a few ranks may
have to feed many (issue #48's shards at W=1,024: up to 204 receivers per donor in a step, uncapped). The cap costs
steps where the spare batches sit on fewer than ``W / 33`` ranks: measured there, 1,028 steps instead of 1,005 (+2.4%;
the ideal is 1,004) at W=1,024 (``benchmarks/scale.py``). Never binds below 34 ranks."""

Levels = tuple[np.ndarray, np.ndarray]  # per rank: held, drained


def assign(
    rows: Sequence[tuple[int, bool]], transfers: bool = True, layout: Optional[Layout] = None
) -> Optional[list[Optional[int]]]:
    """Who trains whose batch at the next step, from every rank's ``(held, drained)`` of this step.

    Returns, per rank, the rank whose batch it trains (itself: its own; another: received from
    it; ``None``: it idles), or ``None`` if the epoch is over (no rank holds a batch). The rule is
    in the module docstring. ``transfers=False``: no rank receives (after an unsendable batch).
    ``layout``: the rule over its members (their first rank's row), each member's cell spread to its ranks.

    Example:
        >>> assign([(2, False), (0, True), (0, True)])  # rank 0 gives one from its buffer, one fresh
        [0, 0, 0]
        >>> assign([(1, True), (0, True)]), assign([(0, True), (0, True)])
        ([0, None], None)
        >>> assign([(2, False), (2, False), (0, True), (0, True)], layout=Layout(((0, 1), (2, 3))))
        [0, 1, 0, 1]
    """
    if layout is not None and layout.tp > 1:
        per_member = assign(layout.leaders(rows), transfers)
        return None if per_member is None else layout.on_ranks(per_member, layout.counterpart)
    held = np.fromiter((h for h, _ in rows), dtype=np.int64, count=len(rows))
    drained = np.fromiter((bool(d) for _, d in rows), dtype=bool, count=len(rows))
    cells = assign_levels(held, drained, transfers)
    return None if cells is None else [None if c < 0 else c for c in cells.tolist()]


def assign_levels(held: np.ndarray, drained: np.ndarray, transfers: bool = True) -> Optional[np.ndarray]:
    """:func:`assign` on the levels as arrays (per rank: ``held``, ``drained``), without a Python object per rank.

    Returns, per rank, the rank whose batch it trains (``-1``: it idles), or None if the epoch is over. Cost:
    ``O(W)`` array operations, and ``O(log W)`` per dry rank: the donors wait in one heap of ranks per surplus
    (ties to the lowest rank), a donor's surplus falls by one per batch it gives, and it leaves once it has
    given :data:`MAX_GIFTS` at this step.
    """
    if not (held != 0).any():
        return None
    world = len(held)
    cells = np.where(held >= 1, np.arange(world), -1)
    dry = np.flatnonzero(held < 1)
    if not transfers or not len(dry):
        return cells
    surplus = held - 1
    eligible = (held >= 1) & ((surplus >= 1) | ~drained)
    buckets: dict[int, list[int]] = {}  # surplus -> ranks (a heap: sorted lists are heaps)
    for k in np.unique(surplus[eligible]).tolist():
        buckets[k] = np.flatnonzero(eligible & (surplus == k)).tolist()
    given: dict[int, int] = collections.defaultdict(int)
    key: Optional[int] = max(buckets, default=None)  # the largest surplus with a donor (pushes only go below it)
    for r in dry.tolist():
        while key is not None and not buckets[key]:
            key = max((k for k, ranks in buckets.items() if k < key and ranks), default=None)
        if key is None:
            break  # no donor left at this step: the remaining dry ranks idle
        donor = heapq.heappop(buckets[key])
        cells[r] = donor
        given[donor] += 1
        if given[donor] < MAX_GIFTS and (key - 1 >= 1 or not drained[donor]):
            heapq.heappush(buckets.setdefault(key - 1, []), donor)
    return cells


def agreement_needed(rows: Sequence[tuple[int, bool]]) -> bool:
    """Whether the ranks must exchange rows at the step assigned from ``rows`` (the previous step's).

    They need not if every rank holds at least 2 batches: then every rank trains its own at this
    step (no rank is dry, so none gives), keeps at least one, and so trains its own at the next
    step too, whatever the rows of this step say. Steps where every rank's buffer is full thus
    exchange rows every other step; the steps that need no exchange are planned locally by the
    JoinLoader, as the sized scheme's leading steps are.

    Example:
        >>> agreement_needed([(2, False), (2, False)]), agreement_needed([(2, False), (1, True)])
        (False, True)
    """
    return min((held for held, _ in rows), default=0) < 2


class ReadAheadRebalancer(Rebalancer):
    """This rank's batches under :func:`assign`: its own, minus those it gives, plus those it receives.

    Sits beneath the :class:`~composer_join.join.iterator.JoinLoader`, which calls :meth:`status_columns`
    for every row it contributes and :meth:`observe` with every agreed plan. Yields :data:`IDLE`
    for a step at which this rank has nothing to train (the JoinLoader shadows it) and ends when
    the rows say every rank and buffer is empty, at the same step on every rank.

    Args:
        dataloader: this rank's own dataloader (with or without ``len()``).
        world_counts: every rank's ``len()`` (``None`` where unknown); kept for the report only.
        to_device: where transferred tensors go (the trainer's device).
        layout: the data-parallel members (default: every rank its own); the rule runs over them.
        channel: the transfers' channel (default: over ``torch.distributed``).
        exchange: the epoch start's exchange of levels (default: :class:`~composer_join.core.exchange.TorchExchange`).

    Attributes:
        peak_held: the most batches this rank's read-ahead buffer held in this fit (at most :data:`READ_AHEAD`).
        peak_held_bytes: the most bytes of tensors it held in it.
    """

    reads_ahead = True

    def __init__(
        self,
        dataloader: Iterable,
        world_counts: Sequence[Optional[int]],
        to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        layout: Optional[Layout] = None,
        channel: Optional[BatchChannel] = None,
        exchange: Optional[Exchange] = None,
    ):
        # None in world_counts: a rank without len()
        super().__init__(dataloader, world_counts, to_device, layout=layout, channel=channel)  # type: ignore[arg-type]
        self.world = len(world_counts)
        self.exchange = exchange if exchange is not None else TorchExchange(to_device)
        self.transfers = True  # False once some rank reported an unsendable batch (for the rest of the fit)
        self.peak_held = self.peak_held_bytes = 0
        self._rows: Optional[Levels] = None  # the last agreed step's (held, drained), per rank
        self._columns = {'held': 0, 'drained': False, 'unsendable': False}
        self._cells: Optional[np.ndarray] = None  # the current step's assignment (-1: idles)
        self._bounds: Optional[Levels] = None  # what the current step's rows are known to be without agreeing
        self.agreed = True  # the step whose batch next() just returned needs an agreement (see agreement_needed)
        self._counts = self._zero_counts()

    def __len__(self) -> int:
        raise TypeError('with rebalancing without len(), the number of batches a rank trains is not known ahead')

    @property
    def length(self) -> Optional[int]:  # not known ahead
        return None

    def _zero_counts(self) -> dict[str, np.ndarray]:
        return {k: np.zeros(self.world, dtype=np.int64) for k in ('own_batches', 'received_batches', 'given_batches')}

    def used(self, steps: int, trained: int) -> int:
        """Not known here (-1): a rank's position depends on read-ahead buffers that no checkpoint holds, so its
        data is replayed on resumption (:attr:`reads_ahead`), which this rule resumes exactly."""
        return -1

    def planned_locally(self) -> bool:
        """Rule 7: the step whose batch :meth:`epoch` just gave needs no agreement."""
        return not self.agreed

    def counts_per_rank(self) -> dict[str, list[int]]:
        """Per rank: batches trained from its own shard, received, given away (this epoch, from the agreements)."""
        return {k: v.tolist() for k, v in self._counts.items()}

    # -- the JoinLoader's hooks ----------------------------------------------------------------

    def status_columns(self) -> dict[str, Any]:
        """This rank's columns for the row of the step whose batch ``next()`` just returned."""
        return dict(self._columns)

    def observe(self, plan: StepPlan) -> None:
        """Take a step's plan: the levels for the next step's assignment, and the report's counts.

        For a step that needed no agreement (:attr:`agreed` False; the JoinLoader's local plan, in
        which every rank has a batch), the levels are the lower bounds the last agreed rows imply.
        """
        cells, rows = self._cells, plan.rows
        if cells is not None:
            ranks = np.arange(len(cells))
            trains = (cells >= 0) & (rows.column('has_batch') != 0 if plan.agreed else True)
            own = trains & (cells == ranks)
            received = trains & ~own
            self._counts['own_batches'] += own
            self._counts['received_batches'] += received
            self._counts['given_batches'] += np.bincount(cells[received], minlength=len(cells))
        self._rows = (rows.column('held'), rows.column('drained') != 0) if plan.agreed else self._bounds
        unsendable = plan.ranks_where('unsendable')
        if unsendable and self.transfers:
            self.transfers = False
            if self.rank == 0:
                log.warning(
                    "UnevenJoin(mode='rebalance'): rank(s) %s hold a batch that cannot be sent to another rank "
                    "(only dense tensors and picklable objects can); falling back to shadowing (mode='shadow') "
                    'for the rest of this fit: ranks that run out of data shadow the others.',
                    unsendable,
                )

    # -- iterating ------------------------------------------------------------------------------

    def epoch(self, start: int, open: Opener) -> Iterator[Any]:
        return self._steps(open)

    def _steps(self, open: Opener) -> Iterator[Any]:
        self.bytes_sent = self.bytes_received = 0
        self._counts, self._rows = self._zero_counts(), None
        self.agreed = True
        source = _Source(open(False))
        self._rows = self._first_rows(source)
        deferred: Optional[BaseException] = None  # a read error on a step that needed no agreement
        step = 0
        while True:
            self.agreed = True
            if self._rows is None:  # the JoinLoader did not observe the last step: it stopped
                return
            held, drained = self._rows
            cells = self._assign(held, drained)
            self.agreed = not len(held) or bool(held.min() < 2)  # agreement_needed
            self._cells, self._bounds, self._rows = cells, (held - 1, drained), None
            if cells is None:
                return
            if deferred is not None and self.agreed:  # the JoinLoader's agreement tells every rank
                raise deferred
            mine = int(cells[self.rank])
            if mine == self.rank:
                batch = source.buffer.popleft()
            elif mine < 0:
                batch = IDLE
            else:
                batch = self._receive_gift(mine, step)
            receivers = [q for q in np.flatnonzero(cells == self.rank).tolist() if q != self.rank]
            if receivers:
                self._give(source, receivers, step)
            try:
                if deferred is None:
                    source.fill(READ_AHEAD)  # after the gifts: no receiver waits for a rank that raises here
            except Exception as e:
                if self.agreed:  # the agreement of this step tells every rank
                    raise
                deferred = e  # no rank may stop at this step: train it, raise at the next agreed one
            held_bytes = sum(_nbytes(b) for b in source.buffer)
            self.peak_held = max(self.peak_held, len(source.buffer))
            self.peak_held_bytes = max(self.peak_held_bytes, held_bytes)
            self._columns = {
                'held': len(source.buffer),
                'drained': source.drained,
                'unsendable': self._columns['unsendable'],
            }
            yield batch
            step += 1

    def _assign(self, held: np.ndarray, drained: np.ndarray) -> Optional[np.ndarray]:
        """:func:`assign_levels`, over the layout's members where there is tensor parallelism."""
        layout = self.layout
        if layout.tp == 1:
            return assign_levels(held, drained, self.transfers)
        cells = assign(list(zip(held.tolist(), drained.tolist())), self.transfers, layout)
        return None if cells is None else np.array([-1 if c is None else c for c in cells])

    def _first_rows(self, source: _Source) -> Levels:
        """Fill the buffer and exchange every rank's ``(held, drained)``: one all-reduce of ``2 * W`` integers per epoch.

        A rank whose dataloader raises here still takes part (reporting ``-1``), so no rank waits;
        then every rank raises (the failing one its error), and the JoinLoader's agreement stops all.
        """
        failure: Optional[BaseException] = None
        try:
            source.fill(READ_AHEAD)
        except Exception as e:
            failure = e
        row = [-1 if failure is not None else len(source.buffer), int(source.drained)]
        said = READAHEAD_LEVELS.said("the exchange of the ranks' read-ahead levels at the epoch's start")
        table = np.asarray(self.exchange.rows(row, said).array(), dtype=np.int64).reshape(-1, 2)
        rows = (table[:, 0], table[:, 1] != 0)
        if failure is not None:
            raise failure
        failed = np.flatnonzero(rows[0] < 0).tolist()
        if failed:
            raise UnevenInputsError(
                f'rank(s) {failed} could not read the first batches of the epoch (their dataloader '
                f'raised); every rank stops, the failing rank raises the cause'
            )
        return rows

    def _give(self, source: _Source, receivers: list[int], step: int) -> None:
        """Send one batch to each receiver, in order: buffered ones first, then fresh ones.

        A receiver is sent "no batch" (it idles this step) if the dataloader ends first, or if the
        batch cannot be sent: the donor then keeps it (it trains it later itself) and reports
        ``unsendable``. If reading fails, the remaining receivers are sent a failure, then it raises.
        """
        failure: Optional[BaseException] = None
        for q in receivers:
            batch = None
            if failure is None and not self._columns['unsendable']:
                try:
                    if not source.buffer:
                        source.fill(1)
                    batch = source.buffer.popleft() if source.buffer else None
                except Exception as e:  # the receivers must hear of it, or they would wait forever
                    failure = e
            if failure is not None:
                self.channel.send(None, q, step)  # a failure: q raises
                continue
            packed = None
            if batch is not None and not self._columns['unsendable']:
                try:
                    packed = self.channel.pack(batch)
                except Exception:
                    source.buffer.appendleft(batch)  # trained here later; no more transfers in this fit
                    self._columns['unsendable'] = True
            if packed is None:
                self.channel.send_nothing(q)
            else:
                self.channel.send_packed(packed, q)
        if failure is not None:
            raise failure

    def _receive_gift(self, src: int, step: int) -> Any:
        batch = self.channel.receive(src, step)
        return IDLE if batch is None else batch


class _Source:
    """This rank's own dataloader with its read-ahead buffer."""

    def __init__(self, iterator: Iterator):
        self.iterator = iterator
        self.buffer: collections.deque = collections.deque()
        self.drained = False

    def fill(self, size: int) -> None:
        while not self.drained and len(self.buffer) < size:
            try:
                self.buffer.append(next(self.iterator))
            except StopIteration:
                self.drained = True


def _nbytes(batch: Any) -> int:
    total = [0]

    def add(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    try:
        map_tensors(add, batch)
    except Exception:
        return 0
    return total[0]


def rebalanced_without_len(
    dataloader: Iterable,
    counts: list[Optional[int]],
    to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    layout: Optional[Layout] = None,
    channel: Optional[BatchChannel] = None,
    exchange: Optional[Exchange] = None,
) -> tuple[ReadAheadRebalancer, None, bool, None]:
    """``(dataloader, shared length, check_overflow, lengths)`` for the JoinLoader when some rank has no ``len()``.

    The shared length and the lengths are unknown (``None``): every step is agreed, and the
    epoch ends when the rows say every rank and read-ahead buffer is empty.
    """
    return ReadAheadRebalancer(dataloader, counts, to_device, layout, channel, exchange), None, False, None
