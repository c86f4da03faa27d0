"""Per-epoch accounting: what each rank trained, what it shadowed, and what stock Composer would have dropped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from composer_join.core.plan import StepPlan

__all__ = ['EpochReport']


_COUNTS = frozenset({'real_batches', 'real_samples', 'shadow_steps'})
_SIZES = frozenset({'batch_sizes', '__dict__'})
_NONE = np.iinfo(np.int32).min  # in a block of steps' sizes: no batch at that step


@dataclass
class EpochReport:
    """Counts for one epoch, the same on every rank (from the agreements, and the lengths for planned steps).

    Attributes:
        epoch: the epoch's index.
        real_batches: per rank, batches trained on real data.
        real_samples: per rank, samples in those batches (as Composer counts them; -1 if uncountable).
        shadow_steps: per rank, steps taken on a shadow batch after running out.
        batch_sizes: per rank, the sample count of each real batch, in order; ``-1`` on the steps
            planned from the ranks' lengths without an agreement (their samples are counted in
            ``real_samples`` at the first agreed step, the shortest rank's last batch).
        own_batches, received_batches, given_batches, bytes_sent: with ``mode='rebalance'`` only
            (empty otherwise): per rank, batches trained from its own shard, received from other
            ranks, given to other ranks, and bytes it sent (headers included).
        tensor_parallel: ranks per data-parallel member (:mod:`composer_join.core.layout`); above 1, "rank" above
            and in :meth:`metrics` is the data-parallel rank, each TP group counted once (its bytes: all its ranks').

    Recording a step (:meth:`record`) makes no per-rank Python object: a step planned from the lengths is counted,
    an agreed step's columns are added to counts kept as arrays (a few array operations over the ranks); the lists
    above are made from them when read, ``batch_sizes`` from 4 bytes per rank per agreed step kept meanwhile.
    """

    # _counts: (batches, samples, shadows) as arrays, newer than the lists (None: the lists are current);
    # _planned: planned steps not yet in _counts; _sizes: sizes of steps not yet in batch_sizes (int: planned steps)
    __slots__ = ('__dict__', '__weakref__', '_counts', '_planned', '_sizes')

    epoch: int
    world_size: int
    real_batches: list[int] = field(default_factory=list)
    real_samples: list[int] = field(default_factory=list)
    shadow_steps: list[int] = field(default_factory=list)
    batch_sizes: list[list[int]] = field(default_factory=list)
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
        self.batch_sizes = self.batch_sizes or [[] for _ in range(w)]
        self._counts: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self._planned = 0
        self._sizes: list[Any] = []

    def __getattribute__(self, name: str) -> Any:
        if name in _COUNTS or name in _SIZES:
            _fold(self, name in _SIZES)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _COUNTS or name in _SIZES:
            _fold(self, name in _SIZES)
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._counts, self._planned, self._sizes = None, 0, []

    def state(self) -> dict[str, Any]:
        """Its fields as plain data, copied (what a checkpoint holds; ``EpochReport(**state)`` is it again): ints and
        lists of ints only, so a copy of each list is a deep copy, without ``copy.deepcopy``'s visit of every int."""
        return {
            k: [list(v) for v in x] if k == 'batch_sizes' else list(x) if isinstance(x, list) else x
            for k, x in vars(self).items()
        }

    def record(self, plan: StepPlan) -> None:
        """Add one step (called by the loader once per step, agreed or planned from the lengths).

        A planned step: every rank has a batch, whose size reaches every rank later, as ``unreported_samples``.
        """
        sizes = self._sizes
        if not plan.agreed:
            self._planned += 1
            if sizes and isinstance(sizes[-1], int):
                sizes[-1] += 1
            else:
                sizes.append(1)
            return
        counts = self._counts
        if counts is None:
            d = object.__getattribute__(self, '__dict__')  # (not self.__dict__: that folds the sizes kept)
            batches, samples, shadows = (
                np.asarray(d[k], dtype=np.int64) for k in ('real_batches', 'real_samples', 'shadow_steps')
            )
            self._counts = (batches, samples, shadows)
        else:
            batches, samples, shadows = counts
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
        sizes.append(np.where(has, n, _NONE).astype(np.int32))

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
        shortest = min(self.real_batches, default=0)
        tails = [s for sizes in self.batch_sizes for s in sizes[shortest:]]
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


def _fold(report: EpochReport, sizes: bool) -> None:
    """Make ``report``'s count lists current (and, ``sizes``, ``batch_sizes``) from what :meth:`EpochReport.record`
    kept since."""
    get, put = object.__getattribute__, object.__setattr__
    try:
        counts, planned, kept = get(report, '_counts'), get(report, '_planned'), get(report, '_sizes')
    except AttributeError:  # while the dataclass's __init__ runs
        return
    d = get(report, '__dict__')
    if counts is not None or planned:
        put(report, '_counts', None)
        put(report, '_planned', 0)
        batches = counts[0] if counts is not None else np.asarray(d['real_batches'], dtype=np.int64)
        d['real_batches'] = (batches + planned).tolist()
        if counts is not None:
            d['real_samples'], d['shadow_steps'] = counts[1].tolist(), counts[2].tolist()
    if not sizes or not kept:
        return
    put(report, '_sizes', [])
    w = len(d['batch_sizes'])
    block = np.concatenate([np.full((k, w), -1, dtype=np.int32) if isinstance(k, int) else k[None, :] for k in kept])
    complete = (block != _NONE).all(axis=0)
    for lst, column, whole in zip(d['batch_sizes'], block.T.tolist(), complete.tolist()):
        lst.extend(column if whole else [v for v in column if v != _NONE])
