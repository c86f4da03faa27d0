"""Optimizers that branch on the closure's loss take the same branch on a joined rank.

Composer steps every optimizer with a closure that runs the whole step and returns this rank's
total loss. Composer's :class:`~composer.algorithms.SAMOptimizer` runs the closure twice, the
second time only ``if loss:``. A joined rank's loss is weighted zero, so it would skip the second
pass while the others run it, and its collectives would no longer match (gloo aborts, NCCL hangs).
:func:`agree_on_closures` wraps such an optimizer's ``step`` so that, on a shadow step, the closure
returns a loss of one instead of zero: the rank then runs both passes as the others do. Its first
pass gives a zero gradient, hence a zero SAM perturbation, and its second pass a zero gradient: it
contributes nothing, and takes the same optimizer step as every rank. The logged loss is untouched
(Composer logs from the loss dict, not from the closure's return value).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from composer_join.core.changes import Changes

__all__ = ['agree_on_closures']

BRANCHING = ('SAMOptimizer',)  # optimizers known to skip work when the closure's loss is falsy


def agree_on_closures(
    optimizers: Sequence[torch.optim.Optimizer], shadow_step: Callable[[], bool], changes: Changes
) -> None:
    """Wrap the ``step`` of every optimizer in ``optimizers`` that branches on its closure's loss, until ``changes``
    is undone (an optimizer already wrapped is left as it is)."""
    for optimizer in optimizers:
        if type(optimizer).__name__ in BRANCHING and not getattr(optimizer.step, 'composer_join', False):
            changes.set(optimizer, 'step', _agreeing_step(optimizer.step, shadow_step))


def _agreeing_step(step: Callable, shadow_step: Callable[[], bool]) -> Callable:
    @functools.wraps(step)
    def agreeing(closure=None, **kwargs):
        if closure is None:
            return step(closure, **kwargs)

        def joined_closure(*args, **closure_kwargs):
            loss = closure(*args, **closure_kwargs)
            if not shadow_step() or loss is None:
                return loss
            if isinstance(loss, torch.Tensor):
                return loss if loss.any() else torch.ones_like(loss)
            return loss or 1.0  # Composer's closure returns the loss as a Python float

        return step(joined_closure, **kwargs)

    agreeing.composer_join = True  # type: ignore[attr-defined]  # marks it as installed
    return agreeing
