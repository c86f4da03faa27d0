"""The agreement on a step: which ranks still have data, and what every rank needs to know about it.

On a step that needs it, every rank contributes one row (``RankStatus``) and receives everybody's
rows in one small ``all_reduce`` (a ``world_size x 13`` integer tensor). From the rows each rank
derives the same :class:`StepPlan`, so every decision that follows (shadow or real, gradient
factor, buffer source, microbatch syncing, stop or go) is taken identically everywhere without
further communication.

Cost: one asynchronous collective of ``104 * world_size`` bytes per agreed step; :class:`Agreement`
starts it and waits only when the plan is needed, so the loader can start step ``t + 1``'s
agreement while step ``t`` trains.

When every rank's dataloader has a ``len()``, the epoch-start length exchange
(:func:`agree_on_length`) already says that every rank has a batch at each of the first
:func:`steps_planned_from_lengths` steps; those steps get a local plan (:func:`plan_from_lengths`)
and no collective at all. Only the steps from the shortest rank's last batch on are agreed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import torch
from composer.utils import dist

from composer_join.core.peers import lost_peer
from composer_join.core.settings import Facts, mismatch_error
from composer_join.core.settings import check as check_settings

__all__ = [
    'Agreement',
    'RankStatus',
    'StepPlan',
    'agree_on_failures',
    'agree_on_length',
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
        return [int(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_row(cls, row: list[int]) -> RankStatus:
        """The inverse of :meth:`row` (field types are strings here: ``from __future__ import annotations``)."""
        return cls(*(bool(v) if f.type == 'bool' else int(v) for f, v in zip(fields(cls), row)))  # type: ignore[arg-type]


@dataclass(frozen=True)
class StepPlan:
    """What every rank knows about one step, identical on all ranks.

    Attributes:
        step: index of the step in the epoch (``batch_in_epoch``).
        statuses: each rank's :class:`RankStatus`, indexed by rank.
        agreed: False for a plan derived locally (:func:`plan_from_lengths`), from the ranks' lengths
            alone or (rebalancing without ``len()``) from their read-ahead buffer levels:
            every rank has a batch, but only this rank's own status holds its sample and
            microbatch counts (the others' are unknown: ``-1`` samples, ``0`` microbatches).
    """

    step: int
    statuses: tuple[RankStatus, ...]
    agreed: bool = True

    @property
    def world_size(self) -> int:
        return len(self.statuses)

    @property
    def active_ranks(self) -> list[int]:
        """Ranks that train on a real batch at this step."""
        return [r for r, s in enumerate(self.statuses) if s.has_batch]

    @property
    def joined_ranks(self) -> list[int]:
        """Ranks that have run out of data and shadow this step."""
        return [r for r, s in enumerate(self.statuses) if not s.has_batch]

    @property
    def num_active(self) -> int:
        return len(self.active_ranks)

    def has_batch(self, rank: int) -> bool:
        return self.statuses[rank].has_batch

    def grad_factor(self, divide_by_initial_world_size: bool) -> float:
        """Factor on top of the mean over real samples: ``A_t / W`` or ``1``."""
        return self.num_active / self.world_size if divide_by_initial_world_size else 1.0

    @property
    def even_microbatches(self) -> bool:
        """True when every rank splits this step into the same, known number of microbatches."""
        counts = {s.microbatches for s in self.statuses}
        return len(counts) == 1 and 0 not in counts

    def recounted(self, microbatch_size: Any) -> StepPlan:
        """This plan with each rank's microbatch count for ``microbatch_size``, from its agreed samples.

        Composer's automatic microbatching halves the microbatch size after a CUDA OOM and splits
        the same batch again; the counts taken when the batch was fetched (a step ahead) are then
        stale. A rank with a batch splits into ``ceil(samples / microbatch_size)`` (at least one,
        Composer's default split), a shadowing rank into one; a rank whose samples are unknown
        (a step planned from the lengths, an uncountable batch) gets ``0``, unknown. No communication.
        """

        def count(s: RankStatus) -> int:
            if not s.has_batch:
                return s.microbatches
            if s.samples < 0 or not isinstance(microbatch_size, int) or microbatch_size <= 0:
                return 0
            return max(1, -(-s.samples // microbatch_size))

        return replace(self, statuses=tuple(replace(s, microbatches=count(s)) for s in self.statuses))

    @property
    def structures_differ(self) -> bool:
        """True on a step where some rank shadows and the ranks' batch structures (real or template) differ."""
        known = {s.structure for s in self.statuses if s.structure}
        return bool(self.joined_ranks) and bool(self.active_ranks) and len(known) > 1

    @property
    def template_source(self) -> Optional[int]:
        """Lowest rank with data, if some rank needs a template batch at this step."""
        if any(s.needs_template for s in self.statuses) and self.active_ranks:
            return self.active_ranks[0]
        return None


class Agreement:
    """One step's agreement, under way: built on every rank in the same order, then :meth:`plan` waits for it.

    ``where``: the step, for the message a rank gives if a peer is gone while it waits (default ``'step <step>'``).

    Example::

        pending = Agreement(step, RankStatus(has_batch=True, samples=8, microbatches=1))
        ...  # other work; other collectives may be issued meanwhile, in the same order on every rank
        plan = pending.plan()
    """

    def __init__(
        self,
        step: int,
        status: RankStatus,
        to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        where: str = '',
    ):
        self.step, self.where = step, where or f'step {step}'
        self._table, self._work = _exchange_rows(status.row(), to_device)

    def plan(self) -> StepPlan:
        """Wait for every rank's row and return the common plan (a peer gone: :func:`~composer_join.core.peers.lost_peer`)."""
        with lost_peer(f'the agreement on {self.where}'):
            self._work.wait()
        statuses = tuple(RankStatus.from_row(row) for row in self._table.cpu().tolist())
        return StepPlan(step=self.step, statuses=statuses)


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
    others = RankStatus(has_batch=True)
    return StepPlan(step, tuple(own if r == rank else others for r in range(world_size)), agreed=False)


def agree_on_failures(
    failed_step: Optional[int],
    short: bool = False,
    to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> list[Optional[tuple[int, bool]]]:
    """Every rank's ``(failing step, whether it ran short of its len())``, ``None`` where it did not fail.

    One collective, on every rank, for the rare end of a loop that ended before its planned length
    because some rank could not form a batch on a step planned from the lengths (see
    ``JoinLoader.check_ended_together``).
    """
    table, work = _exchange_rows([-1 if failed_step is None else failed_step, int(short)], to_device)
    with lost_peer('the agreement on which ranks could not form a batch'):
        work.wait()
    return [None if step < 0 else (int(step), bool(s)) for step, s in table.cpu().tolist()]


def len_or_none(dataloader: Any) -> Optional[int]:
    """``len(dataloader)``, or None for a dataloader without one (what :func:`agree_on_length` takes)."""
    try:
        return len(dataloader)
    except (TypeError, NotImplementedError):
        return None


def agree_on_length(
    own_len: Optional[int],
    current_len: Optional[int],
    to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    settings: Sequence[int] = (),
    facts: Optional[Facts] = None,
) -> tuple[Optional[int], bool, list[Optional[int]], list[Facts]]:
    """The number of batches every rank runs per epoch: the longest rank's (one collective, per fit or evaluation).

    Args:
        own_len: ``len()`` of this rank's dataloader, or None if it has none.
        current_len: the trainer's ``dataloader_len`` for it (smaller when a subset was asked for).
        settings: this rank's UnevenJoin settings (:func:`composer_join.core.settings.row`), carried in the
            same collective with ``facts``; if given, every rank raises where they differ between ranks, or where
            the collective fails (a rank without UnevenJoin issued a different one).
        facts: what this rank's own objects decide about the collectives that follow
            (:class:`~composer_join.core.settings.Facts`), sent with ``settings``.

    Returns:
        ``(shared, check_overflow, own_lens, facts)``: the shared length (None if some rank's is unknown),
        whether the shared length is the full longest ``len()`` (so batches past it would be lost),
        every rank's own length, and every rank's facts (none without ``settings``).
    """
    facts = facts if facts is not None else Facts()
    extra = [*settings, *facts.row()] if settings else []
    table, work = _exchange_rows(
        [-1 if own_len is None else own_len, -1 if current_len is None else current_len, *extra], to_device
    )
    try:
        work.wait()
    except RuntimeError as e:  # gloo: 'Connection reset by peer' once a rank without UnevenJoin aborted, or a peer died
        if not settings:
            raise
        raise mismatch_error(f'{type(e).__name__}: {e}') from e  # names both causes: they look the same from here
    every = check_settings(table.cpu()[:, 2:].tolist(), facts.label) if settings else []
    own_lens, cur_lens = ([int(v) for v in column] for column in table.cpu().T[:2])
    shared = max(cur_lens) if min(cur_lens) >= 0 else None
    check_overflow = shared is not None and own_lens == cur_lens
    return shared, check_overflow, [None if n < 0 else n for n in own_lens], every


def _exchange_rows(row: list[int], to_device: Callable[[torch.Tensor], torch.Tensor]):
    """Start an all-reduce that gives every rank a ``world_size x len(row)`` table of all ranks' rows.

    Each rank fills only its own row of a zero table, so the sum is every rank's row in place.
    Returns the table (valid once the work is waited for) and the work.
    """
    table = torch.zeros(dist.get_world_size(), len(row), dtype=torch.int64)
    table[dist.get_global_rank()] = torch.tensor(row, dtype=torch.int64)
    table = to_device(table)
    return table, torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.SUM, async_op=True)
