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
   batch to give). If there is no donor the rank idles: it shadows this step.
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
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional

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

__all__ = ['READ_AHEAD', 'ReadAheadRebalancer', 'agreement_needed', 'assign', 'rebalanced_without_len']

log = logging.getLogger(__name__)

READ_AHEAD = 2
"""Batches a rank holds in its read-ahead buffer at most, beyond the one it trains next."""


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
    world = len(rows)
    if all(held == 0 for held, _ in rows):
        return None
    cells: list[Optional[int]] = [r if held >= 1 else None for r, (held, _) in enumerate(rows)]
    if not transfers:
        return cells
    given = [0] * world
    for r in range(world):
        if cells[r] is not None:
            continue
        surplus = {q: rows[q][0] - 1 - given[q] for q in range(world) if rows[q][0] >= 1}
        donors = [q for q, s in surplus.items() if s >= 1 or not rows[q][1]]
        if donors:
            donor = max(donors, key=lambda q: (surplus[q], -q))
            cells[r] = donor
            given[donor] += 1
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
        self.assignments: list[Optional[list[Optional[int]]]] = []  # this epoch, per step, as this rank computed it
        self._rows: Optional[list[tuple[int, bool]]] = None  # the last agreed step's (held, drained) per rank
        self._columns = {'held': 0, 'drained': False, 'unsendable': False}
        self._cells: Optional[list[Optional[int]]] = None  # the current step's assignment
        self._bounds: list[tuple[int, bool]] = []  # what the current step's rows are known to be without agreeing
        self.agreed = True  # the step whose batch next() just returned needs an agreement (see agreement_needed)
        self._counts = self._zero_counts()

    def __len__(self) -> int:
        raise TypeError('with rebalancing without len(), the number of batches a rank trains is not known ahead')

    @property
    def length(self) -> Optional[int]:  # not known ahead
        return None

    def _zero_counts(self) -> dict[str, list[int]]:
        return {k: [0] * self.world for k in ('own_batches', 'received_batches', 'given_batches')}

    def used(self, steps: int, trained: int) -> int:
        """Not known here (-1): a rank's position depends on read-ahead buffers that no checkpoint holds, so its
        data is replayed on resumption (:attr:`reads_ahead`), which this rule resumes exactly."""
        return -1

    def planned_locally(self) -> bool:
        """Rule 7: the step whose batch :meth:`epoch` just gave needs no agreement."""
        return not self.agreed

    def counts_per_rank(self) -> dict[str, list[int]]:
        """Per rank: batches trained from its own shard, received, given away (this epoch, from the agreements)."""
        return {k: list(v) for k, v in self._counts.items()}

    # -- the JoinLoader's hooks ----------------------------------------------------------------

    def status_columns(self) -> dict[str, Any]:
        """This rank's columns for the row of the step whose batch ``next()`` just returned."""
        return dict(self._columns)

    def observe(self, plan: StepPlan) -> None:
        """Take a step's plan: the levels for the next step's assignment, and the report's counts.

        For a step that needed no agreement (:attr:`agreed` False; the JoinLoader's local plan, in
        which every rank has a batch), the levels are the lower bounds the last agreed rows imply.
        """
        statuses = plan.statuses
        cells = self._cells or [None] * len(statuses)
        for r, (cell, s) in enumerate(zip(cells, statuses)):
            if cell is None or not s.has_batch:
                continue
            if cell == r:
                self._counts['own_batches'][r] += 1
            else:
                self._counts['received_batches'][r] += 1
                self._counts['given_batches'][cell] += 1
        self._rows = [(s.held, s.drained) for s in statuses] if plan.agreed else self._bounds
        unsendable = [r for r, s in enumerate(statuses) if s.unsendable]
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
        self._counts, self.assignments, self._rows = self._zero_counts(), [], None
        self.agreed = True
        source = _Source(open(False))
        self._rows = self._first_rows(source)
        deferred: Optional[BaseException] = None  # a read error on a step that needed no agreement
        step = 0
        while True:
            self.agreed = True
            if self._rows is None:  # the JoinLoader did not observe the last step: it stopped
                return
            cells = assign(self._rows, self.transfers, self.layout)
            self.agreed = agreement_needed(self._rows)
            self._cells, self._bounds, self._rows = cells, [(held - 1, d) for held, d in self._rows], None
            self.assignments.append(cells)
            if cells is None:
                return
            if deferred is not None and self.agreed:  # the JoinLoader's agreement tells every rank
                raise deferred
            mine = cells[self.rank]
            if mine == self.rank:
                batch = source.buffer.popleft()
            elif mine is None:
                batch = IDLE
            else:
                batch = self._receive_gift(mine, step)
            receivers = [q for q, c in enumerate(cells) if c == self.rank and q != self.rank]
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

    def _first_rows(self, source: _Source) -> list[tuple[int, bool]]:
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
        table = self.exchange.rows(row, said).wait()
        rows = [(int(h), bool(d)) for h, d in table]
        if failure is not None:
            raise failure
        failed = [r for r, (h, _) in enumerate(rows) if h < 0]
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
