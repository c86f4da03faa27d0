"""One evaluation or ``predict()`` under UnevenJoin: its loader and the work at its batches.

An :class:`EvalSession` is made by the run (:class:`~composer_join.join.session.Run`) at ``EVAL_START`` or
``PREDICT_START`` and dropped at ``EVAL_END`` or ``PREDICT_END`` (or, left by a run that raised, at the next start).
While it exists it is the run's current session: its loader's plan is the one :func:`~composer_join.is_shadow_step`
reads. It owns:

* the evaluator's (or ``predict()``'s) :class:`~composer_join.join.loader.JoinLoader`: the evaluator is the one whose
  ``DataSpec`` holds the dataloader Composer iterates (by identity, never by label: an
  ``eval(eval_dataloader=...)``'s evaluator may share the label of the Trainer's own), or None where every rank's
  ``DistributedSampler`` evens the shards out by repeating samples (Composer's evaluation removes the repeats:
  nothing is uneven, it is left to Composer);
* the microbatches of its batches (:class:`~composer_join.join.microbatches.Microbatches`): a shadow batch's forward
  on the template, its metrics kept out (evaluation) or its outputs emptied (``predict()``);
* automatic eval microbatching's retry of a batch (:class:`~composer_join.interop.oom.EvalRetry`).

UnevenJoin matches every evaluation and ``predict()`` event it routes (an evaluation's batches are few beside
training's steps); the record of each batch is made at its ``*_BEFORE_FORWARD`` in ``match``, before the algorithm
pass reads it.
"""

from __future__ import annotations

from typing import Any, Optional

from composer.core import Event, State

from composer_join.core.plan import StepPlan
from composer_join.interop.oom import EvalRetry
from composer_join.interop.predict import empty_outputs
from composer_join.join.context import Context
from composer_join.join.loader import JoinLoader, join_dataloader, lift_cap, pads_by_repeating
from composer_join.join.microbatches import Microbatches
from composer_join.shadow.dataspec import evaluator_for, spec_for

__all__ = ['BATCH_EVENTS', 'EvalSession']

_BEFORE_FORWARD = frozenset((Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD))
BATCH_EVENTS = _BEFORE_FORWARD | {
    Event.EVAL_BATCH_START,
    Event.EVAL_AFTER_FORWARD,
    Event.EVAL_BATCH_END,
    Event.PREDICT_AFTER_FORWARD,
}
"""The events of an evaluation's or ``predict()``'s batches (:meth:`EvalSession.wants`)."""


class EvalSession:
    """One evaluation (``predict``: a ``predict()``), from its start event: the length agreement, its loader.

    Args:
        context: what the trainer's sessions share (:class:`~composer_join.join.context.Context`).
        earlier: a loader made earlier over the same dataloader object (an evaluator's, the trainer's last
            evaluation with it): what it learned is handed on (never from one under the same label only).
        predict: a ``predict()`` (its microbatch size is Composer's: every batch whole).
    """

    def __init__(self, context: Context, earlier: Optional[JoinLoader], predict: bool):
        self.context, self.state, self.predict = context, context.state, predict
        state = self.state
        # the evaluator whose DataSpec holds the dataloader Composer iterates (by identity: labels repeat)
        evaluator = None if predict else evaluator_for(state, state.dataloader)
        if not predict and evaluator is None:
            raise RuntimeError(
                "UnevenJoin: none of the Trainer's evaluators holds the dataloader Composer evaluates "
                f'({type(state.dataloader).__name__}, label {state.dataloader_label!r})'
            )
        self.retry = EvalRetry(evaluator)  # automatic eval microbatching: undo a retried batch's metric updates
        # read when used (automatic microbatching changes it); predict(): every batch whole
        size: Any = (lambda: evaluator.device_eval_microbatch_size) if evaluator is not None else -1
        own = evaluator.dataloader if evaluator is not None else None  # the evaluator's DataSpec (predict(): none)
        self.loader: Optional[JoinLoader] = join_dataloader(
            context,
            context.facts(state, repeats=pads_by_repeating(state.dataloader)),
            lambda changes: context.wrapper.install(changes, state, self.plan, train=False, spec=own),
            earlier,
            microbatch_size=size,
        )
        loader = self.loader
        # the DataSpec the loader counts with (predict(): Composer's defaults)
        spec = spec_for(state, loader.dataloader) if loader is not None else None
        self.microbatches = Microbatches(state, loader, spec, context.rank)
        if loader is None:
            # every rank's DistributedSampler evens shards out by repeating samples, and Composer's eval
            # loop removes exactly those repeats: nothing is uneven, leave it to Composer.
            return
        if not predict:
            loader.set_epoch(int(state.timestamp.batch))  # what Composer does for an eval sampler
        lift_cap(state, loader)  # only where some rank's dataloader may yield more than its len()
        context.wrapper.start(state, train=False)

    def plan(self) -> Optional[StepPlan]:
        """The current batch's plan (None outside a batch, or where the dataloader is left to Composer)."""
        return self.loader.current_plan() if self.loader is not None else None

    @property
    def shadow_step(self) -> bool:
        """This rank runs a shadow batch: it has run out of data, others have not."""
        return self.loader is not None and self.loader.shadowing

    @property
    def shadows_now(self) -> bool:
        """What :func:`~composer_join.is_shadow_step` reports: a shadow batch, or, in a real batch, a stand-in
        microbatch running (one padding this rank's microbatches to the batch's largest count, FSDP), from its
        ``EVAL_BEFORE_FORWARD`` until the batch's ``EVAL_BATCH_END``."""
        return self.shadow_step or self.microbatches.in_stand_in()

    def wants(self, event: Event, state: State) -> bool:
        """Every event it routes; at ``*_BEFORE_FORWARD`` the batch's record is made here, for the algorithm pass."""
        if event in _BEFORE_FORWARD:
            self.microbatches.begin(self.plan())
        return True

    def close(self) -> None:
        """End what a run that raised left of this evaluation: its iteration (before the next start)."""
        if self.loader is not None:
            self.loader.close_iteration()

    def end(self) -> None:
        """``EVAL_END``, ``PREDICT_END``: stop every rank if some rank could not form a batch."""
        if self.loader is not None:
            self.loader.check_ended_together()

    def batch_start(self, state: State) -> None:
        self.retry.batch_start(state)

    def before_forward(self, state: State) -> None:
        if not self.predict:
            self.retry.before_forward(state)
        self.microbatches.feed(self.microbatches.step().microbatch)

    def after_forward(self, state: State) -> None:
        record = self.microbatches.step().microbatch
        if self.predict:
            if record.shadow:
                empty_outputs(state)
        else:
            self.microbatches.keep_eval_metrics_out(record)

    def batch_end(self, state: State) -> None:
        self.microbatches.microbatches_over()  # (before the callbacks: the batch that ends was real or shadow)
        self.microbatches.metrics_back(state.eval_metrics.get(state.dataloader_label))
