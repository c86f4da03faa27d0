"""One ``fit()`` under UnevenJoin: its train loader, positions and register of changes, and the work at its events.

A :class:`FitSession` is made by the run (:class:`~composer_join.join.session.Run`) at ``FIT_START`` and is its
current fit until ``FIT_END`` (afterwards the last one: a checkpoint saved after ``fit()`` reads its report and
positions, and the next fit takes over what its loader learned). It owns:

* the train :class:`~composer_join.join.loader.JoinLoader` (:func:`~composer_join.join.fitdata.train_loader`;
  replaced once where the rest of an epoch resumed on another world size ends) and the per-rank positions of train
  data that keeps one;
* the fit's register of changes (:mod:`composer_join.core.changes`): what a fit changes on Composer's ``State``,
  undone at ``FIT_END``, or when the next fit starts after one that raised: among them ``state.dataloader``, the
  join's loader from ``FIT_START`` (after the other algorithms) to ``FIT_END``, then the user's again, with
  Composer's own ``dataloader_len`` for it, exactly as a fit without UnevenJoin leaves them;
* the microbatches of the train loader's steps (:class:`~composer_join.join.microbatches.Microbatches`).

**Which events it matches** (:meth:`FitSession.wants`, asked by ``UnevenJoin.match`` at every event): Composer's
engine runs an algorithm's ``apply``, with its own bookkeeping, for every event the algorithm matches. A step is
*watched* (decided at its ``BEFORE_TRAIN_BATCH``, the same way on every rank where it issues collectives) where
some rank shadows, this rank's batch or one of its microbatches has no samples, a real microbatch has yet to give
the stand-in input, or the wrapper needs it (:meth:`~composer_join.wrappers.wrapper.Wrapper.watches`: automatic
microbatching, microbatch syncs on uneven counts, FSDP). On a watched step it matches every step and microbatch
event, as before issue 41; on any other step only ``AFTER_DATALOADER`` where some rank's trainer has other algorithms or its train ``DataSpec`` a
``batch_transforms`` (agreed), ``AFTER_TRAIN_BATCH`` where
the train metrics have list states (made syncable) and a checkpoint event where a checkpoint is saved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from composer.core import DataSpec, Event, State
from composer.loggers import Logger
from composer.utils import dist

from composer_join.core import compat
from composer_join.core.changes import Changes
from composer_join.core.plan import StepPlan
from composer_join.data.resume import RankPositions, Resumed, check_world_size
from composer_join.interop.closures import agree_on_closures
from composer_join.interop.metrics import has_list_states
from composer_join.interop.refusals import refuse_incompatible
from composer_join.interop.replan import replan
from composer_join.interop.schedules import agree_schedules
from composer_join.join.context import Context
from composer_join.join.fitdata import Rest, mid_epoch, rest_of_epoch, train_loader, unsaved_positions
from composer_join.join.loader import JoinLoader, lift_cap
from composer_join.join.microbatches import TEMPLATE_SAMPLES, Microbatches
from composer_join.shadow.buffers import checkpoint_due
from composer_join.shadow.dataspec import split_gave_empty
from composer_join.shadow.gradients import scale_grad

__all__ = ['CHECKPOINT_EVENTS', 'FIT_EVENTS', 'TRAIN_MICROBATCH_EVENTS', 'FitSession']

log = logging.getLogger(__name__)

TRAIN_MICROBATCH_EVENTS = frozenset(
    (
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
    )
)
"""A training microbatch's events (the algorithm pass keeps the others off a stand-in at these)."""
CHECKPOINT_EVENTS = frozenset((Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT))
FIT_EVENTS = (
    frozenset(
        (
            Event.EPOCH_START,
            Event.AFTER_DATALOADER,
            Event.BEFORE_TRAIN_BATCH,
            Event.AFTER_TRAIN_BATCH,
            Event.EPOCH_END,
        )
    )
    | TRAIN_MICROBATCH_EVENTS
    | CHECKPOINT_EVENTS
)
"""The events of a fit that its session decides on (:meth:`FitSession.wants`)."""
# by identity: Composer's Event hashes and compares in Python, ten times the cost of a set of ints (match runs at
# every event of every step)
_MICROBATCH_IDS = frozenset(map(id, TRAIN_MICROBATCH_EVENTS))
_CHECKPOINT_IDS = frozenset(map(id, CHECKPOINT_EVENTS))


class FitSession:
    """One ``fit()``: made at ``FIT_START`` (the length agreement, the train loader, a checkpoint's positions).

    Args:
        context: what the trainer's sessions share (:class:`~composer_join.join.context.Context`).
        resumed: what a checkpoint gave, if Composer loaded one before this fit.
        previous: the trainer's last fit, if any (ended, or left by a run that raised).
    """

    def __init__(self, context: Context, resumed: Optional[Resumed], previous: Optional[FitSession]):
        self.context, self.state = context, context.state
        self.others_at_dataloader = False  # other algorithms run at this step's AFTER_DATALOADER, here (the pass)
        self.watched = False  # UnevenJoin runs at every event of the current step
        self.changes = Changes()  # the fit's register: undone at FIT_END
        self._metrics: tuple[Any, bool] = (None, False)  # the train metrics seen, and whether they have list states
        # () -> the train loader of the epochs after the rest of an epoch resumed elastically (made at its end)
        self.after_epoch: Optional[Callable[[], JoinLoader]] = None
        self.rest: Optional[Rest] = None  # this rank's share of an epoch resumed on another world size (_start)
        state = self.state
        user, label, cap = state.dataloader, state.dataloader_label, state.dataloader_len  # the user's, Composer's cap
        # Composer's view of the train data (its DataSpec, spin setting, dataset), read once, here: the facts, the
        # loader's counts, positions and start, the stand-ins and the wrapper's padding are all handed this one
        self.view = compat.train_view(state)
        self.positions: Optional[RankPositions] = None  # (set with the loader, _use)
        self.changes.call(lambda: self.positions.close() if self.positions is not None else None)
        self.changes.call(lambda: state.set_dataloader(user, label, -1 if cap is None else cap))
        try:
            self._start(state, resumed, previous)
        except BaseException:  # a fit that cannot start (an error on every rank): nothing of it outlives it
            self.changes.undo()
            raise
        agree_schedules(state)  # the agreed length is in force: the first step's learning rate from it

    def _use(self, loader: JoinLoader) -> None:
        """Read ``loader`` from now on (its positions, its microbatches)."""
        self.loader, self.positions = loader, loader.positions
        # some rank's trainer has algorithms besides UnevenJoin, or its DataSpec a batch_transforms (the first
        # agreement): every step's AFTER_DATALOADER counts again what Composer trains (composer_join.interop.replan)
        self.recounts = any(f.others or f.transforms for f in loader.facts)
        spec = self.view.spec if self.view.spec is not None else DataSpec(loader.dataloader)
        self.microbatches = Microbatches(self.state, loader, spec, self.context.rank)

    def _start(self, state: State, resumed: Optional[Resumed], previous: Optional[FitSession]) -> None:
        context = self.context
        if resumed is None and previous is not None and previous.in_elastic_rest:
            resumed = previous.rest_so_far(state)  # taken up where the last fit stopped in it
        earlier = previous.loader if previous is not None else None
        reused = previous.positions.position if previous is not None and previous.positions is not None else None
        unsaved = resumed is not None and resumed.positions_unsaved and mid_epoch(state, resumed)
        if unsaved and resumed.world_size not in (None, dist.get_world_size()):
            raise unsaved_positions(state)
        rest = rest_of_epoch(
            state, resumed, context.layout, self.view.dataset
        )  # this rank's share of an epoch resumed elastically
        resized = check_world_size(resumed, state, rest is not None, context.layout)  # else raises mid-epoch
        # the checkpoint of an epoch's last batch, on another world size: that epoch ends with no batch
        finished = resized and int(state.timestamp.batch_in_epoch) > 0 and rest is None
        if resized:
            context.wrapper.load_state_dict({})  # DDP: buffers are equal on every rank in a checkpoint
        self.rest = rest
        if rest is not None and rest.indices is not None and 'train' not in state.dataset_resumption:
            # Composer's flag: no replay (the rest of the epoch is a loader of its own), for this fit only
            state.dataset_resumption['train'] = True
            self.changes.call(lambda: state.dataset_resumption.pop('train', None))
        if rest is not None:
            cap = state.dataloader_len  # Composer's, for the user's train dataloader (a subset of it, say)
            self._use(train_loader(context, state, self.view, earlier, self._install, reused, rest=rest))
            # the next epoch: the sampler's shards again, as many batches as Composer would take
            self.after_epoch = lambda: train_loader(
                context, state, self.view, self.loader, self._install, self._position(), cap=cap
            )
        else:
            report = resumed.current if resumed is not None and (finished or not resized) else None
            self._use(
                train_loader(
                    context, state, self.view, earlier, self._install, reused, finished=finished, report=report
                )
            )
        if unsaved and self.positions is not None and self.positions.position.resumes_itself:
            raise unsaved_positions(state)
        # a position the data keeps itself, on the same world size: each rank its own
        positions, saved = self.positions, resumed.ranks if resumed is not None and not resized else None
        if positions is not None and positions.position.resumes_itself and saved is not None:
            own = positions.load(saved)
            if int(state.timestamp.sample_in_epoch) > 0:
                self.loader.resume(own, saved)
        context.wrapper.start(state, train=True)
        context.wrapper.agreed(state, self.loader.facts)  # what earlier fits taught each rank, alike on every rank
        refuse_incompatible(state.algorithms, TEMPLATE_SAMPLES)

    @property
    def in_elastic_rest(self) -> bool:
        """This fit reads (or stopped in) the rest of an epoch resumed on another world size, by indices."""
        return self.after_epoch is not None and self.rest is not None and self.rest.indices is not None

    def rest_so_far(self, state: State) -> Optional[Resumed]:
        """Where every rank stands in the rest of an epoch resumed on another world size, in which this fit stopped
        (:attr:`in_elastic_rest`), as a checkpoint of this world size would hold it: the trainer's next fit takes
        the rest up from it. Called at that fit's start, on every rank.

        The positions gathered at Composer's current timestamp (a checkpoint saved there, ``FIT_END``), else
        gathered now (a collective, on every rank alike) after the steps Composer counts as trained: a step the run
        raised in after its batch was read is not, so its samples are the next fit's, as Composer replays such a
        step on the same world size.
        """
        positions = self.positions
        if positions is None:
            return None
        if positions.gathered_now() is None:
            positions.gather(self.loader.progress(int(state.timestamp.batch_in_epoch)))
        ranks = positions.gathered_now()
        return Resumed(
            reports=[],
            current=self.loader.report,
            wrapper={},
            ranks=ranks,
            world_size=dist.get_world_size(),
            epoch_done=False,
        )

    def _position(self) -> Any:
        return self.positions.position if self.positions is not None else None

    def _install(self, changes: Changes) -> None:
        """Each iteration over the train dataloader: the wrapper's changes, and optimizers that branch on the loss."""
        self.context.wrapper.install(changes, self.state, self.plan, train=True, spec=self.view.spec)
        agree_on_closures(self.state.optimizers, lambda: self.shadow_step, changes)

    def plan(self) -> Optional[StepPlan]:
        """The current step's plan (None outside a step)."""
        return self.loader.current_plan()

    @property
    def shadow_step(self) -> bool:
        """This rank runs a shadow step: it has run out of data, others have not."""
        return self.loader.shadowing

    @property
    def shadows_now(self) -> bool:
        """What :func:`~composer_join.is_shadow_step` reports: a shadow step, or, in a real step, a stand-in
        microbatch running (one padding this rank's microbatches to the step's largest count)."""
        return self.loader.shadowing or self.microbatches.in_stand_in()

    def close(self) -> None:
        """End what a run that raised left of this fit: its iteration, its register (before the next fit starts)."""
        self.loader.close_iteration()
        self.changes.undo()

    # -- which events ---------------------------------------------------------------------------------

    def wants(self, event: Event, state: State) -> bool:
        """Whether UnevenJoin runs at ``event`` now (see the module docstring); at ``BEFORE_FORWARD`` of a watched
        step, the microbatch's record is made here, before the algorithm pass reads it."""
        key = id(event)
        if key in _MICROBATCH_IDS:
            if self.watched and event is Event.BEFORE_FORWARD:
                self._begin_microbatch(state)
            return self.watched
        if event is Event.BEFORE_TRAIN_BATCH:
            self.watched = self._watch(state)
            return self.watched
        if event is Event.AFTER_DATALOADER:
            return self.recounts
        if event is Event.AFTER_TRAIN_BATCH:
            return self.watched or self._fills(state)
        if key in _CHECKPOINT_IDS:
            return checkpoint_due(state, event)
        return True

    def _watch(self, state: State) -> bool:
        """Whether UnevenJoin runs at every event of the step starting now (see the module docstring)."""
        plan = self.plan()
        if plan is None:
            return False
        return bool(
            plan.joined_ranks  # some rank shadows (the same on every rank)
            or plan.statuses[self.context.rank].samples == 0  # a batch of no samples: a stand-in here
            or split_gave_empty(self.microbatches.spec)  # a microbatch of no samples: a stand-in here
            or self.microbatches.learning  # the stand-in input is taken from a real microbatch
            or self.context.wrapper.watches(state, plan)
        )

    def _fills(self, state: State) -> bool:
        """Whether the train metrics have list states (made syncable after every step)."""
        metrics = state.train_metrics
        if self._metrics[0] is not metrics:
            self._metrics = (metrics, any(has_list_states(m) for m in (metrics or {}).values()))
        return self._metrics[1]

    def _begin_microbatch(self, state: State) -> None:
        plan = self.plan()
        wrapper = self.context.wrapper
        self.microbatches.begin(
            plan,
            lambda shadow, samples: wrapper.microbatch(state, plan, shadow, samples),
            self.context.settings.divide,
        )

    # -- a training epoch -----------------------------------------------------------------------------

    def epoch_start(self, state: State) -> None:
        self.loader.set_epoch(int(state.timestamp.epoch))
        lift_cap(state, self.loader)  # only where some rank's dataloader may yield more than its len()

    def after_dataloader(self, state: State) -> None:
        """Only where some rank's trainer has other algorithms or its train ``DataSpec`` a ``batch_transforms``
        (agreed): a shadow step's stand-in for the algorithms that run here, first and last
        (:mod:`composer_join.join.passes`); every step: the counts again, which they or the transform may have changed
        (on every rank, whatever each algorithm matches; gathered on agreed steps, :func:`~composer_join.interop.replan.replan`)."""
        if self.others_at_dataloader and self.shadow_step and self.microbatches.stand_in_for_others():
            return
        samples, microbatches = self.loader.describe(state.batch)
        plan = replan(self.plan(), samples, microbatches, self.loader.exchange, self.context.rank)
        self.loader.publish(plan)

    def epoch_end(self, state: State, logger: Logger) -> None:
        """Stop every rank if some rank could not form a batch; log the epoch's report (rebalance: bytes moved)."""
        self.loader.check_ended_together()
        report = self.loader.report
        if not self.loader.finished_on_resume:  # (an epoch of the old world size: not this source's)
            self.loader.source.complete(report)
        self.context.reports.append(report)
        logger.log_metrics(report.metrics())  # type: ignore[arg-type]  # ints are floats to a logger
        if self.context.rank == 0:
            log.info('UnevenJoin %s', report.summary())
        if self.after_epoch is not None:  # the rest of an epoch resumed elastically is done: the sampler's shards
            after, self.after_epoch = self.after_epoch, None
            self._use(after())

    def checkpoint(self, state: State) -> None:
        """A ``*_CHECKPOINT`` event at which a checkpoint is saved (routed only where :meth:`wants` found one due, the
        same on every rank: Composer's save is collective too, its RNG states): the wrapper makes its contents equal on
        every rank, and every rank's position is gathered for it (``State.state_dict()`` then only reads them)."""
        self.context.wrapper.equalize(state)
        self.gather_positions()

    def end(self, state: State) -> None:
        """``FIT_END``: buffers equal on every rank, the positions gathered (a checkpoint saved after ``fit()`` holds
        them), the fit's register undone."""
        self.context.wrapper.equalize(state)
        if self.positions is not None:  # every rank
            self.gather_positions(strict=False)
        self.changes.undo()

    def gather_positions(self, strict: bool = True) -> None:
        """Every rank's position now, for a checkpoint (:meth:`RankPositions.gather`): call on every rank alike."""
        if self.positions is not None:
            self.positions.gather(self.loader.progress(), strict)

    # -- a training step ------------------------------------------------------------------------------

    def before_train_batch(self, state: State) -> None:
        """A watched step begins (again at each attempt Composer retries): a microbatch left unfinished exits."""
        self.microbatches.step().exit()
        self.context.wrapper.begin_step(state, self.plan())

    def before_forward(self, state: State) -> None:
        step = self.microbatches.step()
        step.enter()
        self.microbatches.feed(step.microbatch)

    def after_forward(self, state: State) -> None:
        self.microbatches.step().wrapped.after_forward(state)

    def after_loss(self, state: State) -> None:
        """The wrapper's check; a stand-in's loss reads zero from here on: its value (a mean over no real token is
        NaN) would reach Composer's logged loss and the callbacks (a ``NaNMonitor``) on this rank alone."""
        step = self.microbatches.step()
        step.wrapped.after_loss(state)
        if step.microbatch.shadow:
            state.loss = scale_grad(state.loss, 0.0)

    def before_backward(self, state: State) -> None:
        """Weight the gradient: 0 for a stand-in, ``A_t / W`` if asked (last: after any algorithm rewrote the loss)."""
        weight = self.microbatches.step().microbatch.weight
        if weight != 1.0:
            state.loss = scale_grad(state.loss, weight)

    def after_backward(self, state: State) -> None:
        step = self.microbatches.step()
        step.wrapped.after_backward(state)
        step.exit()
        self.microbatches.keep_train_metrics_out(step.microbatch)

    def after_train_batch(self, state: State) -> None:
        self.microbatches.microbatches_over()
        self.microbatches.metrics_back(state.train_metrics)
