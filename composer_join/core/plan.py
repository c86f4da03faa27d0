"""What a step is, as every rank knows it: each rank's row (:class:`RankStatus`) and the common :class:`StepPlan`.

Owns the data of the per-step agreement and nothing that communicates: no collective, no Composer, so that the
join's decisions (:mod:`composer_join.core.protocol`) are tested in one process. On a step that needs it, every
rank contributes one row and receives everybody's rows (one small all-reduce, a ``world_size x 13`` integer
table, over the injected exchange: :class:`~composer_join.core.protocol.Exchange`; the real one is
:class:`~composer_join.core.exchange.TorchExchange`). From the rows each rank derives the same :class:`StepPlan`, so
every decision that follows (shadow or real, gradient factor, buffer source, microbatch syncing, stop or go) is
taken identically everywhere without further communication.

When every rank's dataloader has a ``len()``, the epoch-start length exchange already says that every rank has a
batch at each of the first :func:`steps_planned_from_lengths` steps; those steps get a local plan
(:func:`plan_from_lengths`) and no collective at all. Only the steps from the shortest rank's last batch on are
agreed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

__all__ = [
    'RankStatus',
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


def len_or_none(dataloader: Any) -> Optional[int]:
    """``len(dataloader)``, or None for a dataloader without one (what :func:`~composer_join.core.exchange.agree_on_length` takes)."""
    try:
        return len(dataloader)
    except (TypeError, NotImplementedError):
        return None
