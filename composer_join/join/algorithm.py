"""``UnevenJoin``: the Composer algorithm that lets ranks with less data join instead of stopping everyone.

The class only routes Composer events to the pieces that do the work:

========================  ======================================================================
event                     what happens
========================  ======================================================================
``FIT_START``             agree on the epoch length (longest rank's), wrap the train dataloader
                          in a :class:`~composer_join.join.loader.JoinLoader` (``mode='rebalance'``:
                          over a :class:`~composer_join.rebalance.rebalance.Rebalancer`), pick the
                          wrapper's part once (:mod:`composer_join.wrappers`: DDP, FSDP1/2 or none)
``EPOCH_START``           reshuffle a ``DistributedSampler`` (Composer skips wrapped loaders); lift
                          Composer's ``dataloader_len`` cap for the epoch's loop, so batches past
                          a ``len()`` that undercounts are trained (:func:`~composer_join.join.loader.lift_cap`)
``BEFORE_DATALOADER``     put the cap back once the loop has started (schedules read it)
``AFTER_DATALOADER``      only where other algorithms run at it: shadow step: the template for them,
                          then the zero-sample batch back; every step: re-gather the ranks' counts
                          (:mod:`composer_join.interop.replan`)
``BEFORE_TRAIN_BATCH``    wrapper: new step (DDP: microbatch cursor, buffer source)
``BEFORE_FORWARD``        wrapper: this microbatch's sync; shadow (a joined rank's or an empty padding
                          microbatch): the wrapper makes it inert (DDP: no model code runs), or else
                          swap in a two-sample template with buffers guarded; real: keep a template
``AFTER_FORWARD``         wrapper: automatic microbatching's OOM checks (:mod:`composer_join.interop.oom`)
``AFTER_LOSS``            wrapper check
``BEFORE_BACKWARD``       weight the gradient: ``0`` for shadow, ``A_t / W`` if asked (last, after
                          any algorithm rewrote the loss)
``AFTER_BACKWARD``        wrapper: restore syncing and buffers; shadow: keep train metrics out
``AFTER_TRAIN_BATCH``     put train metrics back; list states made syncable (:mod:`composer_join.interop.metrics`)
``EPOCH_END``             stop every rank if some rank could not form a batch; log the epoch's report
                          (rebalance: with bytes moved)
``*_CHECKPOINT``          wrapper (DDP): buffers equal on every rank before a checkpoint is saved
``FIT_END``               wrapper (DDP): buffers equal on every rank at the end of ``fit``; Composer's
                          checkpointed attributes as they were
``EVAL_START``            wrap this evaluator's dataloader the same way (one length agreement), lift the cap;
                          wrapper: FSDP pads eval microbatches, DDP makes buffers equal on every rank
``EVAL_BATCH_START``      automatic microbatching: keep the metric states, for a retry after an OOM
``EVAL_BEFORE_FORWARD``   a retry: put the metric states back; shadow: swap in the template; real: keep one
``EVAL_AFTER_FORWARD``    shadow: keep the eval metrics out
``EVAL_BATCH_END``        put the eval metrics back; list states made syncable (:mod:`composer_join.interop.metrics`)
``EVAL_END``              stop every rank if some rank could not form a batch; back to the train plan;
                          the evaluator's ``DataSpec``'s ``split_batch`` as it was
``PREDICT_*``             as evaluation (:mod:`composer_join.interop.predict`); a shadow batch's outputs are
                          cut to zero samples
========================  ======================================================================

Where it runs among the other algorithms, per event, is set by :mod:`composer_join.join.passes`
(other algorithms never see a shadow microbatch). At ``FIT_START`` it also makes optimizers
that branch on the closure's loss (SAM) take the same branch on a joined rank
(:mod:`composer_join.interop.closures`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import dist

from composer_join.core.batches import first_samples
from composer_join.core.changes import Changes
from composer_join.core.plan import StepPlan, agree_on_length
from composer_join.core.report import EpochReport
from composer_join.core.settings import row as settings_row
from composer_join.core.source import BatchSource
from composer_join.data.positions import position_for
from composer_join.data.resume import (
    RankPositions,
    Resumed,
    check_world_size,
    restore,
    snapshot,
    train_position,
)
from composer_join.interop.closures import agree_on_closures
from composer_join.interop.metrics import MetricStates, count_shadow_update, shadow_update
from composer_join.interop.oom import EvalRetry
from composer_join.interop.predict import PREDICT_EVENTS, empty_outputs
from composer_join.interop.refusals import refuse_incompatible
from composer_join.interop.replan import replan
from composer_join.join.loader import TEMPLATE_SAMPLES, JoinLoader, join_dataloader, lift_cap, pads_by_repeating
from composer_join.shadow.buffers import checkpoint_due
from composer_join.shadow.gradients import scale_grad
from composer_join.wrappers import wrapper_for
from composer_join.wrappers.wrapper import Wrapper

__all__ = ['UnevenJoin', 'is_shadow_step']

log = logging.getLogger(__name__)

_STARTS = frozenset((Event.FIT_START, Event.EVAL_START, Event.PREDICT_START))
# the per-microbatch events, at which composer_join.join.passes keeps the other algorithms off a shadow microbatch
MICROBATCH_EVENTS = frozenset(
    (
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
        Event.EVAL_BEFORE_FORWARD,
        Event.EVAL_AFTER_FORWARD,
        Event.PREDICT_BEFORE_FORWARD,
        Event.PREDICT_AFTER_FORWARD,
    )
)
_EVENTS = (
    _STARTS
    | frozenset(
        (
            Event.EPOCH_START,
            Event.BEFORE_TRAIN_BATCH,
            Event.BEFORE_FORWARD,
            Event.AFTER_FORWARD,
            Event.AFTER_LOSS,
            Event.AFTER_BACKWARD,
            Event.AFTER_TRAIN_BATCH,
            Event.EPOCH_END,
            Event.EVAL_BEFORE_FORWARD,
            Event.EVAL_AFTER_FORWARD,
            Event.EVAL_BATCH_START,
            Event.EVAL_BATCH_END,
            Event.EVAL_END,
            Event.FIT_END,
        )
    )
    | PREDICT_EVENTS
    | MICROBATCH_EVENTS
    | frozenset((Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER))
)  # every microbatch event: the
# pass sees only matching algorithms, so UnevenJoin must match them all to keep the others off a shadow microbatch
# sets: Composer's Event compares by a Python __eq__, and match() runs for every event
_CHECKPOINTS = frozenset((Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT))
_EVENTS |= _CHECKPOINTS


class UnevenJoin(Algorithm):
    """Train data-parallel with a different amount of data on each rank, dropping nothing.

    Every rank trains on every batch of its own shard, every epoch. A rank that runs out *joins*:
    it keeps running Composer's real training step on a shadow batch (counted as zero samples,
    contributing nothing to any rank), so it takes part in every collective of the
    step (DDP's gradient all-reduce or FSDP's all-gathers and reduce-scatters, and all of Composer's
    own) and takes the same optimizer step, until the last rank runs out. Under FSDP, ranks with
    fewer microbatches in a step are padded with shadow microbatches. Then the epoch ends on all
    ranks at the same step. Evaluation works the same way: every rank evaluates every batch of its
    shard, shadow batches stay out of the metrics, so metrics equal those of one process
    evaluating all the data. ``Trainer.predict()`` too: every rank predicts its whole shard, and a
    shadow batch's outputs hold zero samples (:mod:`composer_join.interop.predict`).

    At step ``t``, with ``A_t`` of ``W`` ranks holding real data and ``S_t`` real samples in all,
    the gradient applied is the mean of the per-sample loss gradients over the ``S_t`` samples,
    times ``A_t / W`` if ``divide_by_initial_world_size`` (torch's default) and times 1 otherwise.

    Cost: one collective per fit or evaluation to agree on the epoch length. When every rank's
    dataloader has a ``len()``, no further collective on the steps before the shortest rank's last
    batch, and one small one (``96 * W`` bytes) on each step from there on; without a ``len()`` on
    some rank, that small one on every step. A shadow step is inert (``docs/shadow-steps.md``): under DDP
    it runs no model code, only DDP's collectives; where the forward communicates (``SyncBatchNorm``) a
    forward and backward on zero samples; under FSDP on two template samples, with a zero loss.
    A step where another algorithm runs at ``AFTER_DATALOADER`` (it may reshape the batch) costs one
    all-gather of two integers per rank more (:mod:`composer_join.interop.replan`).

    Example::

        from composer import Trainer
        from composer_join import UnevenJoin

        trainer = Trainer(
            model=model, train_dataloader=this_ranks_shard, max_duration='2ep',
            algorithms=[UnevenJoin()],
        )
        trainer.fit()
        print(trainer.state.algorithms[0].reports[-1].summary())  # what each rank trained

    Args:
        divide_by_initial_world_size: as in ``DistributedDataParallel.join``: if True (default)
            the gradient is divided by the full world size even when some ranks have joined
            (the mean over real samples times ``A_t / W``); if False, by the number of ranks that
            still have data (the plain mean over real samples).
        enable: if False the algorithm does nothing and Composer behaves as without it (after one
            small all-reduce at the first fit or evaluation, with more than one rank, that checks that
            every rank agrees: settings that differ between ranks stop every rank with an error).
        throw_on_early_termination: if True, every rank raises :class:`UnevenInputsError` at the
            first training step where some rank has no batch left, before any optimizer step for
            it. (Evaluation always joins: uneven eval shards are evaluated exactly.)
        mode: ``'shadow'`` (default): each rank trains its own batches, ranks that run out shadow.
            ``'rebalance'``: ranks that run out are handed whole batches by ranks that still have
            several, so an epoch lasts ``ceil(total batches / W)`` steps
            (:mod:`composer_join.rebalance.rebalance`; without some rank's ``len()``, step by step from read-ahead
            buffers: :mod:`composer_join.rebalance.readahead`).
            Evaluation always shadows (it is exact).
    """

    MODES = ('shadow', 'rebalance')

    def __init__(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
        mode: str = 'shadow',
    ):
        for name, value in (
            ('divide_by_initial_world_size', divide_by_initial_world_size),
            ('enable', enable),
            ('throw_on_early_termination', throw_on_early_termination),
        ):
            if not isinstance(value, bool):
                raise TypeError(f'UnevenJoin({name}=...) must be True or False, got {value!r}')
        if mode not in self.MODES:
            raise ValueError(f'UnevenJoin(mode=...) must be one of {", ".join(map(repr, self.MODES))}; got {mode!r}')
        self.mode = mode
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.enable = enable
        self.throw_on_early_termination = throw_on_early_termination
        self._settings = settings_row(enable, mode, throw_on_early_termination, divide_by_initial_world_size)
        self.reports: list[EpochReport] = []  # one per finished training epoch, the same on every rank
        self._repr = (
            f'UnevenJoin(divide_by_initial_world_size={divide_by_initial_world_size}, '
            f'enable={enable}, throw_on_early_termination={throw_on_early_termination}'
            + (f', mode={mode!r})' if mode != 'shadow' else ')')
        )  # Composer formats the algorithm into a trace key at every event it runs
        self._rank = 0
        self._active: Optional[bool] = None  # decided at the first FIT_START or EVAL_START
        self._loader: Optional[JoinLoader] = None  # the loader whose plan is current (train or eval)
        self._train_loader: Optional[JoinLoader] = None
        self._eval_loaders: dict[str, JoinLoader] = {}
        self._templates: dict[str, Any] = {}  # per dataloader label: two prepared samples
        self._fed_template = True  # the current train microbatch's forward ran on the batch _shadow_input gave it
        self._wrapper: Optional[Wrapper] = None  # DDP's, FSDP's or none: chosen at the first start
        self._shadow = False  # the current microbatch is a stand-in (joined rank, or padding)
        self._stashed_metrics: Optional[tuple[dict, dict]] = None
        self._metric_states = MetricStates()  # list-state metrics made syncable on ranks with no data
        self._resumed: Optional[Resumed] = None  # what a checkpoint gave, until FIT_START
        self._eval_retry = EvalRetry()  # automatic eval microbatching: undo a retried batch's metric updates
        self._positions: Optional[RankPositions] = None  # train data that keeps its own position, per rank
        self._state: Optional[State] = None  # set at every start: composer_join.join.passes asks about microbatches
        self._held: Optional[tuple[Any, list]] = None  # a shadow step's AFTER_DATALOADER: its batch and buffers
        self.pass_seen = False  # set by composer_join.join.passes.join_pass when the Engine runs it
        self._cap: Any = None  # Composer's train dataloader_len, lifted at EPOCH_START until BEFORE_DATALOADER

    def __repr__(self) -> str:
        return self._repr

    @property
    def plan(self) -> Optional[StepPlan]:
        """The current step's plan, while a training epoch or an evaluation is running."""
        return self._loader.current_plan() if self._loader is not None else None

    @property
    def is_shadow_step(self) -> bool:
        """True while this rank runs a shadow step (it has run out of data, others have not)."""
        plan = self.plan
        return plan is not None and not plan.has_batch(self._rank)

    def state_dict(self) -> dict[str, Any]:
        """Saved in Composer checkpoints: the epoch reports (the current one partial) and the wrapper's state.

        With train data that keeps its own position, also every rank's own position: then this is
        collective (one ``all_gather_object``), as Composer's ``State.state_dict()`` is under FSDP:
        Composer calls it on every rank.
        """
        resumed, loader = self._resumed, self._train_loader
        current = loader.report if loader is not None else resumed.current if resumed is not None else None
        wrapper = self._wrapper.state_dict() if self._wrapper is not None else resumed.wrapper if resumed else {}
        ranks = (
            self._positions.gather(loader.progress())
            if self._positions is not None and loader is not None
            else resumed.ranks
            if resumed
            else None
        )
        done = loader.epoch_done() if loader is not None else resumed.epoch_done if resumed is not None else False
        return {**super().state_dict(), **snapshot(self.reports, current, wrapper, ranks, done)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Called by Composer when it loads a checkpoint (``load_path``, ``autoresume``), before ``fit``."""
        self._resumed = restore(state)
        self.reports = self._resumed.reports
        if self._wrapper is not None:
            self._wrapper.load_state_dict(self._resumed.wrapper)

    def match(self, event: Event, state: State) -> bool:
        return event in _EVENTS and (self._active or (self._active is None and event in _STARTS))

    def shadows_microbatch(self, event: Event) -> bool:
        """Whether the current microbatch is a stand-in; for :func:`composer_join.join.passes.join_pass`, at its events."""
        if event in (Event.BEFORE_FORWARD, Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD):
            self._microbatch_start(self._state)  # the pass runs before apply() decides it
        return self._shadow

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event in _STARTS:
            if not self._activate(state):
                return
            self._state = state
        if self._wrapper is None:  # chosen once, at the first FIT_START or EVAL_START
            self._wrapper = wrapper_for(state, self._rank)
            self._wrapper.load_state_dict(self._resumed.wrapper if self._resumed is not None else {})
            self._metric_states.to_device = state.device.tensor_to_device
        if event == Event.FIT_START:
            self._fit_start(state)
        elif event == Event.EPOCH_START:
            self._train_loader.set_epoch(int(state.timestamp.epoch))
            self._cap = lift_cap(state, self._train_loader)
        elif event == Event.BEFORE_DATALOADER:
            if self._cap is not None:  # Composer's loop has read it: schedules and durations read it from here on
                state.dataloader_len, self._cap = self._cap, None
        elif event == Event.BEFORE_TRAIN_BATCH:
            self._wrapper.start_step(self.plan)
        elif event == Event.BEFORE_FORWARD:
            samples = self._microbatch_start(state)
            self._fed_template = not self._wrapper.before_forward(state, self.plan, samples, self._shadow)
            if self._fed_template:
                self._shadow_input(state)
        elif event == Event.AFTER_FORWARD:
            self._wrapper.after_forward(state, self.plan)
        elif event == Event.AFTER_DATALOADER:  # only when other algorithms run at it (composer_join.join.passes)
            if not (self.is_shadow_step and self._stand_in_for_others(state)):
                samples, microbatches = self._loader.describe(state.batch)
                self._loader.plan = replan(self.plan, samples, microbatches, state.device.tensor_to_device)
        elif event == Event.AFTER_LOSS:
            self._wrapper.after_loss(state, self.plan)
        elif event == Event.BEFORE_BACKWARD:  # last (composer_join.join.passes): after any algorithm rewrote the loss
            factor = 0.0 if self._shadow else self.plan.grad_factor(self.divide_by_initial_world_size)
            if factor != 1.0:
                state.loss = scale_grad(state.loss, factor)
        elif event == Event.AFTER_BACKWARD:
            self._after_backward(state)
        elif event in (Event.AFTER_TRAIN_BATCH, Event.EVAL_BATCH_END):
            shadowed = self._unstash_metrics()
            label = state.dataloader_label
            metrics = state.train_metrics if event == Event.AFTER_TRAIN_BATCH else state.eval_metrics.get(label)
            if shadowed:  # no "compute before update" warning that the ranks with data do not give
                count_shadow_update(metrics or {})
            self._metric_states.fill(label, metrics or {})  # Composer computes them next
        elif event == Event.EPOCH_END:
            self._epoch_end(logger)
        elif event == Event.EVAL_START:
            self._eval_start(state)
        elif event == Event.EVAL_BATCH_START:
            self._eval_retry.batch_start(state)
        elif event in (Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD):
            if event == Event.EVAL_BEFORE_FORWARD:
                self._eval_retry.before_forward(state)
            self._microbatch_start(state)
            self._shadow_input(state)
        elif event == Event.PREDICT_AFTER_FORWARD and self._shadow:
            empty_outputs(state)
        elif event == Event.EVAL_AFTER_FORWARD and self._shadow:
            metrics = state.eval_metrics[state.dataloader_label]
            self._metric_states.probe(state.dataloader_label, metrics, shadow_update(state))
            self._stash_metrics(metrics)
        elif event == Event.FIT_END:
            self._wrapper.fit_end(state)
            if self._positions is not None:
                self._positions.close()
        elif event in _CHECKPOINTS:
            if checkpoint_due(state, event):
                self._wrapper.before_checkpoint(state)
        elif event == Event.PREDICT_START:
            self._predict_start(state)
        elif event in (Event.EVAL_END, Event.PREDICT_END):
            if self._loader is not None:
                self._loader.check_ended_together()
            self._loader = self._train_loader

    # -- starting ----------------------------------------------------------------------------------

    def _activate(self, state: State) -> bool:
        if self._active is None:
            world, resumed = dist.get_world_size(), self._resumed
            resized = resumed is not None and resumed.world_size not in (None, world)
            # one rank resuming another world size's checkpoint: active, so the check and the epoch boundary hold
            why = 'enable=False' if not self.enable else 'world size is 1' if world == 1 and not resized else None
            if not self.enable and world > 1:
                # Take part in the enabled ranks' first agreement (its only collective): a rank disabled among
                # enabled ones then stops every rank with an error naming it (composer_join.core.settings).
                agree_on_length(None, None, state.device.tensor_to_device, self._settings)
            self._active = why is None
            self._rank = dist.get_global_rank()
            if why is not None:
                log.info('UnevenJoin is inactive (%s): Composer runs exactly as without it.', why)
        return self._active

    def _fit_start(self, state: State) -> None:
        resumed, self._resumed = self._resumed, None
        resized = check_world_size(resumed, state)  # raises mid-epoch on another world size
        # the checkpoint of an epoch's last batch, on another world size: that epoch ends with no batch
        finished = resized and int(state.timestamp.batch_in_epoch) > 0
        if resized:
            self._wrapper.load_state_dict({})  # DDP: buffers are equal on every rank in a checkpoint
        self._train_loader = self._loader = loader = join_dataloader(
            state,
            self._train_loader,
            self.throw_on_early_termination,
            rebalance=self.mode == 'rebalance',
            settings=self._settings,
            install=lambda changes: self._install_train(state, changes),
            positions=lambda source: self._rank_positions(state, source),
            start=lambda: train_position(state, finished),
            # (at a boundary on another world size, the report of a finished epoch of the old ranks is not this one)
            report=resumed.current if resumed is not None and (finished or not resized) else None,
        )
        self._positions = loader.positions
        if self._positions is not None and resumed is not None and resumed.ranks is not None and not resized:
            own = self._positions.load(resumed.ranks)
            if int(state.timestamp.sample_in_epoch) > 0:
                loader.resume(own, resumed.ranks)
        self._wrapper.fit_start(state, lambda: self.plan)
        if not self.pass_seen:
            raise RuntimeError(
                'UnevenJoin needs its algorithm pass (composer_join.join.passes.join_pass), which `import composer_join` '
                'registers for every Trainer created afterwards; this Trainer was created without it: pass '
                'algorithm_passes=composer_join.join.passes.join_pass to the Trainer',
            )
        refuse_incompatible(state.algorithms, TEMPLATE_SAMPLES)

    def _install_train(self, state: State, changes: Changes) -> None:
        """Each iteration over the train dataloader: the wrapper's changes, and optimizers that branch on the loss."""
        self._wrapper.install(changes, state, lambda: self.plan)
        agree_on_closures(state.optimizers, lambda: self.is_shadow_step, changes)

    def _rank_positions(self, state: State, source: BatchSource) -> Optional[RankPositions]:
        """Per-rank positions for train data that keeps its own (None: left to Composer), read through ``source``."""
        # Composer reaches the dataset through state.train_dataloader, the user's own DataLoader (left untouched).
        dataloader = state.train_dataloader
        reused = self._positions
        if reused is not None and reused.position.target in (dataloader, state._dataset_of(dataloader)):
            position = reused.position  # a second fit() on the same data: it knows what it loaded into it
        else:
            position = position_for(dataloader, state._dataset_of(dataloader), replay=source.reads_ahead)
        return None if position is None else RankPositions(state, position)

    def _eval_start(self, state: State) -> None:
        label = state.dataloader_label
        if pads_by_repeating(state.dataloader):
            # torch's DistributedSampler evens shards out by repeating samples, and Composer's eval
            # loop removes exactly those repeats: nothing is uneven, leave it to Composer.
            self._loader = None
            return
        evaluator = next((e for e in state.evaluators if e.label == label), None)
        self._eval_loaders[label] = self._loader = join_dataloader(
            state,
            self._eval_loaders.get(label),
            microbatch_size=(lambda: evaluator.device_eval_microbatch_size) if evaluator is not None else None,
            settings=self._settings,
            install=lambda changes: self._wrapper.install_eval(changes, state, lambda: self.plan),
        )
        self._loader.set_epoch(int(state.timestamp.batch))  # what Composer does for an eval sampler
        lift_cap(state, self._loader)  # Composer puts the train cap back after the evaluation
        self._wrapper.eval_start(state, lambda: self.plan)

    def _predict_start(self, state: State) -> None:
        """``Trainer.predict()``: every rank predicts its whole shard; ranks that run out shadow (no outputs)."""
        if pads_by_repeating(state.dataloader):
            self._loader = None  # torch's DistributedSampler: evened out by repeats, Composer's business
            return
        self._templates.pop(state.dataloader_label, None)  # each predict() may bring other data
        self._loader = join_dataloader(
            state,
            microbatch_size=-1,
            install=lambda changes: self._wrapper.install_eval(changes, state, lambda: self.plan),
        )
        lift_cap(state, self._loader)
        self._wrapper.eval_start(state, lambda: self.plan)

    # -- per microbatch ----------------------------------------------------------------------------

    def _microbatch_start(self, state: State) -> int:
        """Whether this microbatch is a stand-in (a joined rank's, or an empty padding one); its samples."""
        samples = self._loader.describe(state.batch)[0] if self._loader is not None else -1
        self._shadow = self.is_shadow_step or samples == 0
        return max(samples, 0)

    def _shadow_input(self, state: State) -> None:
        """Shadow: feed the forward two real samples instead of the empty batch; real: keep two.

        A model may take apart the batch it is given (``HuggingFaceModel.eval_forward`` pops
        ``labels`` and shifts them in place), so no batch object goes to the model twice: the
        template is a copy taken before the forward, and every shadow microbatch gets a fresh copy
        of it (two samples, a few small tensor copies).
        """
        label = state.dataloader_label
        if not self._shadow:
            if label not in self._templates:
                self._templates[label] = first_samples(state.batch, TEMPLATE_SAMPLES)
            return
        state.batch = first_samples(self._template(state), TEMPLATE_SAMPLES)

    def _template(self, state: State) -> Any:
        """The current dataloader's template: this rank's first samples, or (never had data) the one other ranks sent."""
        label = state.dataloader_label
        if label not in self._templates:
            self._templates[label] = state.device.batch_to_device(
                first_samples(self._loader.template, TEMPLATE_SAMPLES)
            )
        return self._templates[label]

    def _stand_in_for_others(self, state: State) -> bool:
        """A shadow step's ``AFTER_DATALOADER``: run first (returns True) and last (False), see :mod:`.passes`.

        First: the zero-sample batch is put aside and the two-sample stand-in takes its place, so the
        other algorithms (SelectiveBackprop's extra forward: a collective under FSDP, a buffer broadcast
        under DDP) run as on every rank. Last: the zero-sample batch comes back (Composer counts and
        splits it), with the module buffers as they were.
        """
        if self._held is None:
            self._held = (state.batch, [(b, b.detach().clone()) for b in state.model.buffers()])
            self._shadow = True
            self._shadow_input(state)
            return True
        else:
            state.batch, buffers = self._held
            self._held = None
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
            return False

    def _after_backward(self, state: State) -> None:
        self._wrapper.after_backward(state, self.plan, self._shadow)
        if self._shadow and state.train_metrics:
            # The metrics see the batch the forward ran on: the template, or (a forward that communicates,
            # run on the zero-sample batch) none of it; without outputs (skipped forward) eval_forward runs it.
            template = self._template(state)
            rows = TEMPLATE_SAMPLES if self._fed_template or state.outputs is None else 0
            self._metric_states.probe(
                state.dataloader_label,
                state.train_metrics,
                shadow_update(state, lambda: first_samples(template, rows)),
            )
            self._stash_metrics(state.train_metrics)

    def _stash_metrics(self, metrics: dict) -> None:
        """Empty ``metrics`` in place for this (shadow) microbatch; :meth:`_unstash_metrics` refills it.

        Shadow microbatches come last in a step (padding follows the real ones), so once stashed,
        the metrics stay out until the step or eval batch ends.
        """
        if self._stashed_metrics is None:
            self._stashed_metrics = (metrics, dict(metrics))
        metrics.clear()

    def _unstash_metrics(self) -> bool:
        """Refill the metrics :meth:`_stash_metrics` emptied; True if there were any (a shadow microbatch ran)."""
        if self._stashed_metrics is None:
            return False
        metrics, saved = self._stashed_metrics
        metrics.update(saved)
        self._stashed_metrics = None
        return True

    # -- EPOCH_END ---------------------------------------------------------------------------------

    def _epoch_end(self, logger: Logger) -> None:
        self._train_loader.check_ended_together()
        report = self._train_loader.report
        if not self._train_loader.finished_on_resume:  # (an epoch of the old world size: not this source's)
            self._train_loader.source.complete(report)
        self.reports.append(report)
        logger.log_metrics(report.metrics())  # type: ignore[arg-type]  # ints are floats to a logger
        if self._rank == 0:
            log.info('UnevenJoin %s', report.summary())


def is_shadow_step(state: State) -> bool:
    """True if this rank is running a shadow step: it has run out of data and only keeps the others company.

    Meant for callbacks that should skip shadow steps (e.g. per-rank data statistics). Outside
    training and evaluation, or without an active :class:`UnevenJoin`, it is False.

    Example::

        class CountRealSteps(Callback):
            def batch_end(self, state, logger):
                if not is_shadow_step(state):
                    self.steps += 1
    """
    if not isinstance(state, State):
        raise TypeError(f"is_shadow_step(state) takes the trainer's State (trainer.state), got {type(state).__name__}")
    return any(isinstance(a, UnevenJoin) and a.is_shadow_step for a in state.algorithms)
