"""Rebalancing: ranks that run out of data train batches that other ranks still have, so no rank idles.

:class:`RebalancingLoader` sits *beneath* the :class:`~composer_join.join.iterator.JoinLoader`: it wraps
one rank's own dataloader and yields the batches this rank trains, its own and those handed to it
by other ranks. Its ``len()`` is this rank's assigned count, so the JoinLoader above it (per-step
agreement, shadowing of the last step, gradient weighting) works unchanged.

The schedule (:func:`schedule`) is computed identically on every rank from every rank's batch
count ``n_r`` (their ``len()``, exchanged once per fit), with no further communication:

    ``R_r = n_r`` batches remain on rank ``r``. At each step, while some ``R_r > 0``:

    1. every rank with ``R_r >= 1`` trains its next own batch (``R_r -= 1``);
    2. every other rank (it had ``R_r = 0``), in increasing rank order, is given one batch by the
       rank with the most batches remaining now (ties to the lowest rank), if that is at least
       one: the donor's next own batch (``R_donor -= 1``); if no rank has one left, it shadows.

Each step trains ``min(W, batches remaining)`` batches, so an epoch lasts ``ceil(sum n_r / W)``
steps, and only its last step can have shadowing ranks. Under tensor parallelism the rules run over
data-parallel members (a TP group's ranks hold the same batches, :mod:`composer_join.core.layout`), and each
member's cell is spread to its ranks: rank ``k`` of a receiving group receives from rank ``k`` of the giving
group, so a group is never split, by construction. A donor reads its own batches in order:
first the one it trains, then those it gives, to the receivers in increasing rank order.

Transfers happen inside ``next()``, which the JoinLoader calls once per step on every rank that
still has assigned batches (for step ``t + 1``, during step ``t``): the donor sends, the receiver
receives, point to point, in the order above, through a :class:`~composer_join.rebalance.transfer.BatchChannel`
(the wire format and its cost are in :mod:`composer_join.rebalance.transfer`). The received batch is already
on the trainer's device, with no copy. If a donor cannot read or pickle a batch (or its dataloader
yields fewer or more batches than its ``len()``) it sends a failure instead, and both ranks yield
:class:`~composer_join.core.source.Failed` rather than raise: the JoinLoader then stops every rank (by its agreement, or, on a
step planned without one, by Composer's per-step all-reduce). A failed loader goes on making the
transfers of the steps it is still asked for (the JoinLoader asks for the one step the other ranks
fetched ahead), sending failures and discarding what it receives, so nothing hangs.

:class:`Rebalancer` is what this loader shares with the one for dataloaders without ``len()``
(:class:`~composer_join.rebalance.readahead.ReadAheadRebalancer`): the wrapped dataloader, the channel, the
epoch report's fields, resumption's counts.

Example (what :func:`~composer_join.join.loader.join_dataloader` does in ``mode='rebalance'``)::

    loader = RebalancingLoader(own_dataloader, counts=[10, 5], own_len=len(own_dataloader))
    loader.length  # 8 steps per epoch on every rank: ceil(15 / 2)
    len(loader)    # this rank's batches: 8 on rank 0 (2 of its 10 given away), 7 on rank 1 (2 received)
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional

import torch

from composer_join.core.catalogue import BYTES_SENT
from composer_join.core.errors import UnevenInputsError
from composer_join.core.exchange import TorchExchange
from composer_join.core.layout import Layout
from composer_join.core.plan import len_or_none
from composer_join.core.report import EpochReport
from composer_join.core.source import BatchSource, Failed, Opener
from composer_join.rebalance.planning import Schedule
from composer_join.rebalance.transfer import BatchChannel

__all__ = ['Rebalancer', 'RebalancingLoader', 'rebalanced', 'schedule']

Cell = Optional[tuple[int, int]]  # (owner rank, index of the batch in the owner's shard), or None: shadow


def schedule(counts: list[int], layout: Optional[Layout] = None) -> list[list[Cell]]:
    """Who trains which batch at every step of an epoch (the rules in the module docstring).

    Returns, per step, per rank, ``(owner, index)`` of the batch that rank trains, or ``None``
    if it shadows. ``layout``: the rules over its members, each member's cell spread to its ranks
    (``counts`` per rank, the same within a member). Cost: ``O(steps * W)`` (every cell listed); the loaders keep
    the plan as its transfers only (:class:`~composer_join.rebalance.planning.Schedule`, ``O(W log W)``).

    Example:
        >>> schedule([3, 0])
        [[(0, 0), (0, 1)], [(0, 2), None]]
        >>> schedule([3, 3, 0, 0], Layout(((0, 1), (2, 3))))[0]  # TP 2: rank 2 receives from 0, rank 3 from 1
        [(0, 0), (1, 0), (0, 1), (1, 1)]
    """
    if layout is not None and layout.tp > 1:
        rows = schedule(layout.leaders(counts))
        return [layout.on_ranks(row, lambda c, r: (layout.counterpart(c[0], r), c[1])) for row in rows]
    return Schedule.of(counts).rows()


class Rebalancer(BatchSource):
    """What both rebalancers share: the wrapped dataloader, the channel, the epoch report's fields, resumption.

    :class:`RebalancingLoader` (every rank has a ``len()``: a planned schedule) and
    :class:`~composer_join.rebalance.readahead.ReadAheadRebalancer` (some rank has none: step by step) are the
    :class:`~composer_join.core.source.BatchSource` of the :class:`~composer_join.join.iterator.JoinLoader` in
    ``mode='rebalance'``, and move batches through a :class:`~composer_join.rebalance.transfer.BatchChannel`.

    Args:
        dataloader: this rank's own dataloader.
        counts: every rank's batches per epoch (the same list on every rank; ``None`` where a rank
            has no ``len()``, with :class:`~composer_join.rebalance.readahead.ReadAheadRebalancer` only).
        to_device: where transferred tensors go (the trainer's device).
        count: a batch's samples, as Composer counts them (-1: uncountable).
        layout: the data-parallel members (default: every rank its own): the batches a rank trains are its
            member's, and the report counts members.
        channel: its transfers' channel (default: a :class:`~composer_join.rebalance.transfer.BatchChannel` over
            ``torch.distributed``).
    """

    ends_with_own_data = False  # the schedule (or the rule) decides when this rank's batches end

    def __init__(
        self,
        dataloader: Iterable,
        counts: Sequence[int],
        to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        count: Callable[[Any], int] = lambda batch: 0,
        layout: Optional[Layout] = None,
        channel: Optional[BatchChannel] = None,
    ):
        super().__init__(dataloader)
        self.counts = list(counts)
        self.layout = layout if layout is not None else Layout.flat(len(self.counts))
        self.to_device = to_device
        self.count = count
        self.channel = channel if channel is not None else BatchChannel(to_device)
        self.rank = self.channel.rank
        self.start = 0  # the step the current epoch's iteration starts at (a dataset that resumed itself)
        self._resumed = (0, 0)  # own samples used and bytes sent in the epoch before a resumed iteration

    def resume(self, used: int, sent: int) -> None:
        self._resumed = (used, sent)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent in the current epoch (its channel's count)."""
        return self.channel.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        self.channel.bytes_sent = value

    @property
    def bytes_received(self) -> int:
        """Bytes this rank received in the current epoch (its channel's count)."""
        return self.channel.bytes_received

    @bytes_received.setter
    def bytes_received(self, value: int) -> None:
        self.channel.bytes_received = value

    @abc.abstractmethod
    def counts_per_rank(self) -> dict[str, list[int]]:
        """Per rank: batches trained from its own shard, received, given away, this epoch."""

    def complete(self, report: EpochReport) -> None:
        """Fill the rebalancing fields of this epoch's ``report``, the same on every rank.

        Called on every rank at ``EPOCH_END``: one all-reduce of ``W`` integers (the bytes each rank sent). Counts
        are per member (its first rank's); bytes, the sum over its ranks (each sends to its counterpart).
        """
        sent = torch.zeros(len(self.counts), dtype=torch.int64)
        sent[self.rank] = self.bytes_sent
        sent = TorchExchange(self.to_device).reduce(
            sent, 'sum', BYTES_SENT.said('the all-reduce of the bytes each rank sent')
        )
        counts = {k: self.layout.leaders(v) for k, v in self.counts_per_rank().items()}
        report.own_batches, report.received_batches, report.given_batches = (
            counts['own_batches'],
            counts['received_batches'],
            counts['given_batches'],
        )
        per_rank = [int(v) for v in sent.cpu().tolist()]
        report.bytes_sent = [sum(per_rank[r] for r in group) for group in self.layout.groups]


class RebalancingLoader(Rebalancer):
    """This rank's batches under the rebalancing :func:`schedule`: its own, minus those it gives, plus those received.

    Args:
        dataloader: this rank's own dataloader; it must yield exactly ``counts[rank]`` batches
            per epoch (more, if ``own_len`` is larger: only the first ``counts[rank]`` are used).
            Where it does not, the step that learns it yields :class:`~composer_join.core.source.Failed`, on every later
            step too, still making those steps' transfers.
        counts: every rank's batches per epoch (the same list on every rank).
        own_len: ``len(dataloader)``; if it equals ``counts[rank]``, a dataloader that yields
            more than that is an error (its extra batches would be lost).
        to_device: where transferred tensors go (the trainer's device).
    """

    def __init__(
        self,
        dataloader: Iterable,
        counts: list[int],
        own_len: Optional[int] = None,
        to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        count: Callable[[Any], int] = lambda batch: 0,
        layout: Optional[Layout] = None,
        channel: Optional[BatchChannel] = None,
    ):
        super().__init__(dataloader, counts, to_device, count, layout, channel)
        self.plan = Schedule.of(self.layout.leaders(self.counts))
        """The schedule over the data-parallel members (one rank per member without tensor parallelism)."""
        self.member = self.layout.member(self.rank)
        self.check_overflow = own_len == self.counts[self.rank]
        self.assigned = self._per_rank(self.plan.assigned)
        """Every rank's batches per epoch under the schedule, own and received."""
        self._read_samples: dict[int, int] = {}  # step -> samples of own batches read for it (trained or given)
        self._sent: dict[int, int] = {}  # step -> bytes sent for it

    @property
    def own_length(self) -> int:  # type: ignore[override]  # always known here
        return self.counts[self.rank]

    def sent(self, steps: int) -> int:
        """Bytes this rank sent for the first ``steps`` steps of the epoch (batches are sent a step ahead)."""
        return (self._resumed[1] if self.start else 0) + sum(n for s, n in self._sent.items() if s < steps)

    def used(self, steps: int, trained: int) -> int:
        """Samples of this rank's own dataloader used by the first ``steps`` steps of the epoch (-1: uncountable)."""
        read = [n for s, n in self._read_samples.items() if s < steps]
        base = self._resumed[0] if self.start else 0
        return -1 if min([base, *read]) < 0 else base + sum(read)

    def make_transfers(self, batches: Iterator[Any], step: int) -> None:
        """Having stopped alone before ``step`` (a step planned from the lengths), make that step's transfers: the
        other ranks fetched it a step ahead, sending to this rank and receiving from it; failed, this loader sends
        failures and discards what it receives, so no rank is left waiting."""
        if step < self.length:
            try:
                next(batches, None)
            except Exception:  # it has failed already: the transfers are what matters here
                pass

    def __len__(self) -> int:
        return self.assigned[self.rank]

    @property
    def length(self) -> int:
        """Steps per epoch on every rank: the longest assigned count."""
        return self.plan.length

    def _per_rank(self, per_member: list[int]) -> list[int]:
        return [per_member[self.layout.member(r)] for r in range(len(self.counts))]

    def counts_per_rank(self) -> dict[str, list[int]]:
        """Per rank: batches trained from its own shard, received, given away (from the schedule)."""
        plan = self.plan
        return {
            'own_batches': self._per_rank(plan.own),
            'received_batches': self._per_rank(plan.received),
            'given_batches': self._per_rank(plan.given),
        }

    def epoch(self, start: int, open: Opener) -> Iterator[Any]:
        self.start = start
        return self._steps(open)

    def _steps(self, open: Opener) -> Iterator[Any]:
        self.bytes_sent, self.bytes_received = self._resumed[1] if self.start else 0, 0
        self._read_samples, self._sent = {}, {}
        reader = _Reader(lambda: open(self.start > 0), self.counts[self.rank], self.check_overflow, self.rank)
        plan, member, layout = self.plan, self.member, self.layout
        reader.read = min(self.start, plan.own[member]) + plan.given_before(member, self.start)
        if self.start:  # a dataset that resumed itself applies its state at its next iteration: this one
            reader._it = reader.open()
        failure: Optional[BaseException] = None  # once set, every later step yields Failed(failure)
        for step in range(self.start, plan.length):
            cell = plan.cell(step, member)
            if cell is None:
                return
            if cell[0] != member:
                try:
                    received = self.channel.receive(layout.counterpart(cell[0], self.rank), step)
                except Exception as e:  # the donor failed
                    failure = failure or e
                yield received if failure is None else Failed(failure)
                continue
            receivers = [layout.counterpart(q, self.rank) for q in plan.receivers(member, step)]
            batches: list[Any] = []
            try:
                if failure is None:
                    for _ in range(1 + len(receivers)):
                        batches.append(reader.next())
                    counts = [self.count(b) for b in batches]
                    self._read_samples[step] = -1 if min(counts) < 0 else sum(counts)
                    reader.check_end()
            except Exception as e:  # the receivers must hear of it, or they would wait forever
                failure = e
            before = self.bytes_sent
            for i, q in enumerate(receivers):
                refused = self.channel.send(batches[i + 1] if failure is None else None, q, step)
                failure = failure or refused
            self._sent[step] = self.bytes_sent - before
            yield batches[0] if failure is None else Failed(failure)


_EXACT = (
    "UnevenJoin(mode='rebalance') plans every rank's batches from the len()s, so they must be exact: make __len__ "
    'match what the dataloader yields (an IterableDataset read by several workers yields one partial batch per '
    'worker), or remove __len__ (rebalancing then reads ahead, step by step)'
)
_MORE = f"{_EXACT}, or use mode='shadow', which treats a len() that undercounts as a hint and trains every batch."


class _Reader:
    """Reads this rank's own batches in order (``open()`` gives their iterator), checking them against their promised count."""

    def __init__(self, open: Callable[[], Iterator[Any]], count: int, check_overflow: bool, rank: int):
        self.open, self.count, self.check_overflow, self.rank = open, count, check_overflow, rank
        self._it: Optional[Iterator] = None
        self.read = 0

    def next(self) -> Any:
        if self._it is None:
            self._it = self.open()
        try:
            batch = next(self._it)
        except StopIteration:
            raise UnevenInputsError(
                f"rank {self.rank}'s dataloader yielded {self.read} batches, fewer than its "
                f'len() {self.count}; {_EXACT}.',
            ) from None
        self.read += 1
        return batch

    def check_end(self) -> None:
        """After the last promised batch: fail if the dataloader has more (they would be silently dropped)."""
        if self.read == self.count and self.check_overflow and self._it is not None:
            try:
                next(self._it)
            except StopIteration:
                return
            raise UnevenInputsError(
                f'the dataloader of rank {self.rank} yielded more than the {self.count} batches per '
                f'epoch its len() promised (len() {self.count}, yielded at least {self.count + 1}); the extra '
                f'batches would be silently dropped. {_MORE}',
            )


def rebalanced(
    dataloader: Iterable,
    counts: list[int],
    shared: Optional[int],
    check_overflow: bool,
    to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    count: Callable[[Any], int] = lambda batch: 0,
    layout: Optional[Layout] = None,
    channel: Optional[BatchChannel] = None,
) -> tuple[RebalancingLoader, Optional[int], bool, list[Optional[int]]]:
    """``(dataloader, shared length, check_overflow, every rank's length)`` for the JoinLoader, rebalanced.

    ``counts`` are every rank's batches per epoch (from the length agreement), all known: when some
    rank has no ``len()``, :func:`~composer_join.join.loader.join_dataloader` uses
    :func:`~composer_join.rebalance.readahead.rebalanced_without_len` instead, which rebalances step by step.
    Returns a :class:`RebalancingLoader`, the steps per epoch (:attr:`RebalancingLoader.length`),
    ``False`` (the loader checks its own dataloader's overflow) and every rank's assigned count
    (:attr:`RebalancingLoader.assigned`), from which the JoinLoader plans the steps before the
    shortest one's last batch without agreeing. ``shared`` and ``check_overflow`` (the length
    agreement's) are replaced by these.
    """
    loader = RebalancingLoader(dataloader, counts, len_or_none(dataloader), to_device, count, layout, channel)
    return loader, loader.length, False, loader.assigned  # type: ignore[return-value]
