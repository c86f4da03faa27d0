"""The sized rebalance schedule, computed in ``O(W log W + moved log W)`` and kept as its transfers only.

:func:`~composer_join.rebalance.rebalance.schedule`'s rules (its docstring) make every rank train its own batches at
the epoch's first steps, contiguously, and receive from others afterwards. So a rank's own batches are counted by one
number, and only the transfers need to be listed: ``O(batches moved)`` memory instead of one cell per rank per step.

The rules pick, for every dry rank in increasing rank order, the rank with the most batches remaining. Every rank
that still has its own batches trains one per step, so their remaining counts fall together, and their order is
that of ``n_r - given_r`` (its own batches minus those it gave): a heap on that key gives each donor in
``O(log W)``, with no per-step work for ranks that neither give nor receive.

Receivers per donor per step: the rules give to the rank with the most remaining, so a donor gives ``k`` batches in
one step only while it keeps the most, ``k <= R_donor - R_next + 1`` (``R_next``: the next rank's remaining), which
is what keeps the epoch at ``ceil(total / W)`` steps; no constant bounds it (one rank holding every batch gives
``W - 1`` a step). Measured on issue #48's shards (1,000 batches +-10%, 1% empty, 1% double): at most 10 at
W=1,024 and 14 at W=4,096 (``benchmarks/scale.py``). ``max_receivers`` caps it, at the cost of steps where the
spare batches sit on fewer than ``W / (max_receivers + 1)`` ranks.

The plan depends only on the counts, so every rank computes the same one; it is computed once per process for
given counts (a fit's next epoch, and every loader over the same counts, share it).

Example:
    >>> plan = Schedule.of((3, 0))
    >>> plan.length, plan.cell(0, 1), plan.cell(1, 0), plan.cell(1, 1)
    (2, (0, 1), (0, 2), None)
"""

from __future__ import annotations

import bisect
import functools
import heapq
from collections import defaultdict
from collections.abc import Sequence
from typing import Optional

import numpy as np

__all__ = ['Schedule']

Cell = Optional[tuple[int, int]]


class Schedule:
    """Who trains which batch at every step, from the ranks' batch counts (the module docstring says how).

    Attributes:
        counts: every rank's batches per epoch.
        own: per rank, its own batches it trains (at steps ``0 .. own[r] - 1``).
        length: the epoch's steps, ``ceil(sum(counts) / W)`` where every dry rank finds a donor.
    """

    def __init__(self, counts: Sequence[int], max_receivers: Optional[int] = None):
        world = len(counts)
        self.counts = tuple(int(n) for n in counts)
        key = list(self.counts)  # own batches it trains: n_r - given_r
        given = [0] * world
        heap = [(-k, r) for r, k in enumerate(key) if k > 0]
        heapq.heapify(heap)
        becomes_dry: dict[int, list[int]] = defaultdict(list)
        for r, k in enumerate(key):
            becomes_dry[k].append(r)
        dry: list[int] = []  # in increasing rank order
        left, step = sum(self.counts), 0
        steps: list[int] = []  # per transfer, in order: the step, the receiver, the donor, the batch's index
        receivers: list[int] = []
        donors: list[int] = []
        indices: list[int] = []
        while left > 0:
            for r in becomes_dry.pop(step, ()):
                if key[r] == step:
                    bisect.insort(dry, r)
            left -= world - len(dry)  # every rank with its own batches left trains one
            now: dict[int, int] = defaultdict(int)  # batches each donor gave at this step
            full: list[int] = []  # donors that gave max_receivers at this step: out of the heap until the next
            gifts = 0
            for r in dry:
                donor = _top(heap, key, step)
                if donor is None:
                    break
                steps.append(step)
                receivers.append(r)
                donors.append(donor)
                indices.append(step + 1 + given[donor])  # it read the one it trains, then those it gave before
                given[donor] += 1
                key[donor] -= 1
                now[donor] += 1
                gifts += 1
                becomes_dry[key[donor]].append(donor)
                if max_receivers is not None and now[donor] >= max_receivers:
                    heapq.heappop(heap)
                    full.append(donor)
                else:
                    heapq.heapreplace(heap, (-key[donor], donor))
            for donor in full:
                heapq.heappush(heap, (-key[donor], donor))
            left -= gifts
            step += 1
        self.own = key
        self.length = step
        self._given = given
        # the transfers as arrays (16 bytes each), sorted by receiver then step, and by donor then step
        self._step = np.asarray(steps, dtype=np.int64)
        self._receiver = np.asarray(receivers, dtype=np.int64)
        self._donor = np.asarray(donors, dtype=np.int64)
        self._index = np.asarray(indices, dtype=np.int64)
        span = self.length + 1
        self._by_receiver = np.argsort(self._receiver * span + self._step, kind='stable')
        self._receiver_keys = (self._receiver * span + self._step)[self._by_receiver]
        self._donor_keys = self._donor * span + self._step  # transfers are made in step order: stable by donor
        self._by_donor = np.argsort(self._donor_keys, kind='stable')
        self._donor_keys = self._donor_keys[self._by_donor]

    @classmethod
    def of(cls, counts: Sequence[int]) -> Schedule:
        """The schedule for ``counts``, computed once per process (shared by every loader over the same counts)."""
        return _cached(tuple(int(n) for n in counts))

    @property
    def world(self) -> int:
        return len(self.counts)

    def cell(self, step: int, rank: int) -> Cell:
        """``(owner, index)`` of the batch ``rank`` trains at ``step``, or None if it shadows."""
        span = self.length + 1
        if step < self.own[rank]:  # its own: after those it gave at earlier steps
            before = int(np.searchsorted(self._donor_keys, rank * span + step)) - int(
                np.searchsorted(self._donor_keys, rank * span)
            )
            return (rank, step + before)
        at = int(np.searchsorted(self._receiver_keys, rank * span + step))
        if at < len(self._receiver_keys) and self._receiver_keys[at] == rank * span + step:
            t = self._by_receiver[at]
            return (int(self._donor[t]), int(self._index[t]))
        return None

    def receivers(self, rank: int, step: int) -> list[int]:
        """The ranks ``rank`` gives a batch to at ``step``, in order (its batches after the one it trains)."""
        span = self.length + 1
        lo, hi = np.searchsorted(self._donor_keys, [rank * span + step, rank * span + step + 1])
        return self._receiver[self._by_donor[lo:hi]].tolist()

    def given_before(self, rank: int, step: int) -> int:
        """Batches ``rank`` gave at the steps before ``step``."""
        span = self.length + 1
        return int(
            np.searchsorted(self._donor_keys, rank * span + step) - np.searchsorted(self._donor_keys, rank * span)
        )

    @functools.cached_property
    def received(self) -> list[int]:
        return np.bincount(self._receiver, minlength=self.world).tolist()

    @property
    def given(self) -> list[int]:
        return list(self._given)

    @property
    def assigned(self) -> list[int]:
        """Per rank, the batches it trains in an epoch, own and received."""
        return [o + r for o, r in zip(self.own, self.received)]

    @property
    def moved(self) -> int:
        return len(self._step)

    def transfers(self) -> list[tuple[int, int, int, int]]:
        """Every transfer ``(step, receiver, donor, index)``, in the order they are made."""
        return list(zip(self._step.tolist(), self._receiver.tolist(), self._donor.tolist(), self._index.tolist()))

    def most_receivers(self) -> int:
        """The most batches one rank gives in one step."""
        if not len(self._donor_keys):
            return 0
        return int(np.unique(self._donor_keys, return_counts=True)[1].max())

    def rows(self) -> list[list[Cell]]:
        """Every step's cells, per rank (``O(steps x W)``: for tests and small worlds)."""
        return [[self.cell(step, r) for r in range(self.world)] for step in range(self.length)]


def _top(heap: list[tuple[int, int]], key: list[int], step: int) -> Optional[int]:
    """The rank with the most batches remaining after ``step``'s own (ties: the lowest), if it has one to give."""
    while heap:
        k, r = heap[0]
        if -k != key[r]:  # a stale entry: its key has changed since
            heapq.heappop(heap)
            continue
        return r if key[r] - (step + 1) >= 1 else None
    return None


@functools.lru_cache(maxsize=4)
def _cached(counts: tuple[int, ...]) -> Schedule:
    return Schedule(counts)
