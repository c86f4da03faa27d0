"""Algorithms that reshape the batch at ``AFTER_DATALOADER``: the step's plan learns the new counts.

UnevenJoin agrees on each rank's samples and microbatches when the dataloader yields a batch
(:mod:`composer_join.core.plan`). Some of Composer's algorithms change the batch afterwards, at
``AFTER_DATALOADER``, before Composer splits it into microbatches: Alibi's
``train_sequence_length_scaling`` reshapes ``4 x 16`` tokens into ``16 x 4``, SelectiveBackprop
keeps a fraction of the samples. The predicted microbatch counts are then wrong, and with them the
gradient syncs (DDP) and the padding (FSDP) that depend on them. So are they where a ``DataSpec``'s
``batch_transforms`` changes the batch's samples (two views of each, say): Composer applies it before it counts and
before ``AFTER_DATALOADER``, and UnevenJoin, which reads the batch a step ahead, does not call it there (it may be
costly or random). :func:`replan` runs after those algorithms, on every rank, on every step where some rank's
trainer has other algorithms or its train ``DataSpec`` a ``batch_transforms`` of the user's (facts of the first
agreement, :class:`~composer_join.core.settings.Facts`: never what an algorithm matches on one rank):

* on a step planned without an agreement (:attr:`~composer_join.core.plan.StepPlan.agreed` False, the same on
  every rank) only this rank's own counts are known, and only they are renewed: no collective (whoever needs the
  others' counts there agrees on them itself, as FSDP's padding does);
* on an agreed step every rank's counts are gathered again over the loader's exchange: one all-reduce of a table of two
  integers per rank (a lost peer named, as at every agreement).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from composer_join.core.catalogue import RECOUNT
from composer_join.core.plan import COLUMNS, Statuses, StepPlan
from composer_join.core.protocol import Exchange

__all__ = ['replan']


def replan(
    plan: StepPlan,
    samples: int,
    microbatches: int,
    exchange: Optional[Exchange],
    rank: int,
) -> StepPlan:
    """``plan`` with the ranks' (samples, microbatches) as their batches now are; this rank's (``rank``) are given,
    the others' gathered over ``exchange`` on an agreed step (the loader's: a lost peer is named, as at every
    agreement).

    Example (a planned step: no collective):
        >>> from composer_join.core.plan import RankStatus, plan_from_lengths
        >>> plan = plan_from_lengths(0, 1, RankStatus(True, 8, 2), 2)
        >>> replan(plan, 4, 1, None, rank=1).statuses[1].samples
        4
    """
    if not plan.agreed:
        own = dataclasses.replace(plan.statuses[rank], samples=samples, microbatches=microbatches)
        uniform = plan.rows.uniform
        if uniform is not None and uniform[0] == rank:  # this rank's row and the others' (nothing per rank)
            return dataclasses.replace(plan, statuses=Statuses.planned(plan.world_size, rank, own, uniform[2]))
        return dataclasses.replace(plan, statuses=tuple(own if r == rank else s for r, s in enumerate(plan.statuses)))
    assert exchange is not None, 'an agreed step is recounted over the exchange it was agreed over'
    said = RECOUNT.said(f'the recount of step {plan.step}')
    gathered = np.asarray(exchange.rows([samples, microbatches], said).array())
    table = plan.rows.table.copy()
    table[:, COLUMNS.index('samples')] = gathered[:, 0]
    table[:, COLUMNS.index('microbatches')] = gathered[:, 1]
    return dataclasses.replace(plan, statuses=Statuses(table))
