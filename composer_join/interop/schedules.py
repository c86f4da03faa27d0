"""Learning-rate schedules that read the agreed epoch length from a fit's first step.

Composer compiles its schedulers (``CosineAnnealingScheduler``, ``StepScheduler``, a warmup in epochs or as a fraction
of the duration, ...) into torch ``LambdaLR`` objects as soon as it has a train dataloader: in ``Trainer(...)``, and
again in ``fit(train_dataloader=..., schedulers=...)``. ``LambdaLR``'s constructor sets the current learning rate
then, from ``state.dataloader_len``, which is still each rank's own ``len()``: before any event UnevenJoin could
answer. The ranks' first steps would then use different learning rates and the replicas drift apart.

:func:`agree_schedules` is called on every rank at ``FIT_START``, once the agreed length is in
``state.dataloader_len`` (the longest rank's, :func:`~composer_join.join.loader.join_dataloader`) and before the
fit's first optimizer step: every ``LambdaLR`` that has not stepped since it was made (``last_epoch == 0``: made
for this fit, or by the ``Trainer`` and not loaded from a checkpoint) sets its current learning rate again, the way
its constructor did, now from the agreed length. A scheduler that has stepped set its learning rate at its last
step, while the agreed length was in force (or a checkpoint restored it); other torch schedulers do not read
Composer's state. On even data the value is the same bit for bit. Cost: one call of each schedule's function, per
fit, no collective.

Example::

    agree_schedules(state)  # at FIT_START, after the length agreement
"""

from __future__ import annotations

import torch
from composer.core import State
from torch.optim.lr_scheduler import LambdaLR

from composer_join.core import compat

__all__ = ['agree_schedules']


def agree_schedules(state: State) -> None:
    """Set every unstepped ``LambdaLR``'s current learning rate again from ``state`` as it is now (see the module)."""
    for scheduler in state.schedulers:
        if not isinstance(scheduler, LambdaLR) or scheduler.last_epoch != 0:
            continue
        rates = [base * lmbda(0) for base, lmbda in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, rate in zip(scheduler.optimizer.param_groups, rates):
            if isinstance(group['lr'], torch.Tensor):  # a tensor learning rate, filled as torch's own step() does
                group['lr'].fill_(rate)
            else:
                group['lr'] = rate
        compat.set_last_lr(scheduler, [group['lr'] for group in scheduler.optimizer.param_groups])
