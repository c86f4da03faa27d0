"""What a step is, as every rank knows it: each rank's row (:class:`RankStatus`) and the common :class:`StepPlan`.

Owns the data of the per-step agreement and nothing that communicates: no collective, no Composer, so that the
join's decisions (:mod:`composer_join.core.protocol`) are tested in one process. On a step that needs it, every
rank contributes one row and receives everybody's rows (one small all-reduce, a ``world_size x 13`` integer
table, over the injected exchange: :class:`~composer_join.core.protocol.Exchange`; the real one is
:class:`~composer_join.core.exchange.TorchExchange`), kept as that table (:class:`Statuses`): each decision is an
array operation on its columns, with no per-rank Python object. From the rows each rank derives the same :class:`StepPlan`, so
every decision that follows (shadow or real, gradient factor, buffer source, microbatch syncing, stop or go) is
taken identically everywhere without further communication.

When every rank's dataloader has a ``len()``, the epoch-start length exchange already says that every rank has a
batch at each of the first :func:`steps_planned_from_lengths` steps; those steps get a local plan
(:func:`plan_from_lengths`) and no collective at all. Only the steps from the shortest rank's last batch on are
agreed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, Union, overload

import numpy as np

__all__ = [
    'COLUMNS',
    'RankStatus',
    'Statuses',
    'StepPlan',
    'len_or_none',
    'plan_from_lengths',
    'steps_planned_from_lengths',
]


@dataclass(frozen=True)
class RankStatus:
    """One rank's contribution to the agreement for one step."""

    has_batch: bool
    samples: int = -1  # -1: could not be counted
    microbatches: int = 0  # 0: unknown
    needs_template: bool = False  # has no batch and has never seen one: must be sent a template
    overflow: bool = False  # its dataloader yielded more batches than the shared length
    failed: bool = False  # its dataloader raised
    unreported_samples: int = 0  # samples of its batches on steps planned from len() alone (-1: uncountable)
    structure: int = 0  # structure.fingerprint of its batch, or of the template it shadows with; 0: none
    short: bool = False  # its dataloader ran out before yielding the batches its len() promised
    held: int = 0  # rebalancing without len(): own batches in its read-ahead buffer (composer_join.rebalance.readahead)
    drained: bool = False  # rebalancing without len(): its own dataloader has ended
    unsendable: bool = False  # rebalancing without len(): it holds a batch that cannot be sent
    content: int = 0  # under tensor parallelism: batches.content_crc of its batch (0: none, or not taken)

    def row(self) -> list[int]:
        return [int(getattr(self, name)) for name in COLUMNS]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> RankStatus:
        """The inverse of :meth:`row`."""
        values: list[Any] = [int(v) for v in row]
        for i in _FLAGS:
            values[i] = bool(values[i])
        return cls(*values)


COLUMNS = tuple(f.name for f in fields(RankStatus))
"""The agreement table's columns, in order: one per :class:`RankStatus` field (13)."""
_COLUMN = {name: i for i, name in enumerate(COLUMNS)}
_FLAGS = tuple(i for i, f in enumerate(fields(RankStatus)) if f.type == 'bool')  # (types are strings here)


class Statuses(Sequence[RankStatus]):
    """Every rank's row of one step, as the agreement's table (``world_size x 13`` integers, :data:`COLUMNS`).

    A sequence of :class:`RankStatus` (``statuses[rank]`` builds that rank's on access), and columns for the array
    operations a plan's decisions are made of (:meth:`column`), so that no per-rank Python object is made on the
    hot path. A step planned without agreement (:meth:`planned`) holds only this rank's row and the row every other
    rank is known by: nothing in it is proportional to the world size until a column is asked for.
    """

    __slots__ = ('_planned', '_table', '_world')

    def __init__(self, table: Any):
        self._table: Optional[np.ndarray] = np.asarray(table, dtype=np.int64).reshape(-1, len(COLUMNS))
        self._world = len(self._table)
        self._planned: Optional[tuple[int, RankStatus, RankStatus]] = None

    @classmethod
    def planned(cls, world: int, rank: int, own: RankStatus, others: RankStatus) -> Statuses:
        """``own`` at ``rank``, ``others`` everywhere else (no table made)."""
        out = cls.__new__(cls)
        out._table, out._world, out._planned = None, world, (rank, own, others)
        return out

    @classmethod
    def of(cls, statuses: Sequence[RankStatus]) -> Statuses:
        """``statuses`` as a table (itself if it is one)."""
        if isinstance(statuses, Statuses):
            return statuses
        return cls([s.row() for s in statuses] if len(statuses) else np.zeros((0, len(COLUMNS))))

    @property
    def uniform(self) -> Optional[tuple[int, RankStatus, RankStatus]]:
        """``(rank, own, others)`` for a step planned without agreement, else None."""
        return self._planned

    @property
    def table(self) -> np.ndarray:
        """The ``world_size x 13`` table (made on first use for a planned step)."""
        if self._table is None:
            rank, own, others = self._planned  # type: ignore[misc]  # one of the two is set
            table = np.tile(np.asarray(others.row(), dtype=np.int64), (self._world, 1))
            if self._world:
                table[rank] = own.row()
            self._table = table
        return self._table

    def column(self, name: str) -> np.ndarray:
        """Every rank's value of field ``name``, indexed by rank."""
        return self.table[:, _COLUMN[name]]

    def value(self, rank: int, name: str) -> int:
        """Rank ``rank``'s value of field ``name`` (no :class:`RankStatus` made)."""
        if self._planned is not None:
            own_rank, own, others = self._planned
            return int(getattr(own if rank == own_rank else others, name))
        return int(self.table[rank, _COLUMN[name]])

    def ranks(self, name: str) -> list[int]:
        """The ranks whose field ``name`` is nonzero (true)."""
        if self._planned is not None:
            rank, own, others = self._planned
            if not getattr(others, name):
                return [rank] if getattr(own, name) else []
        return np.flatnonzero(self.column(name)).tolist()

    def count(self, name: str) -> int:
        """How many ranks' field ``name`` is nonzero (true)."""
        if self._planned is not None:
            _, own, others = self._planned
            return (self._world - 1) * bool(getattr(others, name)) + bool(getattr(own, name))
        return int(np.count_nonzero(self.column(name)))

    def __len__(self) -> int:
        return self._world

    @overload
    def __getitem__(self, index: int) -> RankStatus: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[RankStatus, ...]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[RankStatus, tuple[RankStatus, ...]]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._world)))
        if index < 0:
            index += self._world
        if not 0 <= index < self._world:
            raise IndexError(index)
        if self._planned is not None:
            rank, own, others = self._planned
            return own if index == rank else others
        return RankStatus.from_row(self.table[index].tolist())

    def __iter__(self) -> Iterator[RankStatus]:
        return (self[i] for i in range(self._world))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Statuses):
            return bool(np.array_equal(self.table, other.table))
        if isinstance(other, Sequence):
            return len(other) == self._world and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the tuple it stands for

    def __repr__(self) -> str:
        return f'Statuses({list(self)!r})'


@dataclass(frozen=True)
class StepPlan:
    """What every rank knows about one step, identical on all ranks.

    Its decisions are array operations on the agreement's table (:class:`Statuses`): per agreed step a few
    operations over ``world_size`` integers, and none proportional to the world size on a planned step.

    Attributes:
        step: index of the step in the epoch (``batch_in_epoch``).
        statuses: each rank's :class:`RankStatus`, indexed by rank (a :class:`Statuses` table, or any sequence).
        agreed: False for a plan derived locally (:func:`plan_from_lengths`), from the ranks' lengths
            alone or (rebalancing without ``len()``) from their read-ahead buffer levels:
            every rank has a batch, but only this rank's own status holds its sample and
            microbatch counts (the others' are unknown: ``-1`` samples, ``0`` microbatches).
    """

    step: int
    statuses: Sequence[RankStatus]
    agreed: bool = True

    @functools.cached_property
    def rows(self) -> Statuses:
        """:attr:`statuses` as a table."""
        return Statuses.of(self.statuses)

    @property
    def world_size(self) -> int:
        return len(self.statuses)

    @functools.cached_property
    def active_ranks(self) -> list[int]:
        """Ranks that train on a real batch at this step."""
        if self.num_active == self.world_size:
            return list(range(self.world_size))
        return self.rows.ranks('has_batch')

    @functools.cached_property
    def joined_ranks(self) -> list[int]:
        """Ranks that have run out of data and shadow this step."""
        if self.num_active == self.world_size:
            return []
        return np.flatnonzero(self.rows.column('has_batch') == 0).tolist()

    @functools.cached_property
    def num_active(self) -> int:
        return self.rows.count('has_batch')

    @property
    def any_joined(self) -> bool:
        """Some rank shadows this step: ``bool(joined_ranks)``, without listing them."""
        return self.num_active < self.world_size

    def has_batch(self, rank: int) -> bool:
        return bool(self.rows.value(rank, 'has_batch'))

    def ranks_where(self, name: str) -> list[int]:
        """The ranks whose :class:`RankStatus` field ``name`` is true (nonzero): ``failed``, ``short``, ..."""
        return self.rows.ranks(name)

    def grad_factor(self, divide_by_initial_world_size: bool) -> float:
        """Factor on top of the mean over real samples: ``A_t / W`` or ``1``."""
        return self.num_active / self.world_size if divide_by_initial_world_size else 1.0

    @functools.cached_property
    def even_microbatches(self) -> bool:
        """True when every rank splits this step into the same, known number of microbatches."""
        uniform = self.rows.uniform
        if uniform is not None:
            _, own, others = uniform
            kinds = {own.microbatches} if self.world_size == 1 else {own.microbatches, others.microbatches}
            return len(kinds) == 1 and 0 not in kinds
        counts = self.rows.column('microbatches')
        return bool(len(counts)) and bool(counts[0] != 0) and bool((counts == counts[0]).all())

    @property
    def all_counted(self) -> bool:
        """Every rank's samples are known (none ``-1``)."""
        uniform = self.rows.uniform
        if uniform is not None:
            return uniform[1].samples >= 0 and (self.world_size == 1 or uniform[2].samples >= 0)
        return bool((self.rows.column('samples') >= 0).all())

    def recounted(self, microbatch_size: Any) -> StepPlan:
        """This plan with each rank's microbatch count for ``microbatch_size``, from its agreed samples.

        Composer's automatic microbatching halves the microbatch size after a CUDA OOM and splits
        the same batch again; the counts taken when the batch was fetched (a step ahead) are then
        stale. A rank with a batch splits into ``ceil(samples / microbatch_size)`` (at least one,
        Composer's default split), a shadowing rank into one; a rank whose samples are unknown
        (a step planned from the lengths, an uncountable batch) gets ``0``, unknown. No communication.
        """
        known = isinstance(microbatch_size, int) and microbatch_size > 0

        def count(s: RankStatus) -> int:
            if not s.has_batch:
                return s.microbatches
            if s.samples < 0 or not known:
                return 0
            return max(1, -(-s.samples // microbatch_size))

        uniform = self.rows.uniform
        if uniform is not None:
            rank, own, others = uniform
            statuses = Statuses.planned(
                self.world_size,
                rank,
                replace(own, microbatches=count(own)),
                replace(others, microbatches=count(others)),
            )
            return replace(self, statuses=statuses)
        table = self.rows.table.copy()
        has, samples = table[:, _COLUMN['has_batch']] != 0, table[:, _COLUMN['samples']]
        if known:
            recount = np.where(samples < 0, 0, np.maximum(1, -(-samples // microbatch_size)))
        else:
            recount = np.zeros_like(samples)
        table[:, _COLUMN['microbatches']] = np.where(has, recount, table[:, _COLUMN['microbatches']])
        return replace(self, statuses=Statuses(table))

    @functools.cached_property
    def structures_differ(self) -> bool:
        """True on a step where some rank shadows and the ranks' batch structures (real or template) differ."""
        if not self.any_joined or not self.num_active:
            return False
        known = self.rows.column('structure')
        known = known[known != 0]
        return bool(len(known)) and bool((known != known[0]).any())

    @property
    def template_needed(self) -> bool:
        """Some rank has never seen a batch and must be sent a template."""
        return self.rows.count('needs_template') > 0

    @functools.cached_property
    def template_source(self) -> Optional[int]:
        """Lowest rank with data, if some rank needs a template batch at this step."""
        if self.template_needed and self.num_active:
            return int(np.argmax(self.rows.column('has_batch') != 0))
        return None


def steps_planned_from_lengths(lengths: Optional[Sequence[Optional[int]]], shared: Optional[int]) -> int:
    """How many leading steps of an epoch need no agreement: every rank has a batch there and none is at its last.

    That is ``min(lengths + [shared]) - 1`` steps (never fewer than 0), and 0 when some rank's
    length is unknown. The steps from the shortest rank's last batch on are agreed: there batches
    may be partial or missing, microbatch counts may differ, and a ``len()`` that understates
    shows. ``shared`` caps it when the trainer asked for fewer batches than a dataloader has.

    Example:
        >>> steps_planned_from_lengths([5, 3, 4], 5), steps_planned_from_lengths([5, None], None)
        (2, 0)
    """
    if shared is None or lengths is None or any(n is None for n in lengths):
        return 0
    return max(0, min([*lengths, shared]) - 1)  # type: ignore[type-var, operator]  # no None left (checked above)


def plan_from_lengths(step: int, rank: int, own: RankStatus, world_size: int) -> StepPlan:
    """The plan of a step at which every rank is known to have a batch, derived locally.

    Such steps are those before any rank's last batch, and (rebalancing without ``len()``) those
    :func:`composer_join.rebalance.readahead.agreement_needed` says need no agreement.

    Only ``own`` (this rank's status) is known in full; the other ranks' sample and microbatch
    counts are unknown, so :attr:`StepPlan.even_microbatches` is False: under ``multi_auto_sync``
    every rank then syncs its gradient on its own last microbatch only, which needs no knowledge
    of the others' counts. No communication.
    """
    return StepPlan(step, Statuses.planned(world_size, rank, own, RankStatus(has_batch=True)), agreed=False)


def len_or_none(dataloader: Any) -> Optional[int]:
    """``len(dataloader)``, or None for a dataloader without one (what :func:`~composer_join.core.exchange.agree_on_length` takes)."""
    try:
        return len(dataloader)
    except (TypeError, NotImplementedError):
        return None
