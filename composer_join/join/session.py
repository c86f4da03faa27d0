"""What UnevenJoin holds for one trainer while it is active, and the work it does at each of Composer's events.

:class:`Run` is made at the trainer's first active start event (``FIT_START``, ``EVAL_START`` or
``PREDICT_START``) by :class:`~composer_join.UnevenJoin`, which routes every event to one of its methods
(the algorithm's table). A run holds:

* the wrapper's part (:mod:`composer_join.wrappers`: DDP, FSDP1/2 or none), chosen once;
* the join's loader of the current fit (:class:`~composer_join.join.loader.JoinLoader`) and the last one per
  evaluator label (each start builds a new one; one made earlier for the same dataloader object hands on what was
  learned from its batches, :class:`~composer_join.join.loader.Learned`), and which one's plan is current;
* the per-rank positions of train data that keeps one (:mod:`composer_join.data.resume`);
* the microbatch bookkeeping (:class:`~composer_join.join.microbatches.Microbatches`);
* Composer's train ``dataloader_len`` while it is lifted (:func:`~composer_join.join.loader.lift_cap`).

Every change to an object UnevenJoin does not own is made per iteration over a dataloader, through the loader's
register of changes (:mod:`composer_join.core.changes`), and undone when that iteration ends, also when the run
raises; what a fit changes on Composer's own ``State`` (its checkpointed attributes) is put back at ``FIT_END``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any, NamedTuple, Optional, cast

from composer.core import DataSpec, Event, State
from composer.loggers import Logger
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join.core import compat
from composer_join.core.changes import Changes
from composer_join.core.errors import UnevenInputsError
from composer_join.core.layout import trainer_layout
from composer_join.core.plan import StepPlan
from composer_join.core.report import EpochReport
from composer_join.core.settings import SHADOW_WAYS, Facts
from composer_join.core.source import BatchSource
from composer_join.data.elastic import (
    GlobalOrder,
    GlobalOrderPosition,
    layout_of,
    one_epoch_loader,
    remaining_for,
)
from composer_join.data.positions import (
    Position,
    agreed_position,
    keeps_state,
    kind_of,
    left_to_composer,
    position_for,
)
from composer_join.data.resume import RankPositions, Resumed, check_world_size, train_position
from composer_join.interop.closures import agree_on_closures
from composer_join.interop.predict import empty_outputs
from composer_join.interop.refusals import refuse_incompatible
from composer_join.interop.replan import replan
from composer_join.join.loader import JoinLoader, join_dataloader, lift_cap, pads_by_repeating
from composer_join.join.microbatches import TEMPLATE_SAMPLES, Microbatches
from composer_join.shadow.buffers import checkpoint_due
from composer_join.shadow.gradients import scale_grad
from composer_join.wrappers import wrapper_for

__all__ = ['Rest', 'Run']

log = logging.getLogger(__name__)


class Rest(NamedTuple):
    """The rest of an epoch resumed on another world size: this rank's indices, the layout, the sampler's order;
    or (all None) data Composer resumes itself (mosaicml-streaming), whose rest of the epoch has no known length."""

    indices: Optional[list[int]] = None
    layout: Optional[dict[str, Any]] = None
    order: Optional[GlobalOrder] = None


class Run:
    """One trainer's UnevenJoin while active: its loaders, positions and wrapper part, per Composer event.

    Args:
        state: the trainer's state, at its first active start event.
        settings: the algorithm's ``(mode, divide_by_initial_world_size, throw_on_early_termination)`` and
            its settings row (:func:`composer_join.core.settings.row`), compared across ranks.
        reports: the algorithm's list of finished epochs' reports (appended to at ``EPOCH_END``).
        resumed: what a checkpoint gave, if Composer loaded one before this start.
        algorithm: the :class:`~composer_join.UnevenJoin` whose run this is (the trainer's other algorithms are the
            ones besides it).
    """

    def __init__(
        self,
        state: State,
        mode: str,
        divide_by_initial_world_size: bool,
        throw_on_early_termination: bool,
        settings_row: list[int],
        reports: list[EpochReport],
        resumed: Optional[Resumed],
        algorithm: Any = None,
    ):
        self.state, self.algorithm = state, algorithm
        self.mode, self.divide, self.throw = mode, divide_by_initial_world_size, throw_on_early_termination
        self.settings_row, self.reports, self.resumed = settings_row, reports, resumed
        self.rank = dist.get_global_rank()
        self.layout = trainer_layout(state)  # the data-parallel members: tensor-parallel groups join as one
        self.wrapper = wrapper_for(state, self.rank)
        self.wrapper.load_state_dict(resumed.wrapper if resumed is not None else {})
        self.loader: Optional[JoinLoader] = None  # the loader whose plan is current (train or eval)
        self.train: Optional[JoinLoader] = None
        self.evals: list[JoinLoader] = []  # the evaluators' loaders, while their dataloaders are the trainer's
        self.positions: Optional[RankPositions] = None
        self.cap: Any = None  # Composer's train dataloader_len, lifted at EPOCH_START until BEFORE_DATALOADER
        self.others_at_dataloader = False  # other algorithms run at this step's AFTER_DATALOADER, here (the pass)
        # () -> the train loader of the epochs after the rest of an epoch resumed elastically (made at its end)
        self.after_epoch: Optional[Callable[[], JoinLoader]] = None
        self.microbatches = Microbatches(self.plan, self.rank, lambda: self.loader, state.device.tensor_to_device)

    def plan(self) -> Optional[StepPlan]:
        """The current step's plan, while a training epoch or an evaluation is running."""
        return self.loader.current_plan() if self.loader is not None else None

    def shadows(self, event: Event) -> bool:
        """Whether the current microbatch is a stand-in; for the algorithm pass, which asks before ``apply()``."""
        if event in (Event.BEFORE_FORWARD, Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD):
            self.microbatches.start(self.state)
        return self.microbatches.shadow

    @property
    def regathers_counts(self) -> bool:
        """Whether every step's ``AFTER_DATALOADER`` re-gathers the counts: some rank's trainer has other algorithms
        (agreed in the fit's first agreement, so the same on every rank, whatever each algorithm matches)."""
        return self.train is not None and self.train.others

    def _facts(self, state: State, **facts: Any) -> Facts:
        """This rank's :class:`~composer_join.core.settings.Facts` at a start event, for its first agreement."""
        others = sum(1 for a in state.algorithms if a is not self.algorithm)
        return Facts(others=others, label=state.dataloader_label or 'train', **facts)

    # -- starts and ends ---------------------------------------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        self._close_iterations(self.train, *self.evals, self.loader)  # of a run that raised: none goes on now
        self.cap = None  # (a run that raised between EPOCH_START and BEFORE_DATALOADER left it lifted)
        resumed, self.resumed = self.resumed, None
        unsaved = resumed is not None and resumed.positions_unsaved and self._mid_epoch(state, resumed)
        if unsaved and resumed.world_size not in (None, dist.get_world_size()):
            raise _unsaved_positions(state)
        rest = self._rest_of_epoch(state, resumed)  # this rank's share of an epoch resumed elastically
        resized = check_world_size(resumed, state, rest is not None, self.layout)  # else raises mid-epoch
        # the checkpoint of an epoch's last batch, on another world size: that epoch ends with no batch
        finished = resized and int(state.timestamp.batch_in_epoch) > 0 and rest is None
        if resized:
            self.wrapper.load_state_dict({})  # DDP: buffers are equal on every rank in a checkpoint
        self.after_epoch = None
        if rest is not None:
            cap = state.dataloader_len  # Composer's, for the user's train dataloader (a subset of it, say)
            self.train = self.loader = self._train_loader(state, rest=rest)
            # the next epoch: the sampler's shards again, as many batches as Composer would take
            self.after_epoch = lambda: self._train_loader(state, cap=cap)
        else:
            report = resumed.current if resumed is not None and (finished or not resized) else None
            self.train = self.loader = self._train_loader(state, finished=finished, report=report)
        self.positions = self.train.positions
        if unsaved and self.positions is not None and self.positions.position.resumes_itself:
            raise _unsaved_positions(state)
        # a position the data keeps itself, on the same world size: each rank its own
        positions, saved = self.positions, resumed.ranks if resumed is not None and not resized else None
        if positions is not None and positions.position.resumes_itself and saved is not None:
            own = positions.load(saved)
            if int(state.timestamp.sample_in_epoch) > 0:
                self.train.resume(own, saved)
        self.wrapper.fit_start(state, self.plan)
        refuse_incompatible(state.algorithms, TEMPLATE_SAMPLES)

    def _train_loader(
        self,
        state: State,
        finished: bool = False,
        report: Optional[EpochReport] = None,
        rest: Optional[Rest] = None,
        cap: Any = None,
    ) -> JoinLoader:
        """The train dataloader, joined: Composer's (``state.dataloader``), the rest of an epoch resumed elastically
        (``rest``), or the user's with Composer's ``dataloader_len`` ``cap`` (the epochs after that rest)."""
        dataloader: Optional[Iterable] = None
        if rest is not None and rest.indices is not None and rest.order is not None:
            dataloader = one_epoch_loader(cast(DataLoader, state.train_dataloader), rest.indices, rest.order)
        elif cap is not None:
            dataloader = state.train_dataloader
        # this rank's position adapter as its data is; the ranks agree on it in the length agreement
        user = state.train_dataloader
        candidate = self._own_position(state, rest)
        kind = kind_of(candidate, user, compat.dataset_of(state, user))
        loader = join_dataloader(
            state,
            self.train,
            self.throw,
            rebalance=self.mode == 'rebalance',
            settings=self.settings_row,
            facts=self._facts(state, position=int(kind), shadow=SHADOW_WAYS.index(self.wrapper.shadow_way_name(state))),
            install=lambda changes: self._install_train(state, changes),
            positions=lambda source, facts: self._rank_positions(state, source, candidate, facts),
            start=lambda: train_position(state, finished),
            # (at a boundary on another world size, the report of a finished epoch of the old ranks is not this one)
            report=report,
            dataloader=dataloader,
            length=None if cap is None else int(cap),
            offset=int(state.timestamp.batch_in_epoch) if rest is not None and rest.indices is not None else 0,
            unsized=rest is not None and rest.indices is None,
            layout=self.layout,
        )
        assert loader is not None  # (only an evaluation's dataloader can be left to Composer)
        return loader

    @staticmethod
    def _mid_epoch(state: State, resumed: Resumed) -> bool:
        """The checkpoint resumed was saved mid-epoch (not after an epoch's last batch)."""
        return int(state.timestamp.batch_in_epoch) > 0 and not resumed.epoch_done

    def _rest_of_epoch(self, state: State, resumed: Optional[Resumed]) -> Optional[Rest]:
        """This rank's share of the samples no rank had used, where a mid-epoch checkpoint of data sharded by a
        global-order sampler (:mod:`composer_join.data.elastic`) resumes on another world size, or continues an
        epoch already resumed so; None otherwise (same world size: Composer replays; else refused or a boundary)."""
        dataloader = state.train_dataloader
        dataset = compat.dataset_of(state, dataloader)
        if resumed is None or resumed.epoch_done or int(state.timestamp.batch_in_epoch) == 0:
            return None
        if self.layout.tp > 1 or resumed.groups is not None:
            return None  # tensor-parallel groups: the same layout only (Composer replays), else refused
        if left_to_composer(dataloader, dataset) and resumed.world_size not in (None, dist.get_world_size()):
            return Rest()  # Composer and the dataset resume its global sample space on any number of ranks
        if position_for(dataloader, dataset) is not None or keeps_state(dataset):
            return None  # the data keeps a position of its own
        order = GlobalOrder.of(dataloader)
        entries = resumed.ranks
        if entries is None and resumed.world_size == 1 and order is not None:  # one rank: UnevenJoin was inactive
            entries = [{'used': int(state.timestamp.sample_in_epoch), 'dataset': {'order': asdict(order)}}]
        if order is None or entries is None:
            return None
        relaid = any(isinstance(e.get('dataset'), dict) and e['dataset'].get('layout') for e in entries)
        if len(entries) == dist.get_world_size() and not relaid:
            return None  # the sampler's own shards: Composer replays the epoch to the step
        world, rank = dist.get_world_size(), dist.get_global_rank()
        indices = remaining_for(entries, order, int(state.timestamp.epoch), world, rank)
        if indices is None:
            return None
        state.dataset_resumption['train'] = True  # no replay: the rest of the epoch is a loader of its own
        cap = state.dataloader_len
        if cap is not None and int(cap) < len(cast(DataLoader, dataloader)):  # train_subset_num_batches
            warnings.warn(
                f'UnevenJoin: train_subset_num_batches={int(cap)}: the rest of epoch {int(state.timestamp.epoch)}, '
                f'resumed on {world} ranks from a checkpoint of {len(entries)}, trains every sample no rank had '
                'used (a subset of the old shards has no meaning on the new world size); the next epochs take '
                'the subset again.',
                stacklevel=2,
            )
        log.info(
            'UnevenJoin: resuming epoch %d of a checkpoint of %d ranks on %d: this rank trains %d samples no rank '
            'had used.',
            int(state.timestamp.epoch),
            len(entries),
            world,
            len(indices),
        )
        return Rest(indices, layout_of(entries), order)

    def _install_train(self, state: State, changes: Changes) -> None:
        """Each iteration over the train dataloader: the wrapper's changes, and optimizers that branch on the loss."""
        self.wrapper.install(changes, state, self.plan)
        agree_on_closures(state.optimizers, lambda: self.microbatches.shadow_step, changes)

    def _own_position(self, state: State, rest: Optional[Rest] = None) -> Optional[Position]:
        """This rank's adapter for train data that keeps its own position, or is sharded by a global-order sampler
        (None: left to Composer, or nothing to keep), as its own data is; ``rest``: the rest of an epoch resumed
        elastically. The ranks then agree on it (:meth:`_rank_positions`)."""
        # Composer reaches the dataset through state.train_dataloader, the user's own DataLoader (left untouched).
        dataloader = state.train_dataloader
        dataset = compat.dataset_of(state, dataloader)
        reused = self.positions.position if self.positions is not None else None
        if rest is not None and rest.order is not None:
            return GlobalOrderPosition(dataloader, dataloader, rest.order, rest.layout)
        if reused is not None and reused.resumes_itself and reused.target in (dataloader, dataset):
            return reused  # a second fit() on the same data: it knows what it loaded into it
        position = position_for(dataloader, dataset)
        if position is None and not keeps_state(dataset) and self.layout.tp == 1:
            order = GlobalOrder.of(dataloader)
            if order is not None:
                position = GlobalOrderPosition(dataloader, dataloader, order)
        return position

    def _rank_positions(
        self, state: State, source: BatchSource, candidate: Optional[Position], facts: list[Facts]
    ) -> Optional[RankPositions]:
        """The per-rank positions the ranks agreed on, from every rank's ``facts`` (None: left to Composer), read
        through ``source``: this rank's ``candidate`` where every rank's kind is the same, else every rank replays."""
        dataloader = state.train_dataloader
        kinds = [f.position for f in facts]
        replay = source.reads_ahead  # the same on every rank (the rebalancer comes from the agreed lengths)
        position = agreed_position(candidate, kinds, dataloader, compat.dataset_of(state, dataloader), replay)
        return None if position is None else RankPositions(state, position)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.wrapper.fit_end(state)
        if self.positions is not None:  # every rank: a checkpoint saved after fit() holds the positions
            self._gather_positions(strict=False)
            self.positions.close()

    def _close_iterations(self, *loaders: Optional[JoinLoader]) -> None:
        """End what a run that raised left suspended in these loaders (:meth:`JoinLoader.close_iteration`)."""
        for loader in loaders:
            if loader is not None:
                loader.close_iteration()

    def _close_evaluations(self) -> None:
        """At an evaluation's or ``predict()``'s start: no other one goes on (the train iteration may: a fit's)."""
        self._close_iterations(*self.evals, self.loader if self.loader is not self.train else None)

    def _gather_positions(self, strict: bool = True) -> None:
        """Every rank's position now, for a checkpoint (:meth:`RankPositions.gather`): call on every rank alike."""
        if self.positions is not None and self.train is not None:
            self.positions.gather(self.train.progress(), strict)

    def eval_start(self, state: State, logger: Logger) -> None:
        self._close_evaluations()
        label = state.dataloader_label
        evaluator = next((e for e in state.evaluators if e.label == label), None)
        # what was learned from this dataloader object before (never from another under the same label)
        earlier = next((loader for loader in self.evals if loader.dataloader is state.dataloader), None)
        loader = join_dataloader(
            state,
            earlier,
            microbatch_size=(lambda: evaluator.device_eval_microbatch_size) if evaluator is not None else None,
            settings=self.settings_row,
            facts=self._facts(state, repeats=pads_by_repeating(state.dataloader)),
            install=lambda changes: self.wrapper.install_eval(changes, state, self.plan),
            layout=self.layout,
        )
        if loader is None:
            # every rank's DistributedSampler evens shards out by repeating samples, and Composer's eval
            # loop removes exactly those repeats: nothing is uneven, leave it to Composer.
            self.loader = None
            return
        self.loader = loader
        # kept while an evaluator reads its dataloader (an eval(eval_dataloader=...)'s goes with it)
        dataloaders = [e.dataloader.dataloader for e in state.evaluators if isinstance(e.dataloader, DataSpec)]
        kept = [loader for loader in self.evals if loader is not earlier and _among(loader.dataloader, dataloaders)]
        self.evals = [*kept, self.loader]
        self.loader.set_epoch(int(state.timestamp.batch))  # what Composer does for an eval sampler
        lift_cap(state, self.loader)  # Composer puts the train cap back after the evaluation
        self.wrapper.eval_start(state, self.plan)

    def predict_start(self, state: State, logger: Logger) -> None:
        """``Trainer.predict()``: every rank predicts its whole shard; ranks that run out shadow (no outputs)."""
        self._close_evaluations()
        self.loader = join_dataloader(
            state,
            microbatch_size=-1,
            settings=self.settings_row,
            facts=self._facts(state, repeats=pads_by_repeating(state.dataloader)),
            install=lambda changes: self.wrapper.install_eval(changes, state, self.plan),
            layout=self.layout,
        )
        if self.loader is None:  # torch's DistributedSampler on every rank: evened out by repeats, Composer's business
            return
        lift_cap(state, self.loader)
        self.wrapper.eval_start(state, self.plan)

    def eval_end(self, state: State, logger: Logger) -> None:
        """``EVAL_END``, ``PREDICT_END``: stop every rank if some rank could not form a batch; the train plan again."""
        if self.loader is not None:
            self.loader.check_ended_together()
        self.loader = self.train

    # -- a training epoch --------------------------------------------------------------------------

    def epoch_start(self, state: State, logger: Logger) -> None:
        self.train.set_epoch(int(state.timestamp.epoch))
        self.cap = lift_cap(state, self.train)

    def before_dataloader(self, state: State, logger: Logger) -> None:
        if self.cap is not None:  # Composer's loop has read it: schedules and durations read it from here on
            state.dataloader_len, self.cap = self.cap, None

    def after_dataloader(self, state: State, logger: Logger) -> None:
        """Only where some rank's trainer has other algorithms (:mod:`composer_join.join.passes`): a shadow step's
        stand-in for those that run here, first and last; every step: the ranks' counts again, which they may have
        changed (on every rank, whatever each algorithm matches)."""
        stands_in = self.others_at_dataloader and self.microbatches.shadow_step
        if stands_in and self.microbatches.stand_in_for_others(state):
            return
        samples, microbatches = self.loader.describe(state.batch)
        self.loader.publish(replan(self.plan(), samples, microbatches, state.device.tensor_to_device, self.rank))

    def epoch_end(self, state: State, logger: Logger) -> None:
        """Stop every rank if some rank could not form a batch; log the epoch's report (rebalance: bytes moved)."""
        self.train.check_ended_together()
        report = self.train.report
        if not self.train.finished_on_resume:  # (an epoch of the old world size: not this source's)
            self.train.source.complete(report)
        self.reports.append(report)
        logger.log_metrics(report.metrics())  # type: ignore[arg-type]  # ints are floats to a logger
        if self.rank == 0:
            log.info('UnevenJoin %s', report.summary())
        if self.after_epoch is not None:  # the rest of an epoch resumed elastically is done: the sampler's shards
            self.train, self.after_epoch = self.after_epoch(), None
            self.loader, self.positions = self.train, self.train.positions

    def checkpoint(self, state: State, logger: Logger, event: Event) -> None:
        """A ``*_CHECKPOINT`` event at which a checkpoint is saved: the wrapper makes its contents equal on every rank,
        and every rank's position is gathered for it (``State.state_dict()`` then only reads them)."""
        if checkpoint_due(state, event):  # the same on every rank: Composer's save is collective too (its RNG states)
            self.wrapper.before_checkpoint(state)
            self._gather_positions()

    # -- a training step ---------------------------------------------------------------------------

    def before_train_batch(self, state: State, logger: Logger) -> None:
        self.wrapper.start_step(self.plan())

    def before_forward(self, state: State, logger: Logger) -> None:
        samples = self.microbatches.start(state)
        shadow = self.microbatches.shadow
        self.microbatches.fed = not self.wrapper.before_forward(state, self.plan(), samples, shadow)
        if self.microbatches.fed:
            self.microbatches.feed(state)

    def after_forward(self, state: State, logger: Logger) -> None:
        self.wrapper.after_forward(state, self.plan())

    def after_loss(self, state: State, logger: Logger) -> None:
        self.wrapper.after_loss(state, self.plan())

    def before_backward(self, state: State, logger: Logger) -> None:
        """Weight the gradient: 0 for a stand-in, ``A_t / W`` if asked (last: after any algorithm rewrote the loss)."""
        plan = self.plan()
        factor = 0.0 if self.microbatches.shadow else plan.grad_factor(self.divide)
        if factor != 1.0:
            state.loss = scale_grad(state.loss, factor)

    def after_backward(self, state: State, logger: Logger) -> None:
        self.wrapper.after_backward(state, self.plan(), self.microbatches.shadow)
        self.microbatches.keep_train_metrics_out(state)

    def after_train_batch(self, state: State, logger: Logger) -> None:
        self.microbatches.metrics_back(state, state.train_metrics)

    # -- an evaluation or predict() batch ----------------------------------------------------------

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        self.microbatches.eval_retry.batch_start(state)

    def eval_before_forward(self, state: State, logger: Logger) -> None:
        self.microbatches.eval_retry.before_forward(state)
        self.predict_before_forward(state, logger)

    def predict_before_forward(self, state: State, logger: Logger) -> None:
        self.microbatches.start(state)
        self.microbatches.feed(state)

    def eval_after_forward(self, state: State, logger: Logger) -> None:
        self.microbatches.keep_eval_metrics_out(state)

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        self.microbatches.metrics_back(state, state.eval_metrics.get(state.dataloader_label))

    def predict_after_forward(self, state: State, logger: Logger) -> None:
        if self.microbatches.shadow:
            empty_outputs(state)

    # -- checkpoints -------------------------------------------------------------------------------

    def saved(self) -> dict[str, Any]:
        """What this run puts in UnevenJoin's checkpoint entry; no collective (the positions were gathered before)."""
        loader, resumed = self.train, self.resumed
        if loader is None:  # no fit yet: what a checkpoint gave, unchanged
            return {
                'current': resumed.current if resumed is not None else None,
                'wrapper': self.wrapper.state_dict(),
                'ranks': resumed.ranks if resumed is not None else None,
                'epoch_done': resumed.epoch_done if resumed is not None else False,
                'groups': self.layout.tp_groups,
                'positions_unsaved': resumed.positions_unsaved if resumed is not None else False,
            }
        ranks, unsaved = self.positions.entries() if self.positions is not None else (None, False)
        return {
            'current': loader.report,
            'wrapper': self.wrapper.state_dict(),
            'ranks': ranks,
            'epoch_done': loader.epoch_done(),
            'groups': self.layout.tp_groups,
            'positions_unsaved': unsaved,
        }


def _among(obj: Any, objects: Iterable[Any]) -> bool:
    """Whether ``obj`` is one of ``objects`` (by identity: a dataloader may compare equal to another)."""
    return any(obj is o for o in objects)


def _unsaved_positions(state: State) -> UnevenInputsError:
    """The error for a mid-epoch resume from a state saved where no rank's position was gathered."""
    return UnevenInputsError(
        f'the checkpoint resumed (batch {int(state.timestamp.batch_in_epoch)} of epoch {int(state.timestamp.epoch)}) '
        "was saved by a state_dict() call outside Composer's checkpoint events (where its CheckpointSaver saves, "
        'save_interval) and the end of fit(): its train data keeps a position of its own on each rank, and this '
        'checkpoint holds none, so the ranks cannot resume this epoch where they were. Resume from a checkpoint '
        "Composer's CheckpointSaver saved (save_folder, save_interval) or one saved after fit(), or at an epoch "
        'boundary.',
    )
