"""Algorithms that reshape the batch at ``AFTER_DATALOADER``: the step's plan learns the new counts.

UnevenJoin agrees on each rank's samples and microbatches when the dataloader yields a batch
(:mod:`composer_join.core.plan`). Some of Composer's algorithms change the batch afterwards, at
``AFTER_DATALOADER``, before Composer splits it into microbatches: Alibi's
``train_sequence_length_scaling`` reshapes ``4 x 16`` tokens into ``16 x 4``, SelectiveBackprop
keeps a fraction of the samples. The predicted microbatch counts are then wrong, and with them the
gradient syncs (DDP) and the padding (FSDP) that depend on them. :func:`replan` runs after those
algorithms, on every rank, on every step where some algorithm ran at ``AFTER_DATALOADER``
(:mod:`composer_join.join.passes` decides that the same way on every rank), and gathers each rank's
actual counts. Cost on such steps: one all-gather of two integers per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from composer.utils import dist

from composer_join.core.plan import StepPlan

__all__ = ['replan']


def replan(
    plan: StepPlan,
    samples: int,
    microbatches: int,
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> StepPlan:
    """``plan`` with every rank's (samples, microbatches) as the ranks' batches now are; this rank's are given."""
    mine = to_device(torch.tensor([samples, microbatches], dtype=torch.int64))
    gathered = dist.all_gather(mine)
    statuses = tuple(
        dataclasses.replace(status, samples=int(counts[0]), microbatches=int(counts[1]))
        for status, counts in zip(plan.statuses, gathered)
    )
    return dataclasses.replace(plan, statuses=statuses)
