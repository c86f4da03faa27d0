"""Whether the model takes a zero-sample batch, known to every rank before any rank needs it.

Where the forward communicates (``SyncBatchNorm``, a module with ``shadow_forward = True``), a shadow microbatch runs
the model's forward on the zero-sample batch (:class:`~composer_join.wrappers.ddp.ZeroSamples`). A model some part of
which cannot take zero samples (Hugging Face GPT-2's attention reshape: ``cannot reshape tensor of 0 elements``) would
raise there on the shadowing rank alone, while the others wait in the next collective until ``dist_timeout``.

:class:`ZeroSampleCheck` tries it first, at the first microbatch of every fit, on every rank: the model's forward on
the microbatch cut to zero samples, with gradients off, its buffers restored, and ``torch.distributed``'s collective
functions replaced by ones that do nothing (so this forward issues none, whatever happens in it); then one exchange
of one integer per rank, so every rank knows which ranks' models refused. A step where some rank would run a
zero-sample microbatch (a rank shadows, or ranks pad to the step's largest microbatch count) then stops every rank,
before any of its collectives, with an :class:`~composer_join.UnevenInputsError` naming the error. Cost, once per fit:
one forward on zero samples and one small all-reduce; nothing on other steps.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from composer_join.core.batches import first_samples
from composer_join.core.catalogue import ZERO_SAMPLES
from composer_join.core.changes import Changes
from composer_join.core.errors import UnevenInputsError
from composer_join.core.plan import StepPlan
from composer_join.core.protocol import Exchange
from composer_join.shadow.buffers import BufferGuard
from composer_join.shadow.shadow import COLLECTIVES

__all__ = ['ZeroSampleCheck', 'zero_sample_error']


class _Done:
    """What a quiet collective returns to a caller that asked for ``async_op=True``."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _quiet(*args: Any, **kwargs: Any) -> Optional[_Done]:
    return _Done() if kwargs.get('async_op') else None


def zero_sample_error(module: torch.nn.Module, batch: Any) -> Optional[str]:
    """What ``module``'s forward raises on ``batch`` cut to zero samples (None if it raises nothing).

    Run with gradients off, no collective issued (``torch.distributed``'s collective functions do nothing meanwhile)
    and ``module``'s buffers restored afterwards; in the mode ``module`` is in (training). Every change is undone.
    """
    import torch.distributed as tdist

    guard = BufferGuard(module)
    with Changes() as changes:
        guard.attach(changes)
        for name in COLLECTIVES:
            if getattr(tdist, name, None) is not None:
                changes.set(tdist, name, _quiet)
        guard.armed = True
        try:
            with torch.no_grad():
                module(first_samples(batch, 0))
        except Exception as e:  # any error: the shadow forward would raise it on the shadowing rank alone
            return f'{type(e).__name__}: {e}'
        finally:
            guard.restore()
    return None


class ZeroSampleCheck:
    """Which ranks' models refuse a zero-sample batch, agreed by every rank at the first microbatch of a fit.

    :meth:`reset` at every fit's start; at each training microbatch's ``BEFORE_FORWARD`` on every rank, :meth:`check`
    (the first one tries the forward and exchanges the result: :func:`zero_sample_error`), then
    :meth:`raise_if_needed` with whether some rank runs a zero-sample microbatch in the step (the same on every rank).
    """

    def __init__(self) -> None:
        self.refused: Optional[list[int]] = None  # ranks whose model refused; None: not tried in this fit
        self.error: Optional[str] = None  # what this rank's model raised

    def reset(self) -> None:
        self.refused, self.error = None, None

    def check(self, module: torch.nn.Module, batch: Any, exchange: Exchange) -> None:
        if self.refused is not None:
            return
        self.error = zero_sample_error(module, batch)
        said = ZERO_SAMPLES.said('whether every rank takes zero samples')
        table = exchange.rows([int(self.error is not None)], said).wait()
        self.refused = [rank for rank, row in enumerate(table) if row[0]]

    def raise_if_needed(self, plan: StepPlan, zero_sample_microbatches: bool) -> None:
        if not self.refused or not zero_sample_microbatches:
            return
        raise UnevenInputsError(
            f'at step {plan.step} some rank must run a shadow microbatch (rank(s) {plan.joined_ranks} shadow, or ranks '
            f"pad to the step's largest microbatch count), and the model's forward communicates (SyncBatchNorm or "
            f'shadow_forward = True), so a shadow microbatch runs it on zero samples; but the model on rank(s) '
            f"{self.refused} cannot take zero samples (tried at the fit's first microbatch"
            + (f': {self.error}' if self.error else '')
            + '). Make every module of the model accept a zero-sample input (a module that communicates must contribute '
            'nothing for it), or give every rank the same number of full batches.'
        )
