"""Per-epoch accounting: what each rank trained, what it shadowed, and what stock Composer would have dropped."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from composer_join.core.plan import StepPlan

__all__ = ['EpochReport']


_COUNTS = frozenset({'real_batches', 'real_samples', 'shadow_steps', 'tail_samples', '__dict__'})
_KEYS = ('real_batches', 'real_samples', 'shadow_steps', 'tail_samples')


@dataclass
class EpochReport:
    """Counts for one epoch, the same on every rank (from the agreements, and the lengths for planned steps).

    A summary per rank, not a record per step: every field is one number per rank (or per epoch), so a report is
    ``O(W)`` whatever the epoch's length, and so is what it adds to a checkpoint (:meth:`state`).

    Attributes:
        epoch: the epoch's index.
        real_batches: per rank, batches trained on real data.
        real_samples: per rank, samples in those batches (as Composer counts them; -1 if uncountable).
        shadow_steps: per rank, steps taken on a shadow batch after running out.
        tail_samples: per rank, samples in its batches of the steps at which some rank had no batch (-1 if one of
            them was uncountable). With ``mode='shadow'`` (a rank that ran out stays out) these are its batches past
            the shortest rank's count: what stock Composer, which ends the epoch there, would not train of it.
        own_batches, received_batches, given_batches, bytes_sent: with ``mode='rebalance'`` only
            (empty otherwise): per rank, batches trained from its own shard, received from other
            ranks, given to other ranks, and bytes it sent (headers included).
        tensor_parallel: ranks per data-parallel member (:mod:`composer_join.core.layout`); above 1, "rank" above
            and in :meth:`metrics` is the data-parallel rank, each TP group counted once (its bytes: all its ranks').

    ``batch_sizes`` (per rank, the size of each real batch: 4 bytes per rank per step, 8 MB for 2,000 steps at
    W=4,096, in every checkpoint) is deprecated and no longer recorded: reading it warns and gives an empty list per rank.
    ``tail_samples`` and :attr:`stock_dropped_samples` hold what it was read for; a state or pickle that holds it
    (0.1.0) loads as its summary (:meth:`from_state`).

    Recording a step (:meth:`record`) makes no per-rank Python object and keeps nothing per step: a step planned from
    the lengths is counted, an agreed step's columns are added to counts kept as arrays (a few array operations over
    the ranks); the lists above are made from them when read. For example, with rank 1 out after two steps::

        report = EpochReport(epoch=0, world_size=2)
        for sizes in ([8, 8], [8, 5], [4, None]):  # None: no batch
            report.record(StepPlan(0, tuple(RankStatus(s is not None, s or 0, 1) for s in sizes)))
        report.real_samples, report.tail_samples, report.stock_dropped_samples  # [20, 13], [4, 0], 4
    """

    # _counts: (batches, samples, shadows, tails) as arrays, newer than the lists (None: the lists are current);
    # _planned: planned steps not yet in _counts
    __slots__ = ('__dict__', '__weakref__', '_counts', '_planned')

    epoch: int
    world_size: int
    real_batches: list[int] = field(default_factory=list)
    real_samples: list[int] = field(default_factory=list)
    shadow_steps: list[int] = field(default_factory=list)
    tail_samples: list[int] = field(default_factory=list)
    own_batches: list[int] = field(default_factory=list)
    received_batches: list[int] = field(default_factory=list)
    given_batches: list[int] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    tensor_parallel: int = 1

    def __post_init__(self):
        w = self.world_size
        self.real_batches = self.real_batches or [0] * w
        self.real_samples = self.real_samples or [0] * w
        self.shadow_steps = self.shadow_steps or [0] * w
        self.tail_samples = self.tail_samples or [0] * w
        self._counts: Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = None
        self._planned = 0

    def __getattribute__(self, name: str) -> Any:
        if name in _COUNTS:
            _fold(self)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _COUNTS:
            _fold(self)
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(_summarised(dict(state)))
        self._counts, self._planned = None, 0

    @property
    def batch_sizes(self) -> list[list[int]]:
        """Deprecated, no longer recorded: an empty list per rank (see the class's docstring); will be removed."""
        warnings.warn(
            'EpochReport.batch_sizes is deprecated and no longer recorded (per step per rank, it made every '
            'checkpoint O(W x steps)): it is an empty list per rank. Read tail_samples or stock_dropped_samples.',
            DeprecationWarning,
            stacklevel=2,
        )
        return [[] for _ in range(self.world_size)]

    def state(self) -> dict[str, Any]:
        """Its fields as plain data, copied (what a checkpoint holds; ``EpochReport(**state)`` is it again): ints and
        lists of ints, ``O(W)``."""
        return {k: list(x) if isinstance(x, list) else x for k, x in vars(self).items()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpochReport:
        """The report of a :meth:`state`, or of an older one (0.1.0) that holds ``batch_sizes`` lists: those are
        summarised into ``tail_samples`` (each rank's sizes past the shortest rank's count) and not kept."""
        return cls(**_summarised(dict(state)))

    def record(self, plan: StepPlan) -> None:
        """Add one step (called by the loader once per step, agreed or planned from the lengths).

        A planned step: every rank has a batch, whose size reaches every rank later, as ``unreported_samples``.
        """
        if not plan.agreed:
            self._planned += 1
            return
        counts = self._counts
        if counts is None:
            d = object.__getattribute__(self, '__dict__')  # (not self.__dict__: that folds the counts kept)
            batches, samples, shadows, tails = (np.asarray(d[k], dtype=np.int64) for k in _KEYS)
            self._counts = (batches, samples, shadows, tails)
        else:
            batches, samples, shadows, tails = counts
        if self._planned:
            batches += self._planned
            self._planned = 0
        rows = plan.rows
        has, n, unreported = rows.column('has_batch') != 0, rows.column('samples'), rows.column('unreported_samples')
        # a count that met one uncountable batch stays -1 (-1 in unreported: uncountable)
        bad = (samples < 0) | (unreported < 0) | (has & (n < 0))
        samples += unreported + np.where(has, n, 0)
        samples[bad] = -1
        batches += has
        shadows += ~has
        if not has.all():  # a step of the tail (planned steps never are: every rank has a batch)
            tail_bad = (tails < 0) | (has & (n < 0))
            tails += np.where(has, n, 0)
            tails[tail_bad] = -1

    @property
    def steps(self) -> int:
        return max(self.real_batches, default=0)

    @property
    def rebalanced(self) -> bool:
        return bool(self.own_batches)

    @property
    def bytes_moved(self) -> int:
        """Bytes sent between ranks this epoch to rebalance (0 in ``mode='shadow'``)."""
        return sum(self.bytes_sent)

    @property
    def shard_batches(self) -> list[int]:
        """Per rank, the batches of its own shard (trained by it or given away)."""
        if self.rebalanced:
            return [o + g for o, g in zip(self.own_batches, self.given_batches)]
        return self.real_batches

    @property
    def stock_dropped_batches(self) -> int:
        """Batches stock Composer would not train: it ends every epoch at the shortest rank."""
        shortest = min(self.shard_batches, default=0)
        return sum(n - shortest for n in self.shard_batches)

    @property
    def stock_dropped_samples(self) -> int:
        """Samples in those batches (-1 if some could not be counted, or the run rebalanced batches)."""
        if self.rebalanced:
            return -1
        tails = self.tail_samples
        return -1 if any(s < 0 for s in tails) else sum(tails)

    def metrics(self) -> dict[str, int]:
        """The report as Composer logger metrics, under ``uneven_join/``."""
        out = {
            'uneven_join/epoch_steps': self.steps,
            'uneven_join/stock_would_drop_batches': self.stock_dropped_batches,
            'uneven_join/stock_would_drop_samples': self.stock_dropped_samples,
        }
        for rank in range(self.world_size):
            out[f'uneven_join/rank_{rank}/real_batches'] = self.real_batches[rank]
            out[f'uneven_join/rank_{rank}/real_samples'] = self.real_samples[rank]
            out[f'uneven_join/rank_{rank}/shadow_steps'] = self.shadow_steps[rank]
            if self.rebalanced:
                out[f'uneven_join/rank_{rank}/own_batches'] = self.own_batches[rank]
                out[f'uneven_join/rank_{rank}/received_batches'] = self.received_batches[rank]
                out[f'uneven_join/rank_{rank}/given_batches'] = self.given_batches[rank]
                out[f'uneven_join/rank_{rank}/bytes_sent'] = self.bytes_sent[rank]
        if self.rebalanced:
            out['uneven_join/bytes_moved'] = self.bytes_moved
        return out

    def summary(self) -> str:
        """A few lines for people: per rank, real batches, samples and shadow steps."""
        lines = [f'epoch {self.epoch}: {self.steps} steps on all ranks']
        for rank in range(self.world_size):
            moved = (
                f': {self.own_batches[rank]} own, {self.received_batches[rank]} received, '
                f'{self.given_batches[rank]} given away'
                if self.rebalanced
                else ''
            )
            who = f'data-parallel rank {rank}' if self.tensor_parallel > 1 else f'rank {rank}'
            lines.append(
                f'  {who}: {self.real_batches[rank]} real batches ({self.real_samples[rank]} samples){moved}, '
                f'{self.shadow_steps[rank]} shadow steps',
            )
        if self.rebalanced:
            lines.append(f'  {self.bytes_moved} bytes moved between ranks')
            lines.append(f'  stock Composer would have dropped {self.stock_dropped_batches} batches')
        else:
            lines.append(
                f'  stock Composer would have dropped {self.stock_dropped_batches} batches '
                f'({self.stock_dropped_samples} samples)',
            )
        return '\n'.join(lines)


def _fold(report: EpochReport) -> None:
    """Make ``report``'s count lists current from what :meth:`EpochReport.record` kept since."""
    get, put = object.__getattribute__, object.__setattr__
    try:
        counts, planned = get(report, '_counts'), get(report, '_planned')
    except AttributeError:  # while the dataclass's __init__ runs
        return
    if counts is None and not planned:
        return
    d = get(report, '__dict__')
    put(report, '_counts', None)
    put(report, '_planned', 0)
    batches = counts[0] if counts is not None else np.asarray(d['real_batches'], dtype=np.int64)
    d['real_batches'] = (batches + planned).tolist()
    if counts is not None:
        d['real_samples'], d['shadow_steps'], d['tail_samples'] = (c.tolist() for c in counts[1:])


def _summarised(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its ``batch_sizes`` lists (0.1.0), if any, made ``tail_samples``: per rank, the sizes past the
    shortest rank's count (``-1`` among them, a planned step's or an uncountable batch's: -1)."""
    sizes = state.pop('batch_sizes', None)
    if sizes is not None and 'tail_samples' not in state:
        shortest = min(state.get('real_batches') or [len(s) for s in sizes], default=0)
        state['tail_samples'] = [-1 if any(v < 0 for v in s[shortest:]) else sum(s[shortest:]) for s in sizes]
    return state
