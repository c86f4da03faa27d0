"""Composer's automatic microbatching (``device_train_microbatch_size='auto'``) with ranks that differ.

When a rank hits a CUDA OOM, Composer (``Trainer._train_batch``) catches it and enters a handshake:
rounds of two one-byte all-reduces, ``MAX`` of "some rank hit an OOM", then ``MIN`` of "every rank
has left the step", until every rank has left. A rank still inside the step must meet each round
with Composer's OOM check (``composer.distributed.shared_utils.generate_oom_hook``: the same two
all-reduces, then ``RuntimeError(OOM_FOUND_ON_OTHER_RANK)`` if some rank hit one), which Composer
runs after every training microbatch's forward (and, under FSDP1, around every FSDP module).
Everything then halves the microbatch size and splits the same batch again.

That only works if no other collective can meet a round of the handshake, and if every rank runs
the same number of checks. UnevenJoin sees to both with :class:`OOMChecks`, on every rank, only
while ``state.auto_microbatching`` is on:

* after every microbatch's loss, before UnevenJoin's own in-step collectives (FSDP's
  unused-parameter check) and before the backward pass (DDP's gradient all-reduce), one check: an
  OOM in another rank's loss stops this rank there;
* after each rank's last microbatch's backward pass, before ``forced_sync``'s gradient-presence
  all-reduce and Composer's manual gradient all-reduce, one check;
* under DDP, where ranks may split a step into different numbers of microbatches (a partial or a
  shadow batch), a rank with fewer microbatches runs the checks of the microbatches it does not
  have, after its last forward (before the backward pass that syncs gradients); FSDP pads every
  rank to the same count instead (:class:`~composer_join.shadow.padding.MicrobatchPadding`).

A check that finds an OOM on another rank drops this rank's gradients (Composer clears them for the
retry anyway) so that ``forced_sync``'s manual all-reduce, which runs as the error leaves the
microbatch, finds none to all-reduce, and raises Composer's ``OOM_FOUND_ON_OTHER_RANK``.

Cost, only with automatic microbatching: two one-byte all-reduces and a host sync per microbatch,
two per step, and two per missing microbatch on a rank with fewer; none otherwise.

What cannot be made safe: an OOM inside a backward pass that syncs gradients (DDP's last
microbatch under ``single_auto_sync``/``multi_auto_sync``; FSDP's reduce-scatters without
Composer's FSDP1 hooks; a ``forced_sync`` rank whose partial gradients Composer then all-reduces)
meets other ranks' gradient collectives. Stock Composer has the same limit.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from composer.core import Evaluator, State
from composer.distributed.shared_utils import generate_oom_hook

from composer_join.core import compat

__all__ = ['EvalRetry', 'OOMChecks', 'check']


class OOMChecks:
    """Composer's OOM check at the points UnevenJoin needs it, on one rank (see the module docstring).

    Call :meth:`start_step` at ``BEFORE_TRAIN_BATCH`` (again at each retry), :meth:`after_forward`,
    :meth:`after_loss`, :meth:`after_backward` at those events of every training microbatch, on
    every rank. ``own`` and ``target`` (this rank's microbatches and the most any rank has in the
    step) are set by whoever splits the batch; unknown (None), no checks are added for missing ones.
    """

    def __init__(self):
        self.own: Optional[int] = None
        self.target: Optional[int] = None
        self.index = 0  # microbatches of this attempt at the step so far

    def start_step(self) -> None:
        self.index = 0

    def after_forward(self, state: State) -> None:
        self.index += 1
        if not state.auto_microbatching or self.own is None or self.target is None:
            return
        if self.index == self.own:
            for _ in range(2 * (self.target - self.own)):  # each missing microbatch: after forward, after loss
                check(state)

    def after_loss(self, state: State) -> None:
        if state.auto_microbatching:
            check(state)

    def after_backward(self, state: State) -> None:
        if state.auto_microbatching and self.own is not None and self.index == self.own:
            check(state)


def check(state: State) -> None:
    """Composer's own OOM check (two one-byte all-reduces); on another rank's OOM, drop gradients and raise."""
    try:
        generate_oom_hook(state.device)()
    except RuntimeError:
        for optimizer in state.optimizers:
            for group in optimizer.param_groups:
                for p in group['params']:
                    p.grad = None
        raise


class EvalRetry:
    """Undo the metric updates of an evaluation batch's attempt that Composer retries after an OOM.

    Composer's evaluation loop retries a batch with half the microbatch size when some rank hit an
    OOM, but does not reset the metrics: a rank that had already updated them with some of that
    batch's microbatches would count those samples twice. With the evaluator's automatic
    microbatching on, :meth:`batch_start` (``EVAL_BATCH_START``) keeps a copy of the metric states
    and :meth:`before_forward` (``EVAL_BEFORE_FORWARD``) puts it back when the microbatch size has
    changed since, i.e. when a retry starts. Cost, only then: one copy of the metric states per
    evaluation batch. ``evaluator``: the one Composer runs (its ``DataSpec`` holds the dataloader it iterates:
    :func:`composer_join.shadow.dataspec.evaluator_for`); None (``predict()``): nothing to undo. Its metrics are
    ``state.eval_metrics[label]``, the dictionary Composer's evaluation loop itself updates.
    """

    def __init__(self, evaluator: Optional[Evaluator]):
        self.evaluator = evaluator  # the evaluation's (found by identity, composer_join.shadow.dataspec.evaluator_for)
        self._size: Any = None
        self._saved: list[tuple[Any, dict[str, Any]]] = []

    def batch_start(self, state: State) -> None:
        evaluator = self.evaluator
        self._saved = []
        if evaluator is None or not evaluator.auto_microbatching:
            return
        self._size = evaluator.device_eval_microbatch_size
        metrics = state.eval_metrics.get(state.dataloader_label, {})
        self._saved = [(m, _metric_state(m)) for m in metrics.values()]

    def before_forward(self, state: State) -> None:
        evaluator = self.evaluator
        if not self._saved or evaluator is None or evaluator.device_eval_microbatch_size == self._size:
            return
        self._size = evaluator.device_eval_microbatch_size
        for metric, saved in self._saved:
            for name, value in saved.items():
                setattr(metric, name, _copy(value))


def _metric_state(metric: Any) -> dict[str, Any]:
    names = compat.metric_state_names(metric)
    return {n: _copy(getattr(metric, n)) for n in names if hasattr(metric, n)}


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
