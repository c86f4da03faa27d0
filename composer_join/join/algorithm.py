"""``UnevenJoin``: the Composer algorithm that lets ranks with less data join instead of stopping everyone.

The class only routes Composer's events (its table, :data:`ROUTES`) to a
:class:`~composer_join.join.session.Run`, made at the trainer's first active start event (one per trainer, found by
the ``State`` the event comes with: :class:`~composer_join.join.runs.Runs`), and its sessions: a fit's
(:class:`~composer_join.join.fit.FitSession`) and an evaluation's or ``predict()``'s
(:class:`~composer_join.join.evaluation.EvalSession`), which do the work through the pieces beneath them.
``match`` asks the run (:meth:`~composer_join.join.session.Run.wants`): on a training step where no rank shadows,
UnevenJoin matches almost nothing (:mod:`composer_join.join.fit`), so Composer's event loop does not run it there.

========================  ======================================================================
event                     what happens
========================  ======================================================================
``FIT_START``             a fit's session: agree on the epoch length (longest rank's); wrap the train dataloader
                          in a :class:`~composer_join.join.loader.JoinLoader` over the batch source ``mode`` asks
                          for; per-rank positions of data that keeps one; resume; every unstepped schedule's
                          learning rate set again from the agreed length (:mod:`composer_join.interop.schedules`)
``EPOCH_START``           reshuffle a ``DistributedSampler``; where some rank's dataloader may yield more than
                          its ``len()``, lift Composer's ``dataloader_len`` cap until the epoch's loop has
                          started (:func:`~composer_join.join.loader.lift_cap`)
``AFTER_DATALOADER``      only where some rank's trainer has other algorithms or its train ``DataSpec`` a
                          ``batch_transforms``: a shadow step's stand-in for the algorithms that run; every step:
                          the counts again, of the batch Composer trains (:mod:`composer_join.interop.replan`)
``BEFORE_TRAIN_BATCH``    a step UnevenJoin runs in (some rank shadows, or a setting needs it): the wrapper's step
``BEFORE_FORWARD``        the microbatch's record (shadow or real, made once,
                          :class:`~composer_join.join.microbatches.Microbatch`); the wrapper's part of it entered:
                          a stand-in made inert, or run on a two-sample template
``AFTER_FORWARD``         wrapper: automatic microbatching's OOM checks (:mod:`composer_join.interop.oom`)
``AFTER_LOSS``            wrapper check; a stand-in's loss reads zero (its value reaches no log, no callback)
``BEFORE_BACKWARD``       weight the gradient: ``0`` for a stand-in, ``A_t / W`` if asked (last)
``AFTER_BACKWARD``        wrapper: syncing and buffers back, its part of the microbatch exits; a stand-in's
                          metrics kept out
``AFTER_TRAIN_BATCH``     metrics back, list states made syncable (:mod:`composer_join.interop.metrics`)
``EPOCH_END``             stop every rank if some rank could not form a batch; log the epoch's report
``*_CHECKPOINT``          where a checkpoint is saved: wrapper (DDP): buffers equal on every rank;
                          every rank's position in its data gathered (:mod:`composer_join.data.resume`)
``FIT_END``               wrapper (DDP): buffers equal at the end of ``fit``; the positions gathered;
                          the fit's register undone (Composer's checkpointed attributes as they were; the
                          user's train dataloader back in ``state.dataloader``, with Composer's own length)
``EVAL_START``            an evaluation's session: this evaluator's dataloader wrapped the same way (the cap
                          lifted until its loop starts, as at ``EPOCH_START``); wrapper part
``EVAL_BATCH_START``      automatic microbatching: keep the metric states, for a retry after an OOM
``EVAL_BEFORE_FORWARD``   a retry: metric states back; the batch's record, shadow or real, as in training
``EVAL_AFTER_FORWARD``    a stand-in's eval metrics kept out
``EVAL_BATCH_END``        metrics back, list states made syncable
``EVAL_END``              stop every rank if some rank could not form a batch; the session dropped
``PREDICT_*``             as evaluation (:mod:`composer_join.interop.predict`); a stand-in's outputs hold
                          zero samples
========================  ======================================================================

Where it runs among the other algorithms, per event, is set by :mod:`composer_join.join.passes`
(other algorithms never see a shadow microbatch). Every change made to an object UnevenJoin does not own
lasts one iteration over a dataloader and is undone when it ends, also when the run raises
(:mod:`composer_join.core.changes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import dist

from composer_join.core import compat
from composer_join.core.exchange import agree_on_length
from composer_join.core.plan import StepPlan
from composer_join.core.report import EpochReport
from composer_join.core.settings import row as settings_row
from composer_join.data.resume import restore, snapshot
from composer_join.interop.predict import PREDICT_EVENTS
from composer_join.join.context import Settings
from composer_join.join.fit import CHECKPOINT_EVENTS, TRAIN_MICROBATCH_EVENTS
from composer_join.join.loader import JoinLoader
from composer_join.join.runs import Runs
from composer_join.join.session import Run

__all__ = ['MICROBATCH_EVENTS', 'ROUTES', 'UnevenJoin', 'is_shadow_step']

log = logging.getLogger(__name__)

_STARTS = frozenset((Event.FIT_START, Event.EVAL_START, Event.PREDICT_START))
# the per-microbatch events, at which composer_join.join.passes keeps the other algorithms off a shadow microbatch
MICROBATCH_EVENTS = TRAIN_MICROBATCH_EVENTS | frozenset(
    (
        Event.EVAL_BEFORE_FORWARD,
        Event.EVAL_AFTER_FORWARD,
        Event.PREDICT_BEFORE_FORWARD,
        Event.PREDICT_AFTER_FORWARD,
    )
)

Route = Callable[[Run, State, Logger, Event], None]
ROUTES: dict[Event, Route] = {
    Event.FIT_START: lambda run, state, logger, event: run.fit_start(state),
    Event.EPOCH_START: lambda run, state, logger, event: run.fit.epoch_start(state),
    Event.AFTER_DATALOADER: lambda run, state, logger, event: run.fit.after_dataloader(state),
    Event.BEFORE_TRAIN_BATCH: lambda run, state, logger, event: run.fit.before_train_batch(state),
    Event.BEFORE_FORWARD: lambda run, state, logger, event: run.fit.before_forward(state),
    Event.AFTER_FORWARD: lambda run, state, logger, event: run.fit.after_forward(state),
    Event.AFTER_LOSS: lambda run, state, logger, event: run.fit.after_loss(state),
    Event.BEFORE_BACKWARD: lambda run, state, logger, event: run.fit.before_backward(state),
    Event.AFTER_BACKWARD: lambda run, state, logger, event: run.fit.after_backward(state),
    Event.AFTER_TRAIN_BATCH: lambda run, state, logger, event: run.fit.after_train_batch(state),
    Event.EPOCH_END: lambda run, state, logger, event: run.fit.epoch_end(state, logger),
    Event.FIT_END: lambda run, state, logger, event: run.fit_end(state),
    Event.EVAL_START: lambda run, state, logger, event: run.eval_start(state),
    Event.EVAL_BATCH_START: lambda run, state, logger, event: run.evaluation.batch_start(state),
    Event.EVAL_BEFORE_FORWARD: lambda run, state, logger, event: run.evaluation.before_forward(state),
    Event.EVAL_AFTER_FORWARD: lambda run, state, logger, event: run.evaluation.after_forward(state),
    Event.EVAL_BATCH_END: lambda run, state, logger, event: run.evaluation.batch_end(state),
    Event.EVAL_END: lambda run, state, logger, event: run.eval_end(state),
    Event.PREDICT_START: lambda run, state, logger, event: run.eval_start(state, predict=True),
    Event.PREDICT_BEFORE_FORWARD: lambda run, state, logger, event: run.evaluation.before_forward(state),
    Event.PREDICT_AFTER_FORWARD: lambda run, state, logger, event: run.evaluation.after_forward(state),
    Event.PREDICT_END: lambda run, state, logger, event: run.eval_end(state),
    **{e: lambda run, state, logger, event: run.fit.checkpoint(state) for e in CHECKPOINT_EVENTS},
}
"""What each event does: a method of the :class:`~composer_join.join.session.Run` or of its current session."""
assert ROUTES.keys() >= PREDICT_EVENTS
# The events UnevenJoin may match: on a shadow microbatch it must match every microbatch event (the pass sees only
# matching algorithms, so it keeps the others off only where UnevenJoin matches). By identity: Composer's Event
# hashes and compares in Python, and match runs at every event.
_EVENT_IDS = frozenset(map(id, frozenset(ROUTES) | MICROBATCH_EVENTS))


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
    batch, and one small one (``104 * W`` bytes) on each step from there on; without a ``len()`` on
    some rank, that small one on every step. A shadow step is inert (``docs/shadow-steps.md``): under DDP
    it runs no model code, only DDP's collectives; where the forward communicates (``SyncBatchNorm``) a
    forward and backward on zero samples; under FSDP on two template samples, with a zero loss.
    Where some rank's trainer has another algorithm (it may reshape the batch at ``AFTER_DATALOADER``), every
    agreed step costs one all-reduce of two integers per rank more (:mod:`composer_join.interop.replan`). On an
    agreed step the decisions are array operations on the agreement's table (about 0.1 ms of CPU at 1,024 ranks,
    ``docs/benchmarks.md``); on a planned step nothing in them grows with the world size.

    Example::

        from composer import Trainer
        from composer_join import UnevenJoin

        trainer = Trainer(
            model=model, train_dataloader=this_ranks_shard, max_duration='2ep',
            algorithms=[UnevenJoin()],
        )
        trainer.fit()
        print(trainer.state.algorithms[0].reports[-1].summary())  # what each rank trained

    One object may be given to several Trainers (a sweep, a notebook): each gets a run of its own, found by its
    ``State`` (its reports: :meth:`reports_of`; its checkpoint entry; kept while this object lives).

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
        self.pass_seen = False  # set by composer_join.join.passes.join_pass when the Engine runs it
        # per Trainer (its State): active or not (decided at its first FIT_START, EVAL_START or PREDICT_START), its run
        # (made then, where active), what a checkpoint gave it
        self._runs = Runs()

    def __repr__(self) -> str:  # Composer formats the algorithm into a trace key at every event it runs
        return (
            f'UnevenJoin(divide_by_initial_world_size={self.divide_by_initial_world_size}, '
            f'enable={self.enable}, throw_on_early_termination={self.throw_on_early_termination}'
            + (f', mode={self.mode!r})' if self.mode != 'shadow' else ')')
        )

    @property
    def _run(self) -> Optional[Run]:
        """The run of the Trainer that sent the latest event (:class:`~composer_join.join.runs.Runs`)."""
        return self._runs.current

    @property
    def reports(self) -> list[EpochReport]:
        """One report per finished training epoch of the Trainer that sent the latest event, the same on every rank
        (with a checkpoint loaded, its epochs first). A Trainer's own: :meth:`reports_of`."""
        return self._runs.reports(None)

    def reports_of(self, state: State) -> list[EpochReport]:
        """The reports of the Trainer whose state is ``state`` (one ``UnevenJoin`` may serve several Trainers, each
        with its own run); ``[]`` if UnevenJoin has not run for it (or, inactive, what a checkpoint gave it)."""
        return self._runs.reports(state)

    @property
    def plan(self) -> Optional[StepPlan]:
        """The current step's plan, while a training epoch or an evaluation is running."""
        return self._run.plan() if self._run is not None else None

    @property
    def is_shadow_step(self) -> bool:
        """True while this rank runs a shadow step (it has run out of data, others have not), in the Trainer that sent
        the latest event; a given Trainer's: :func:`is_shadow_step` of its state."""
        return self._run is not None and self._run.shadow_step

    def shadows_in(self, state: State) -> bool:
        """True while this rank runs a shadow step (or a training step's stand-in microbatch) in the Trainer whose
        state is ``state``: :func:`is_shadow_step`."""
        run = self._runs.get(state)
        return run is not None and run.shadows_now

    @property
    def train_loader(self) -> Optional[JoinLoader]:
        """The join's loader of the current (or last) fit, for diagnostics: its report, source, positions."""
        return self._run.train if self._run is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Saved in Composer checkpoints: the epoch reports (the current one partial) and the wrapper's state.

        With train data that keeps its own position, also every rank's own position, as gathered on every rank
        at Composer's checkpoint event before the save (or at ``FIT_END``). Not collective: one rank may call it
        alone; where nothing was gathered for the current step, it holds no position and warns
        (:meth:`composer_join.data.resume.RankPositions.entries`). Of the Trainer whose ``State.state_dict`` calls it
        (one ``UnevenJoin`` may serve several Trainers, each with its own run), else of the one that sent the latest
        event.
        """
        trainer = compat.calling_state()
        run_of, resumed = self._runs.saved_by(trainer)
        reports = self._runs.reports(trainer)
        if run_of is not None:
            run = run_of.saved()
        else:  # inactive, or not started: what a checkpoint gave, unchanged
            run = {
                'current': resumed.current if resumed else None,
                'wrapper': resumed.wrapper if resumed else {},
                'ranks': resumed.ranks if resumed else None,
                'epoch_done': resumed.epoch_done if resumed else False,
                'groups': resumed.groups if resumed else None,
                'positions_unsaved': resumed.positions_unsaved if resumed else False,
            }
        return {**super().state_dict(), **snapshot(reports, **run)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Called by Composer when it loads a checkpoint (``load_path``, ``autoresume``), before ``fit``: for the
        Trainer whose ``State.load_state_dict`` calls it (else the one that sent the latest event)."""
        resumed = restore(state)
        run = self._runs.load(compat.calling_state(), resumed)
        if run is not None:
            run.loaded(resumed)

    def match(self, event: Event, state: State) -> bool:
        """Whether UnevenJoin runs at ``event`` for the Trainer whose state is ``state``: active, as its run decides
        (:meth:`Run.wants`: on a training step where no rank shadows, almost never); not decided yet, at a start
        event."""
        run = self._runs.of(state)
        if run is not None:  # (made where active)
            return id(event) in _EVENT_IDS and run.wants(event, state)
        return event in _STARTS and not self._runs.decided(state)

    def stands_in(self, others: bool) -> bool:
        """For :mod:`composer_join.join.passes` at ``AFTER_DATALOADER``: whether other algorithms (``others``) run
        on a shadow step here, so that UnevenJoin first puts the stand-in in place for them."""
        if self._run is None or self._run.fit is None:
            return False
        self._run.fit.others_at_dataloader = others
        return others and self.is_shadow_step

    def shadows_microbatch(self, event: Event) -> bool:
        """Whether the current microbatch is a stand-in (its record, made in ``match``); for
        :func:`composer_join.join.passes.join_pass`, at its events."""
        return self._run is not None and self._run.shadows(event)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event in _STARTS and not self._activate(state):
            return
        if not self.pass_seen and event == Event.FIT_START:
            raise RuntimeError(
                'UnevenJoin needs its algorithm pass (composer_join.join.passes.join_pass), which `import composer_join` '
                'registers for every Trainer created afterwards; this Trainer was created without it: pass '
                'algorithm_passes=composer_join.join.passes.join_pass to the Trainer',
            )
        route = ROUTES.get(event)
        if route is not None and self._run is not None:
            route(self._run, state, logger, event)

    def _activate(self, state: State) -> bool:
        """At a Trainer's first start event: active for it (its :class:`~composer_join.join.session.Run` made) or not,
        and why."""
        if not self._runs.decided(state):
            world, resumed = dist.get_world_size(), self._runs.take_pending(state)
            resized = resumed is not None and resumed.world_size not in (None, world)
            # one rank resuming another world size's checkpoint: active, so the check and the epoch boundary hold
            why = 'enable=False' if not self.enable else 'world size is 1' if world == 1 and not resized else None
            settings = settings_row(
                self.enable, self.mode, self.throw_on_early_termination, self.divide_by_initial_world_size
            )
            if not self.enable and world > 1:
                # Take part in the enabled ranks' first agreement (its only collective): a rank disabled among
                # enabled ones then stops every rank with an error naming it (composer_join.core.settings).
                agree_on_length(None, None, state.device.tensor_to_device, settings)
            run = None
            if why is not None:
                log.info('UnevenJoin is inactive (%s): Composer runs exactly as without it.', why)
            else:
                config = Settings(
                    self.mode, self.divide_by_initial_world_size, self.throw_on_early_termination, tuple(settings)
                )
                reports = list(resumed.reports) if resumed is not None else []
                run = Run(state, config, reports, resumed, self)
            self._runs.add(state, run, resumed)
        return self._runs.of(state) is not None


def is_shadow_step(state: State) -> bool:
    """True if this rank is running a shadow step: it has run out of data and only keeps the others company.

    Meant for callbacks that should skip shadow steps (e.g. per-rank data statistics). Outside
    training and evaluation, or without an active :class:`UnevenJoin`, it is False. Inside a training step it is
    also True for a stand-in microbatch, from its ``BEFORE_FORWARD`` to its ``AFTER_BACKWARD``: one that pads this
    rank's microbatches to the step's largest count (FSDP; DDP where the forward communicates), whose batch is the
    stand-in's (two template samples, weighted zero, or zero samples), not data to count; inside an evaluation
    batch likewise for a microbatch padding it (FSDP), from its ``EVAL_BEFORE_FORWARD`` to its ``EVAL_AFTER_FORWARD``
    (False again at the real batch's ``EVAL_BATCH_END``).

    Example::

        class CountRealSteps(Callback):
            def batch_end(self, state, logger):
                if not is_shadow_step(state):
                    self.steps += 1
    """
    if not isinstance(state, State):
        raise TypeError(f"is_shadow_step(state) takes the trainer's State (trainer.state), got {type(state).__name__}")
    return any(isinstance(a, UnevenJoin) and a.shadows_in(state) for a in state.algorithms)
