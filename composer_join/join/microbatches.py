"""Each microbatch UnevenJoin runs in, decided once: the frozen record, the stand-in input, the metrics kept out.

A session (:mod:`composer_join.join.fit`, :mod:`composer_join.join.evaluation`) holds one :class:`Microbatches` per
loader it reads (its ``DataSpec`` counts samples, its :class:`~composer_join.join.loader.Learned` record holds what is
learned from the dataloader), and calls it on every rank:

* :meth:`Microbatches.begin` (``BEFORE_FORWARD``, ``EVAL_BEFORE_FORWARD``, ``PREDICT_BEFORE_FORWARD``, from the
  algorithm's ``match``, before the algorithm pass asks): the microbatch's :class:`Microbatch` record, made once and
  frozen: a stand-in or real, its samples, whether its forward gets the template, its gradient weight. The pass
  reads it; so does every later event of the microbatch. Nothing decides it again;
* :meth:`Microbatches.feed`: a stand-in's forward gets two real samples instead of the empty batch (a fresh
  copy of a template every time: models take apart the batch they are given); a real one keeps a template;
* :meth:`Microbatches.stand_in_for_others` (a shadow step's ``AFTER_DATALOADER``, first and last): the other
  algorithms see the template, then the zero-sample batch comes back, the model's buffers as they were;
* :meth:`Microbatches.keep_train_metrics_out` / :meth:`Microbatches.metrics_back`: a stand-in's updates never
  reach the train or eval metrics, which a shadow microbatch still makes syncable
  (:mod:`composer_join.interop.metrics`).

What a step changes for its stand-ins (the batch put aside at ``AFTER_DATALOADER`` and the buffers around it, the
metrics kept out, the wrapper's part of the current microbatch) is held in a record of that step alone
(:class:`Step`), made fresh for each step and ended by the loader's register of the step
(``JoinLoader.step_changes``) when the step ends, also when the run raises: nothing of a step reaches the next one,
or the next fit.

Cost: a stand-in of two samples per dataloader, kept on the device; per stand-in microbatch, a copy of it; per
microbatch UnevenJoin runs in, one sample count with the ``DataSpec``. A rank with no real microbatch of a dataloader
in this process makes its stand-in input from the template once, through the ``DataSpec``'s transforms (a random
transform is then called once more on that rank than Composer calls it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from composer.core import DataSpec, State

from composer_join.core.batches import first_samples
from composer_join.core.plan import StepPlan
from composer_join.interop.metrics import MetricStates, count_shadow_update, shadow_update
from composer_join.join.loader import TEMPLATE_SAMPLES, JoinLoader, Learned
from composer_join.shadow.buffers import BufferGuard
from composer_join.shadow.dataspec import count_samples, made_as_composer_makes_it
from composer_join.wrappers.wrapper import Microbatch as WrapperMicrobatch

__all__ = ['TEMPLATE_SAMPLES', 'Microbatch', 'Microbatches', 'Step']


@dataclass(frozen=True)
class Microbatch:
    """One microbatch as UnevenJoin decided it at its ``BEFORE_FORWARD``, once; read by the pass and every later event.

    Example:
        >>> Microbatch(shadow=True, samples=0, fed=True, weight=0.0).shadow
        True
    """

    shadow: bool
    """A stand-in (this rank shadows the step, or the microbatch has no samples): weighted zero, its metrics kept
    out, and no other algorithm sees it (:mod:`composer_join.join.passes`)."""
    samples: int
    """Its samples as Composer counts them (0 if none or uncountable)."""
    fed: bool
    """A stand-in whose forward runs on the template's two samples (the wrapper did not make it inert)."""
    weight: float
    """The factor on its gradient: ``0`` for a stand-in, ``A_t / W`` (or 1) for a real one
    (:func:`~composer_join.shadow.gradients.scale_grad`)."""


@dataclass
class Step:
    """What one step (a training step, an evaluation or ``predict()`` batch) changed for its stand-ins, until put back.

    Made by :class:`Microbatches` for each step of its loader; :meth:`end` runs when the step's register of changes
    is undone (the step ends, its iteration ends, or the run raises), so nothing outlives the step.
    """

    state: State
    held: Optional[tuple[Any, BufferGuard]] = None
    """``AFTER_DATALOADER`` of a shadow step: the zero-sample batch put aside for the stand-in, the buffers' guard."""
    stashed: Optional[tuple[dict, dict]] = None
    """Metrics emptied for a stand-in microbatch, and their content."""
    microbatch: Optional[Microbatch] = None
    """The current microbatch's record."""
    running: bool = False
    """A microbatch of the step runs: from its ``BEFORE_FORWARD`` until the next begins or the step's microbatches
    are over (``AFTER_TRAIN_BATCH``)."""
    wrapped: Optional[WrapperMicrobatch] = None
    """The wrapper's part of the current training microbatch: made with its record, entered at ``BEFORE_FORWARD``
    (:meth:`enter`), until it exits (:meth:`exit`)."""

    def enter(self) -> None:
        """The wrapper's part of the current microbatch begins: its changes, its stand-ins."""
        if self.wrapped is not None:
            self.wrapped.__enter__()

    def exit(self) -> None:
        """The wrapper's part of the current microbatch exits: its stand-ins undone (a no-op if there is none)."""
        wrapped, self.wrapped = self.wrapped, None
        if wrapped is not None:
            wrapped.__exit__(None, None, None)

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
        self.running = False
        self.exit()
        self.put_back()
        self.refill()


class Microbatches:
    """The microbatches of one loader's steps: their records, their input, the buffers around others, their metrics.

    Args:
        state: the trainer's state.
        loader: the join's loader the microbatches come from (None: a dataloader left to Composer, whose
            microbatches are all real).
        spec: the ``DataSpec`` Composer counts the loader's batches with.
        rank: this rank.
    """

    def __init__(self, state: State, loader: Optional[JoinLoader], spec: Optional[DataSpec], rank: int):
        self.state, self.loader, self.spec, self.rank = state, loader, spec, rank
        self._step: Optional[tuple[Any, Step]] = None  # the current step's register, and its record

    @property
    def learning(self) -> bool:
        """A real microbatch has yet to give the stand-in input (the first of this loader's dataloader)."""
        learned = self._learned()
        return learned is not None and learned.stand_in is None

    @property
    def current(self) -> Optional[Microbatch]:
        """The record of the microbatch running now (None before the first of the step)."""
        return self.step().microbatch

    def begin(
        self,
        plan: Optional[StepPlan],
        wrap: Optional[Callable[[bool, int], WrapperMicrobatch]] = None,
        divide: bool = True,
    ) -> Microbatch:
        """A microbatch starts: its record, made once, and (training) the wrapper's part of it, ``wrap(shadow,
        samples)``, not entered yet; a part the last microbatch left exits first. ``divide``:
        ``divide_by_initial_world_size``."""
        batch = self.state.batch
        samples = count_samples(self.spec, batch) if self.loader is not None and self.spec is not None else -1
        shadow = (plan is not None and not plan.has_batch(self.rank)) or samples == 0
        step = self.step()
        step.exit()
        wrapped = wrap(shadow, max(samples, 0)) if wrap is not None else None
        inert = wrapped is not None and wrapped.inert
        weight = 0.0 if shadow else plan.grad_factor(divide) if plan is not None else 1.0
        record = Microbatch(shadow=shadow, samples=max(samples, 0), fed=shadow and not inert, weight=weight)
        step.microbatch, step.wrapped, step.running = record, wrapped, True
        return record

    def in_stand_in(self) -> bool:
        """Whether a stand-in microbatch of the current step runs now (a padded one in a real step, or any of a
        shadow step), from its ``BEFORE_FORWARD`` until :meth:`microbatches_over`."""
        step = self._step[1] if self._step is not None else None
        return step is not None and step.running and step.microbatch is not None and step.microbatch.shadow

    def microbatches_over(self) -> None:
        """The step's microbatches have run (``AFTER_TRAIN_BATCH``, ``EVAL_BATCH_END``): none is current any more."""
        if self._step is not None:
            self._step[1].running = False

    def feed(self, record: Microbatch) -> None:
        """Stand-in: give the forward two real samples instead of the empty batch; real: keep two.

        A model may take apart the batch it is given (``HuggingFaceModel.eval_forward`` pops ``labels`` and
        shifts them in place), so no batch object goes to the model twice: the template is a copy taken before
        the forward, and every stand-in microbatch gets a fresh copy of it.
        """
        if record.fed:
            self.state.batch = first_samples(self.template(), TEMPLATE_SAMPLES)
        elif not record.shadow:
            learned = self._learned()
            if learned is not None and learned.stand_in is None:
                learned.stand_in = first_samples(self.state.batch, TEMPLATE_SAMPLES)

    def template(self) -> Any:
        """The current dataloader's stand-in input: the first samples of a real microbatch of this rank's, or (none
        yet in this process: no data of its own, or its data ended before the checkpoint it resumed from) the
        template, as the dataloader yielded it, made into a microbatch the way Composer makes one
        (:func:`~composer_join.shadow.dataspec.made_as_composer_makes_it`: the ``DataSpec``'s ``batch_transforms``,
        the device, its split, ``microbatch_transforms``), once per dataloader."""
        learned = self._learned()
        if learned is None or self.loader is None:  # a stand-in is only ever asked for where a loader is current
            raise RuntimeError('UnevenJoin: a stand-in microbatch with no dataloader of the join current')
        if learned.stand_in is None:
            to_device = self.state.device.batch_to_device
            if self.spec is not None:  # the whole template (a copy) through the transforms, as a real batch goes
                size = self.loader.glue.microbatch_size()
                made = made_as_composer_makes_it(
                    self.spec, first_samples(learned.template, sys.maxsize), to_device, size
                )
                batch = first_samples(made, TEMPLATE_SAMPLES)
            else:
                batch = to_device(first_samples(learned.template, TEMPLATE_SAMPLES))
            learned.stand_in = batch
        return learned.stand_in

    def step(self) -> Step:
        """The current step's record: made with the first call in each step of the loader, ended with it."""
        register = self.loader.step_changes if self.loader is not None else None
        if self._step is None or self._step[0] is not register:
            step = Step(self.state)
            if register is not None:
                register.call(step.end)
            self._step = (register, step)
        return self._step[1]

    def _learned(self) -> Optional[Learned]:
        return self.loader.learned if self.loader is not None else None

    def _metric_states(self) -> MetricStates:
        """The dataloader's list-state metrics; with no loader, states learned from nothing."""
        learned = self._learned()
        return learned.metric_states if learned is not None else MetricStates(self.state.device.tensor_to_device)

    def stand_in_for_others(self) -> bool:
        """A shadow step's ``AFTER_DATALOADER``: run first (returns True) and last (False), see :mod:`.passes`.

        First: the zero-sample batch is put aside and the two-sample stand-in takes its place, so the
        other algorithms (SelectiveBackprop's extra forward: a collective under FSDP, a buffer broadcast
        under DDP) run as on every rank. Last: the zero-sample batch comes back (Composer counts and
        splits it), with the module buffers as they were (a :class:`~composer_join.shadow.buffers.BufferGuard`:
        buffers a forward replaced come back too).
        """
        step = self.step()
        if step.held is None:
            guard = BufferGuard(self.state.model)
            guard.armed = True
            guard.snapshot()
            step.held = (self.state.batch, guard)
            self.state.batch = first_samples(self.template(), TEMPLATE_SAMPLES)
            return True
        step.put_back()
        return False

    def keep_train_metrics_out(self, record: Microbatch) -> None:
        """After a stand-in's backward: its update probes the metrics (so they stay syncable), then they are emptied.

        The metrics see the batch the forward ran on: the template, or (a forward that communicates, run on the
        zero-sample batch) none of it; without outputs (a skipped forward) ``eval_forward`` runs it.
        """
        state = self.state
        if not (record.shadow and state.train_metrics):
            return
        template = self.template()
        rows = TEMPLATE_SAMPLES if record.fed or state.outputs is None else 0
        self._metric_states().probe(state.train_metrics, shadow_update(state, lambda: first_samples(template, rows)))
        self._stash(state.train_metrics)

    def keep_eval_metrics_out(self, record: Microbatch) -> None:
        """After a stand-in's eval forward: as :meth:`keep_train_metrics_out`, for the evaluator's metrics."""
        if not record.shadow:
            return
        metrics = self.state.eval_metrics[self.state.dataloader_label]
        self._metric_states().probe(metrics, shadow_update(self.state))
        self._stash(metrics)

    def metrics_back(self, metrics: Optional[dict]) -> None:
        """The step or eval batch ends: refill the metrics a stand-in emptied, make list states syncable."""
        if self.step().refill():  # no "compute before update" warning that the ranks with data do not give
            count_shadow_update(metrics or {})
        self._metric_states().fill(metrics or {})  # Composer computes them next

    def _stash(self, metrics: dict) -> None:
        """Empty ``metrics`` in place for this stand-in microbatch; :meth:`metrics_back` refills it (or the step's end).

        Stand-in microbatches come last in a step (padding follows the real ones), so once stashed, the metrics
        stay out until the step or eval batch ends.
        """
        step = self.step()
        if step.stashed is None:
            step.stashed = (metrics, dict(metrics))
        metrics.clear()
