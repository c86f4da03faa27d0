"""What UnevenJoin does at every microbatch of a step, an evaluation or ``predict()``: shadow or real, and its metrics.

:class:`Microbatches` is made once per run (a trainer's first active start) and called by
:class:`~composer_join.join.session.Run` from Composer's per-microbatch events, on every rank:

* :meth:`Microbatches.start` (``BEFORE_FORWARD``, ``EVAL_BEFORE_FORWARD``, ``PREDICT_BEFORE_FORWARD``; the
  algorithm pass asks first): whether this microbatch is a stand-in (a joined rank's, or an empty padding one);
* :meth:`Microbatches.feed`: a stand-in's forward gets two real samples instead of the empty batch (a fresh
  copy of a template every time: models take apart the batch they are given); a real one keeps a template;
* :meth:`Microbatches.stand_in_for_others` (a shadow step's ``AFTER_DATALOADER``, first and last): the other
  algorithms see the template, then the zero-sample batch comes back, the model's buffers as they were;
* :meth:`Microbatches.keep_metrics_out` / :meth:`Microbatches.metrics_back`: a stand-in's updates never
  reach the train or eval metrics, which a shadow microbatch still makes syncable
  (:mod:`composer_join.interop.metrics`).

What is learned from the current dataloader (the template a stand-in runs on, the empty states of its list-state
metrics) is read from and kept in the current loader's :class:`~composer_join.join.loader.Learned` record: the
dataloader's, never the label's. What a step changes for its stand-ins (the batch put aside at ``AFTER_DATALOADER``
and the buffers around it, the metrics kept out) is held in a record of that step alone (:class:`Step`), made
fresh for each step and put back by the loader's register of the step (``JoinLoader.step_changes``) when the step
ends, also when the run raises: nothing of a step reaches the next one, or the next fit.

Cost: a template of two samples per dataloader, kept on the device; per stand-in microbatch, a copy of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from composer.core import State

from composer_join.core.batches import first_samples
from composer_join.core.changes import Changes
from composer_join.core.plan import StepPlan
from composer_join.interop.metrics import MetricStates, count_shadow_update, shadow_update
from composer_join.interop.oom import EvalRetry
from composer_join.join.loader import JoinLoader, Learned
from composer_join.shadow.buffers import BufferGuard

__all__ = ['TEMPLATE_SAMPLES', 'Microbatches', 'Step']

TEMPLATE_SAMPLES = 2
"""Samples in a shadow forward: two, so that BatchNorm in training mode accepts it."""


@dataclass
class Step:
    """What one step (a training step, an evaluation or ``predict()`` batch) changed for its stand-ins, until put back.

    Made by :class:`Microbatches` for each step of the current loader; :meth:`end` runs when the step's register
    of changes is undone (the step ends, its iteration ends, or the run raises), so nothing outlives the step.
    """

    state: State
    held: Optional[tuple[Any, BufferGuard]] = None
    """``AFTER_DATALOADER`` of a shadow step: the zero-sample batch put aside for the stand-in, the buffers' guard."""
    stashed: Optional[tuple[dict, dict]] = None
    """Metrics emptied for a stand-in microbatch, and their content."""

    def put_back(self) -> None:
        """The zero-sample batch back in place of the stand-in, the buffers as they were before it."""
        if self.held is not None:
            (self.state.batch, guard), self.held = self.held, None
            guard.restore()

    def refill(self) -> bool:
        """The metrics a stand-in emptied refilled; whether there were any."""
        if self.stashed is None:
            return False
        (emptied, saved), self.stashed = self.stashed, None
        emptied.update(saved)
        return True

    def end(self) -> None:
        self.put_back()
        self.refill()


class Microbatches:
    """The current microbatch's shadowing: its input, the buffers around other algorithms, the metrics it keeps out.

    Args:
        plan: ``() ->`` the current step's plan (None outside a step).
        rank: this rank.
        loader: ``() ->`` the current loader (None: none is, e.g. ``predict()`` left to Composer): its ``DataSpec``
            counts samples, and what was learned from its dataloader (:class:`~composer_join.join.loader.Learned`:
            the template, first samples of a real batch, this rank's or, with no data of its own, another rank's).
        to_device: where metric states go (the trainer's device).
    """

    def __init__(
        self,
        plan: Callable[[], Optional[StepPlan]],
        rank: int,
        loader: Callable[[], Optional[JoinLoader]],
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.plan, self.rank, self.loader, self.to_device = plan, rank, loader, to_device
        self.shadow = False  # the current microbatch is a stand-in
        self.fed = True  # the current train microbatch's forward ran on the input feed() gave it
        self._step: Optional[tuple[Optional[Changes], Step]] = None  # the current step's register, and its record
        self.eval_retry = EvalRetry()  # automatic eval microbatching: undo a retried batch's metric updates

    @property
    def shadow_step(self) -> bool:
        """This rank runs a shadow step: it has run out of data, others have not."""
        plan = self.plan()
        return plan is not None and not plan.has_batch(self.rank)

    def start(self, state: State) -> int:
        """A microbatch starts: decide whether it is a stand-in; return its samples (0 if none or uncountable)."""
        loader = self.loader()
        samples = loader.samples(state.batch) if loader is not None else -1
        self.shadow = self.shadow_step or samples == 0
        return max(samples, 0)

    def feed(self, state: State) -> None:
        """Stand-in: give the forward two real samples instead of the empty batch; real: keep two.

        A model may take apart the batch it is given (``HuggingFaceModel.eval_forward`` pops ``labels`` and
        shifts them in place), so no batch object goes to the model twice: the template is a copy taken before
        the forward, and every stand-in microbatch gets a fresh copy of it.
        """
        learned = self._learned()
        if not self.shadow:
            if learned is not None and learned.stand_in is None:
                learned.stand_in = first_samples(state.batch, TEMPLATE_SAMPLES)
            return
        state.batch = first_samples(self.template(state), TEMPLATE_SAMPLES)

    def template(self, state: State) -> Any:
        """The current dataloader's stand-in input: this rank's first samples, or (never had data) the template other
        ranks sent, on the device."""
        learned = self._learned()
        if learned is None:  # a stand-in is only ever asked for where a loader is current
            raise RuntimeError('UnevenJoin: a stand-in microbatch with no dataloader of the join current')
        if learned.stand_in is None:
            learned.stand_in = state.device.batch_to_device(first_samples(learned.template, TEMPLATE_SAMPLES))
        return learned.stand_in

    def step(self, state: State) -> Step:
        """The current step's record: made with the first call in each step of the current loader, ended with it."""
        loader = self.loader()
        register = loader.step_changes if loader is not None else None
        if self._step is None or self._step[0] is not register:
            step = Step(state)
            if register is not None:
                register.call(step.end)
            self._step = (register, step)
        return self._step[1]

    def _learned(self) -> Optional[Learned]:
        loader = self.loader()
        return loader.learned if loader is not None else None

    def _metric_states(self) -> MetricStates:
        """The current dataloader's list-state metrics; with no loader current, states learned from nothing."""
        learned = self._learned()
        return learned.metric_states if learned is not None else MetricStates(self.to_device)

    def stand_in_for_others(self, state: State) -> bool:
        """A shadow step's ``AFTER_DATALOADER``: run first (returns True) and last (False), see :mod:`.passes`.

        First: the zero-sample batch is put aside and the two-sample stand-in takes its place, so the
        other algorithms (SelectiveBackprop's extra forward: a collective under FSDP, a buffer broadcast
        under DDP) run as on every rank. Last: the zero-sample batch comes back (Composer counts and
        splits it), with the module buffers as they were (a :class:`~composer_join.shadow.buffers.BufferGuard`:
        buffers a forward replaced come back too).
        """
        step = self.step(state)
        if step.held is None:
            guard = BufferGuard(state.model)
            guard.armed = True
            guard.snapshot()
            step.held = (state.batch, guard)
            self.shadow = True
            self.feed(state)
            return True
        step.put_back()
        return False

    def keep_train_metrics_out(self, state: State) -> None:
        """After a stand-in's backward: its update probes the metrics (so they stay syncable), then they are emptied.

        The metrics see the batch the forward ran on: the template, or (a forward that communicates, run on the
        zero-sample batch) none of it; without outputs (a skipped forward) ``eval_forward`` runs it.
        """
        if not (self.shadow and state.train_metrics):
            return
        template = self.template(state)
        rows = TEMPLATE_SAMPLES if self.fed or state.outputs is None else 0
        self._metric_states().probe(state.train_metrics, shadow_update(state, lambda: first_samples(template, rows)))
        self._stash(state, state.train_metrics)

    def keep_eval_metrics_out(self, state: State) -> None:
        """After a stand-in's eval forward: as :meth:`keep_train_metrics_out`, for the evaluator's metrics."""
        if not self.shadow:
            return
        metrics = state.eval_metrics[state.dataloader_label]
        self._metric_states().probe(metrics, shadow_update(state))
        self._stash(state, metrics)

    def metrics_back(self, state: State, metrics: Optional[dict]) -> None:
        """The step or eval batch ends: refill the metrics a stand-in emptied, make list states syncable."""
        if self.step(state).refill():  # no "compute before update" warning that the ranks with data do not give
            count_shadow_update(metrics or {})
        self._metric_states().fill(metrics or {})  # Composer computes them next

    def _stash(self, state: State, metrics: dict) -> None:
        """Empty ``metrics`` in place for this stand-in microbatch; :meth:`metrics_back` refills it (or the step's end).

        Stand-in microbatches come last in a step (padding follows the real ones), so once stashed, the metrics
        stay out until the step or eval batch ends.
        """
        step = self.step(state)
        if step.stashed is None:
            step.stashed = (metrics, dict(metrics))
        metrics.clear()
