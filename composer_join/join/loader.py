"""The train dataloader Composer iterates while UnevenJoin is active.

:class:`JoinLoader` wraps one rank's own dataloader. Composer's ``_iter_dataloader`` calls ``next``
on it once per step on every rank; inside that call the loader

1. fetches this rank's next batch (or notes that it has run out, or that fetching failed);
2. knows the step's :class:`~composer_join.core.plan.StepPlan`: on the steps before the shortest rank's
   last batch, when every rank's dataloader has a ``len()``, from the lengths alone (every rank
   has a batch; no collective), or, with read-ahead rebalancing, where its buffer levels say so
   (:func:`~composer_join.rebalance.readahead.agreement_needed`); on the other steps by agreeing with all ranks (one small
   collective, which it fetched the batch for and started during the previous ``next``, so that
   it overlaps that step's training);
3. stops the epoch on every rank when no rank has data left, raises :class:`UnevenInputsError`
   on every rank when the plan says so, and otherwise yields the real batch, or, on a rank that
   has run out, a *shadow batch*: the same structure with zero samples. Composer counts a shadow
   batch as zero samples and zero tokens and splits it into one microbatch, so all of Composer's
   per-step collectives still match across ranks.

A rank that cannot form its batch on a step planned from the lengths (its dataloader raised, or
ended before its ``len()``) stops iterating: Composer's own per-step "exhausted" all-reduce ends
the loop on every rank at that step, and :meth:`JoinLoader.check_ended_together` (at the epoch's or
evaluation's end) then raises on every rank, the failing one with the cause, the others naming it
and its cause. With ``mode='rebalance'`` the other ranks have already made the next step's batch
transfers with it (a batch is fetched a step ahead), so the failing rank makes them too, passing
failures on, before it stops: no rank is left waiting in a send or receive.

**A ``len()`` is a hint** (``mode='shadow'``): an ``IterableDataset`` read by several workers
yields more batches than its ``len()`` (each worker ends with its own partial batch; torch only
warns). Such a loader is trained in full, and no step can be planned wrongly:

- a step planned from the lengths alone is one before the shortest rank's last batch by
  ``len()``; a loader that yields more than its ``len()`` has a batch there too, and one that
  yields fewer stops as above (an error on every rank, as documented in docs/limits.md);
- when the shared length is the longest ``len()`` (nothing asked for fewer batches), the last
  step's fetch peeks one batch further and keeps it, and the agreement of that step says whether
  some rank has more (``RankStatus.overflow``). If one has, the epoch goes on past ``len()``, every
  further step agreed, until the agreement says no rank has data: the extra batches train on
  agreed steps, in order, none dropped or repeated. Composer would stop asking after
  ``dataloader_len`` batches, so the algorithm lifts that cap while Composer starts iterating
  (:attr:`JoinLoader.uncapped`) and puts it back before the first batch, so schedules and
  durations still read the longest ``len()``;
- at the end of such an epoch rank 0 warns, once per loader (the train loader's or an evaluator's),
  naming each rank that yielded more than its ``len()``, both counts, and what a schedule computed
  from ``len()`` does.

The steps past the lengths cost one agreement each, like any agreed step; a loader whose
``len()`` is exact costs nothing more (the peek rides on the last step's agreement).

A rank that has never seen a batch (an empty shard) is sent a one-or-two sample template by the
lowest rank with data, once, to learn the batch structure.

What a run learns from a dataloader's batches (that template, the stand-in input made from it, the empty
states of list-state metrics, whether a warning was given) is a :class:`Learned` record kept by the
loader made for that dataloader, and handed to the next loader made for the same dataloader object (a
later fit or evaluation of it); never looked up by label, so a second ``trainer.eval(eval_dataloader=...)``
of other data, also labelled ``'eval'``, learns its own.

Example (what the algorithm does at ``Event.FIT_START`` and ``Event.EVAL_START``)::

    loader = join_dataloader(state)  # wraps state.dataloader and puts the wrapper in its place
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
from composer.core import DataSpec, State
from composer.utils import dist
from torch.utils.data import DataLoader, DistributedSampler

from composer_join.core import compat
from composer_join.core.batches import content_crc, first_samples, to_cpu
from composer_join.core.changes import Changes
from composer_join.core.errors import UnevenInputsError
from composer_join.core.layout import Layout, check_lengths
from composer_join.core.plan import (
    Agreement,
    RankStatus,
    StepPlan,
    agree_on_failures,
    agree_on_length,
    len_or_none,
    plan_from_lengths,
    steps_planned_from_lengths,
)
from composer_join.core.report import EpochReport
from composer_join.core.settings import Facts
from composer_join.core.source import IDLE, BatchSource, Failed, OwnBatches
from composer_join.data.positions import Kind
from composer_join.data.resume import Progress, RankPositions, Start
from composer_join.data.sampler import shard_by_layout
from composer_join.interop.metrics import MetricStates
from composer_join.rebalance.readahead import rebalanced_without_len
from composer_join.rebalance.rebalance import rebalanced
from composer_join.shadow.dataspec import ShadowSplit, count_microbatches, count_samples, spec_for
from composer_join.shadow.structure import describe as describe_structure
from composer_join.shadow.structure import fingerprint

__all__ = [
    'TEMPLATE_SAMPLES',
    'JoinLoader',
    'Learned',
    'Lengths',
    'batch_source',
    'join_dataloader',
    'lift_cap',
    'pads_by_repeating',
]

log = logging.getLogger(__name__)

TEMPLATE_SAMPLES = 2
"""Samples in a shadow forward: two, so that BatchNorm in training mode accepts it."""

Describe = Callable[[Any], tuple[int, int]]


@dataclass(frozen=True)
class Lengths:
    """What the length agreement gave (:func:`~composer_join.core.plan.agree_on_length`), for one iteration kind."""

    shared: Optional[int]
    """Steps per epoch on every rank (the longest rank's), or None if some rank's dataloader has no ``len()``."""
    check_overflow: bool = False
    """``shared`` is the longest ``len()`` (nothing asked for fewer batches): peek past it at the last step; if some
    dataloader yields more, its extra batches train on agreed steps when Composer's cap is lifted
    (:attr:`JoinLoader.uncapped`), else every rank fails (they would be lost)."""
    per_rank: Optional[Sequence[Optional[int]]] = None
    """Every rank's own ``len()`` (None where it has none): the steps before the shortest rank's last batch are
    planned without a collective."""
    offset: int = 0
    """The iteration's first batch is step ``offset`` of its epoch (the rest of an epoch resumed on another world
    size, :mod:`composer_join.data.elastic`); ``shared`` and ``per_rank`` count from the epoch's start."""

    def shifted(self, offset: int) -> Lengths:
        """These lengths, for an iteration whose first batch is step ``offset`` of its epoch."""
        if not offset:
            return self
        per_rank = None if self.per_rank is None else [None if n is None else offset + n for n in self.per_rank]
        shared = None if self.shared is None else offset + self.shared
        return Lengths(shared, self.check_overflow, per_rank, offset)


@dataclass
class Learned:
    """What a run learns from one dataloader's batches; kept by the :class:`JoinLoader` made for that dataloader.

    A later loader made for the same dataloader object (the trainer's next fit, or next evaluation with it) takes
    it over (``earlier``); a loader for another dataloader starts with a new one, so nothing learned from one
    dataloader shapes another's stand-ins, whatever their labels. Dropped with the loaders that hold it.
    """

    template: Any = None
    """First samples of a real batch, on the CPU: this rank's own, or (no data of its own) the ones another rank
    sent. Shadow batches copy its structure; every rank's agreement row carries its fingerprint."""
    stand_in: Any = None
    """The two samples a stand-in forward runs on, on the device: a real microbatch's first samples on this rank, or
    the template moved there (:class:`~composer_join.join.microbatches.Microbatches`)."""
    metric_states: MetricStates = field(default_factory=MetricStates)
    """The empty states of this dataloader's list-state metrics (:mod:`composer_join.interop.metrics`)."""
    warned: bool = False
    """The warning about a ``len()`` that undercounts was given (once per dataloader)."""


@dataclass
class _Fetched:
    """The next step's batch as fetched a step ahead, and its agreement, under way or not needed."""

    batch: Any
    status: RankStatus
    error: Optional[BaseException]
    agreement: Optional[Agreement]
    local: bool  # planned without an agreement


@dataclass
class _Iteration:
    """What one iteration (an epoch, an evaluation) keeps; a new one at every start."""

    steps: int = 0  # steps yielded so far
    first: int = 0  # the step it started at (nonzero: an epoch resumed mid-way, not spun)
    trained: int = 0  # own real samples yielded (-1: uncountable)
    ended: bool = False  # ended by agreement (no rank has data left), or at once (finished on resume)
    finished_on_resume: bool = False  # its epoch was trained before a checkpoint: it read nothing
    failure: Optional[tuple[int, Optional[BaseException]]] = None  # step and cause, on a step planned from lengths
    unreported: int = 0  # own samples on steps planned from lengths, not yet sent in an agreement
    exhausted: bool = False  # this rank's dataloader has run out (torch may hand back the same iterator)
    peeked: list[Any] = field(default_factory=list)  # a batch fetched to see whether there is more than len()
    beyond: bool = False  # it goes on past the shared length: some rank yields more than its len()
    pending: Optional[_Fetched] = None  # the next step's fetch


class JoinLoader:
    """One rank's dataloader, made to end every epoch on all ranks at the same step.

    Args:
        source: where this rank's batches come from (:class:`~composer_join.core.source.BatchSource`: its own
            dataloader, or a rebalancer over it), chosen by :func:`batch_source`.
        describe: ``batch -> (samples, microbatches)`` as Composer will count and split it;
            ``-1`` samples or ``0`` microbatches where that cannot be known.
        lengths: what the length agreement gave (:class:`Lengths`).
        throw_on_early_termination: raise :class:`UnevenInputsError` on every rank at the first
            step where some rank has no batch, instead of shadowing.
        to_device: moves the agreement tensor to the trainer's device (``state.device.tensor_to_device``).
        microbatch_size: ``() ->`` the microbatch size in force (automatic microbatching halves it after an OOM).
        opened: ``() ->`` the register of changes for one iteration (:mod:`composer_join.core.changes`), made
            when the iteration opens and undone when it ends, also when the run raises.
        label: the dataloader's label (``'train'``, an evaluator's), for messages.
        positions: train data that keeps its own position (:class:`~composer_join.data.resume.RankPositions`):
            the user's dataloader is opened through it.
        start: train only: ``() ->`` where the next iteration starts in its epoch
            (:func:`composer_join.data.resume.train_position`), read when it starts, so that a mid-epoch resume
            reshuffles and counts right.
        earlier: an earlier loader (the trainer's previous fit, or previous evaluation under this label): if it is over
            the same dataloader object, what was learned from its batches (:class:`Learned`) is kept.
        report: the current epoch's report, if it goes on (a checkpoint's, resumed).
        layout: the data-parallel members (:class:`~composer_join.core.layout.Layout`; default: every rank its own).
            Under tensor parallelism every step is agreed, the ranks of a member must hold the same batch
            (:meth:`~composer_join.core.layout.Layout.check_rows`), and the report counts members.
        others: some rank's trainer has algorithms besides UnevenJoin (the first agreement): every step's
            ``AFTER_DATALOADER`` re-gathers the counts (:mod:`composer_join.interop.replan`).
        unregistered: train only: every rank's data has a position UnevenJoin does not know, left to Composer (its
            rank-0 ``dataset_state``, loaded into every rank's dataset): an epoch resumed from it that runs short says so.
    """

    def __init__(
        self,
        source: BatchSource,
        describe: Describe,
        lengths: Lengths,
        throw_on_early_termination: bool = False,
        to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        microbatch_size: Callable[[], Any] = lambda: None,
        opened: Callable[[], Changes] = Changes,
        label: str = 'train',
        positions: Optional[RankPositions] = None,
        start: Optional[Callable[[], Start]] = None,
        earlier: Optional[JoinLoader] = None,
        report: Optional[EpochReport] = None,
        layout: Optional[Layout] = None,
        others: bool = False,
        unregistered: bool = False,
    ):
        self.layout = layout if layout is not None else Layout.flat(dist.get_world_size())
        self.others, self.unregistered = others, unregistered
        self.source, self.dataloader = source, source.dataloader
        self.describe, self.lengths = describe, lengths
        self.throw_on_early_termination = throw_on_early_termination
        self.to_device, self.microbatch_size = to_device, microbatch_size
        self.opened, self.label, self.positions, self.start = opened, label, positions, start
        self.learned: Learned = (
            earlier.learned
            if earlier is not None and earlier.dataloader is self.dataloader
            else Learned(metric_states=MetricStates(to_device))
        )
        self.report = report or self._new_report(0)
        self.epoch = self.report.epoch
        self.plan: Optional[StepPlan] = None  # the current step's plan, while iterating (see current_plan)
        # the current step's register of changes: made when a step's batch is yielded, undone when Composer asks for
        # the next one, when the iteration ends, or when the run raises; None between steps
        self.step_changes: Optional[Changes] = None
        # the last iteration started (see close_iteration); held weakly: Python closes it once Composer drops it
        self._iteration: Optional[weakref.ref[Iterator[Any]]] = None
        self._sizes: tuple[Any, Any] = (None, None)  # microbatch size when the pending batch / the plan was counted
        self._recounted: Optional[tuple[StepPlan, Any, StepPlan]] = None
        self.uncapped = False  # Composer iterates without its dataloader_len cap this time (see lift_cap)
        self._resumed: tuple[int, bool] = (0, False)  # own samples trained, own data ended, before a mid-epoch resume
        self._now = _Iteration()
        self._rank, self._world = dist.get_global_rank(), dist.get_world_size()

    def _new_report(self, epoch: int) -> EpochReport:
        return EpochReport(epoch=epoch, world_size=self.layout.members, tensor_parallel=self.layout.tp)

    # -- what the algorithm asks -------------------------------------------------------------------

    @property
    def length(self) -> Optional[int]:
        return self.lengths.shared

    @property
    def check_overflow(self) -> bool:
        return self.lengths.check_overflow

    @property
    def steps(self) -> int:
        """Steps yielded in the current epoch so far."""
        return self._now.steps

    @property
    def finished_on_resume(self) -> bool:
        """The current iteration ended at once: its epoch was trained before the checkpoint it resumed."""
        return self._now.finished_on_resume

    def current_plan(self) -> Optional[StepPlan]:
        """The current step's plan, its microbatch counts for the microbatch size in force now.

        The counts were taken when the batch was fetched, a step ahead; if Composer has changed the
        microbatch size since (automatic microbatching, after a CUDA OOM, on every rank alike), they
        are recomputed from the agreed samples (:meth:`~composer_join.core.plan.StepPlan.recounted`).
        """
        plan, size = self.plan, self.microbatch_size()
        if plan is None or size == self._sizes[1]:
            return plan
        if self._recounted is None or self._recounted[0] is not plan or self._recounted[1] != size:
            self._recounted = (plan, size, plan.recounted(size))
        return self._recounted[2]

    @property
    def own_length(self) -> Optional[int]:
        """This rank's ``len()``, if it has one: running out before it is an error."""
        per_rank = self.lengths.per_rank
        return per_rank[self._rank] if per_rank else None

    def progress(self) -> Progress:
        """Where this rank stands in the current epoch (samples trained and used, bytes sent, own data ended)."""
        now = self._now
        ended = now.exhausted and not now.peeked and (now.pending is None or not now.pending.status.has_batch)
        return Progress(
            trained=now.trained,
            used=self.source.used(now.steps - self.lengths.offset, now.trained),
            sent=self.source.sent(now.steps - self.lengths.offset),
            ended=self.source.ends_with_own_data and ended,
        )

    def resume(self, own: dict[str, Any], saved: list[dict[str, Any]]) -> None:
        """Before a mid-epoch resumed iteration: this rank's checkpoint entry (``own``) and every rank's (``saved``).

        The epoch's partial report gets every rank's exact count (on steps planned from the lengths, the report
        alone had not received them yet).
        """
        self._resumed = (int(own['trained']), bool(own.get('ended', False)))
        self.source.resume(int(own['used']), int(own.get('sent', 0)))
        self.report.real_samples = self.layout.leaders([int(entry['trained']) for entry in saved])

    @property
    def planned_steps(self) -> int:
        """Leading steps of every epoch planned from the lengths alone, with no collective (none under TP)."""
        if self.layout.tp > 1:  # every step agreed: the ranks of a tensor-parallel group must hold one batch
            return 0
        return steps_planned_from_lengths(self.lengths.per_rank, self.length)

    def __getattr__(self, name: str) -> Any:
        """Other attributes are the wrapped dataloader's (``batch_size``, ``dataset``: SeqLengthWarmup reads them)."""
        dataloader = self.__dict__.get('dataloader')
        if dataloader is None or name.startswith('__'):
            raise AttributeError(name)
        return getattr(dataloader, name)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("some rank's train dataloader has no len(), so the epoch length is unknown")
        return self.length

    def samples(self, batch: Any) -> int:
        """Samples in ``batch`` (a microbatch, say), as Composer counts them; -1 if they cannot be counted."""
        return self.describe(batch)[0]

    def set_epoch(self, epoch: int) -> None:
        """Called at every epoch start: reshuffles a ``DistributedSampler`` as Composer would."""
        self.epoch = epoch
        sampler = _distributed_sampler(self.dataloader)
        if sampler is not None:
            sampler.set_epoch(epoch)

    # -- one iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """One epoch (or evaluation) on this rank; UnevenJoin's changes to others' objects last exactly as long.

        ``opened()`` makes them (the ``DataSpec``'s split, the wrapper's hooks and padding) and returns their
        register, undone when the iteration ends: Composer stops asking, or an exception unwinds Composer's loop
        (Python then closes the suspended iterator), or at the latest when :meth:`close_iteration` is called. Each step's
        own changes (:attr:`step_changes`) are undone first. An earlier iteration of this loader still suspended
        is closed before a new one starts.
        """
        self.close_iteration()
        iteration = self._iterating()
        self._iteration = weakref.ref(iteration)
        return iteration

    def _iterating(self) -> Iterator[Any]:
        changes = self.opened()
        try:
            yield from self._iterate()
        finally:
            changes.undo()

    def close_iteration(self) -> None:
        """End an iteration Composer left suspended, undoing its changes; a no-op if none is (idempotent).

        Python closes the iterator of a run that raised as the exception unwinds Composer's loop, unless something
        keeps it: a raise inside Composer's own iterator over the dataloader (at ``BEFORE_DATALOADER``) leaves it
        in the traceback's frames, which a notebook keeps (``sys.last_traceback``). The trainer's next fit,
        evaluation or ``predict()`` calls this at its start (:class:`~composer_join.join.session.Run`), so nothing
        of the raised run reaches it, and the iterator's late closing undoes nothing twice.
        """
        iteration = self._iteration() if self._iteration is not None else None
        self._iteration = None
        if iteration is not None:
            iteration.close()  # type: ignore[attr-defined]  # a generator

    def _open(self, resumed: bool) -> Iterator[Any]:
        """The user's dataloader for this epoch (through its position adapter, if its data keeps a position)."""
        if self.positions is None:
            return iter(self.dataloader)
        return self.positions.open(self.dataloader, resumed, self.samples, self._used)

    def _used(self) -> int:
        return self.source.used(self._now.steps - self.lengths.offset, self._now.trained)

    def _iterate(self) -> Iterator[Any]:
        first, skipped, finished = 0, 0, False
        if self.start is not None:
            epoch, first, skipped, finished = self.start()
            self.set_epoch(epoch)
        trained_before, ended_before = self._resumed if first else (0, False)
        if first + skipped == 0 or self.report.epoch != self.epoch:  # else: resuming the report's epoch
            self.report = self._new_report(self.epoch)
        if finished:  # every batch of the epoch was trained before the checkpoint: end it, reading nothing
            self._now = _Iteration(steps=first, ended=True, finished_on_resume=True)
            return
        batches = self.source.epoch(first - self.lengths.offset, self._open)
        # a position loaded where this rank's data had ended may start the library's next epoch: read nothing
        exhausted = ended_before and self.source.ends_with_own_data
        now = self._now = _Iteration(steps=first, first=first, trained=trained_before, exhausted=exhausted)
        may_go_beyond, self.uncapped = self.uncapped, False
        planned = self.planned_steps
        step = first
        now.pending = self._fetch_and_agree(batches, step, planned)
        try:
            while now.pending is not None:
                fetched = now.pending
                if fetched.local:
                    if not fetched.status.has_batch:  # only this rank knows: stop, and Composer stops every rank
                        now.failure = (step, fetched.error)  # error None: it ended before its len()
                        self.source.make_transfers(batches, step + 1 - self.lengths.offset)
                        return
                    plan = plan_from_lengths(step, self._rank, fetched.status, self._world)
                else:
                    plan = (
                        fetched.agreement or Agreement(step, fetched.status, self.to_device, self._where(step))
                    ).plan()
                self.source.observe(plan)  # read-ahead rebalancing: buffer levels (or bounds) for the next step
                if not fetched.local:
                    now.unreported = 0  # in the plan now, so in the report (or, spun past, already in it)
                    self._raise_if_needed(plan, fetched.error, fetched.batch)
                    if not plan.active_ranks:
                        now.ended = True
                        self._warn_if_beyond()
                        return
                    now.beyond = now.beyond or self._goes_beyond(plan, may_go_beyond)
                    if plan.template_source is not None:
                        self._share_template(plan.template_source)
                self.plan, self._sizes = plan, (self._sizes[0], self._sizes[0])
                if step >= first + skipped:  # not a batch Composer spins past on resumption
                    self.report.record(self.layout.member_plan(plan))
                # Fetch the next batch (and start its agreement) now: it completes while this step trains.
                # With a known length no batch past it is fetched, unless some rank yields more (now.beyond).
                last = self.length is not None and step + 1 >= self.length and not now.beyond
                now.pending = None if last else self._fetch_and_agree(batches, step + 1, planned)
                now.steps = step + 1
                status = fetched.status
                if status.has_batch:
                    now.trained = -1 if min(now.trained, status.samples) < 0 else now.trained + status.samples
                step_changes = self.step_changes = Changes()
                try:
                    yield fetched.batch if status.has_batch else first_samples(self.learned.template, 0)
                finally:  # Composer asks for the next batch, or the iteration ends (also when the run raises)
                    self.step_changes = None
                    step_changes.undo()
                step += 1
        finally:
            self.plan, now.pending = None, None

    def epoch_done(self) -> bool:
        """Whether the step just yielded is its epoch's last (then a checkpoint taken after it is an epoch boundary).

        Known from the lengths, or from the next step's agreement, already under way on every rank (waited for
        here, no new collective); False outside an iteration, or where the next step is planned without one.
        """
        if self.plan is None:
            return False
        pending = self._now.pending
        if pending is None:
            return True
        return not pending.local and pending.agreement is not None and not pending.agreement.plan().active_ranks

    def _fetch_and_agree(self, batches: Iterator[Any], step: int, planned: int) -> _Fetched:
        """Fetch step ``step``'s batch; start its agreement if it is agreed and not the first agreed step.

        A step is planned locally (no agreement) if it is one of the ``planned`` leading steps, or if the
        source says so (read-ahead rebalancing: every rank has a batch at it and the next,
        :func:`~composer_join.rebalance.readahead.agreement_needed`). The first agreed step's agreement starts
        only when that step is asked for: a rank that cannot form its batch on the last planned step
        stops without it, so the others must not start it early.
        """
        now = self._now
        self._sizes = (self.microbatch_size(), self._sizes[1])
        batch, status, error = self._fetch(batches, step)
        if step < planned or (self.layout.tp == 1 and self.source.planned_locally()):
            if status.has_batch:  # sent with the next agreement (-1 once some batch could not be counted)
                uncountable = min(now.unreported, status.samples) < 0
                now.unreported = -1 if uncountable else now.unreported + status.samples
            return _Fetched(batch, status, error, None, True)
        status = dataclasses.replace(status, unreported_samples=now.unreported, **self.source.status_columns())
        agreement = Agreement(step, status, self.to_device, self._where(step)) if step > planned else None
        return _Fetched(batch, status, error, agreement, False)

    def _where(self, step: int) -> str:
        """Step ``step`` of this iteration, in words (for what a rank says when a peer is gone)."""
        return f'batch {step} of epoch {self.epoch}' if self.label == 'train' else f'batch {step} of {self.label!r}'

    def check_ended_together(self) -> None:
        """Raise on every rank if this epoch (or evaluation) ended early because some rank could not form a batch.

        Call on every rank once Composer's loop over this loader has ended (``EPOCH_END``,
        ``EVAL_END``). On a step planned from the lengths, a rank whose dataloader raises (or ends
        before its ``len()``) stops iterating, and Composer's own per-step "exhausted" all-reduce
        ends the loop on every rank at that step. Every rank then sees fewer steps than planned
        and, only then, agrees on who failed (one collective) and raises: the failing rank its own
        error, the others :class:`UnevenInputsError` naming it. Otherwise a no-op, no collective.
        """
        now = self._now
        if self.length is None or now.ended or now.steps >= self.length:
            return
        step, error = now.failure if now.failure is not None else (None, None)
        failed = agree_on_failures(step, now.failure is not None and error is None, self.to_device)
        causes: list[Optional[str]] = []
        if any(f is not None and not f[1] for f in failed):  # on every rank alike: only on this error path
            causes = dist.all_gather_object(None if error is None else f'{type(error).__name__}: {error}')
        if error is not None:
            raise error
        short = [r for r, f in enumerate(failed) if f is not None and f[1]]
        if short:
            raise self._short_error(short, min(f[0] for f in failed if f is not None and f[1]))
        ranks = [r for r, f in enumerate(failed) if f is not None]
        steps = sorted({f[0] for f in failed if f is not None})
        raise UnevenInputsError(
            f'rank(s) {ranks} could not form batch {", ".join(map(str, steps))} of epoch {self.epoch} (their '
            f'dataloader raised); every rank stops here, the failing rank raises the cause: '
            + '; '.join(f'rank {r}: {cause}' for r, cause in enumerate(causes) if cause is not None),
        )

    def _goes_beyond(self, plan: StepPlan, allowed: bool) -> bool:
        """Whether the epoch goes on past ``length``: some rank yields more than the longest ``len()``.

        ``allowed``: Composer's cap is lifted for this iteration (:attr:`uncapped`). If it is not (an
        epoch resumed mid-way from a checkpoint), the extra batches would be lost: raise on every rank.
        """
        overflow = [r for r, s in enumerate(plan.statuses) if s.overflow]
        if overflow and not allowed:
            raise UnevenInputsError(
                f'the dataloader of rank(s) {overflow} yielded more than the {self.length} batches per epoch '
                f'that the longest len() promised, in an epoch resumed mid-way from a checkpoint, which Composer '
                f"stops at len(); the extra batches would be silently dropped. Make __len__ of each rank's dataset "
                f'match what it yields, or remove __len__ so the epoch ends when data does.',
            )
        return bool(overflow)

    def _warn_if_beyond(self) -> None:
        """Once per loader, on rank 0, at the end of an epoch that went on past ``length``: say so, and what it does."""
        per_rank = self.lengths.per_rank
        if not self._now.beyond or self.learned.warned or self._rank != 0 or per_rank is None:
            return
        self.learned.warned = True
        counts = self.report.real_batches
        per_member = self.layout.leaders(per_rank)
        over = [(m, n, own) for m, (n, own) in enumerate(zip(counts, per_member)) if own is not None and n > own]
        ranks = '; '.join(f'{self.layout.name(m)} yielded {n} batches, its len() is {own}' for m, n, own in over)
        steps = self._now.steps
        warnings.warn(
            f'UnevenJoin: the {self.label} dataloader yields more batches than its len() says in epoch {self.epoch} '
            f'({ranks}): an IterableDataset read by several DataLoader workers ends each worker with its own '
            f'partial batch. UnevenJoin treats len() as a hint: the epoch ran {steps} steps, every extra batch '
            f'trained once, on steps agreed by all ranks. Composer still counts {self.length} batches per epoch (the '
            f'longest len()), so a schedule computed from len() (a max_duration, or an LR schedule, in epochs) '
            f'runs {steps - cast(int, self.length)} steps per epoch ahead of training and ends early. Give the '
            f"dataset a __len__ that counts each worker's batches, or state durations in batches or samples.",
            stacklevel=2,
        )

    def _short_error(self, ranks: list[int], step: int) -> UnevenInputsError:
        """The error for dataloaders that ended after ``step`` batches, before their ``len()``; in an epoch resumed
        from a position left to Composer, the likelier cause."""
        short = (
            f'the dataloader of rank(s) {ranks} ran out after {step} batches in epoch {self.epoch}, fewer '
            f'than its len() promised (this rank: len() {self.own_length})'
        )
        if self.unregistered and self._now.first > 0:
            dataset = type(getattr(self.dataloader, 'dataset', None)).__name__
            return UnevenInputsError(
                f'{short}, in an epoch resumed from batch {self._now.first}. The position of the train data '
                f'({dataset}) was left to Composer: UnevenJoin does not know its state_dict, so Composer saved rank '
                f"0's dataset state (state_dict(num_samples, from_beginning) with the global sample count) and loaded "
                f"it into every rank's dataset, which puts each rank's own shard at the wrong place. If each rank's "
                f'dataset holds a shard of its own, register it: composer_join.register_position({dataset}, '
                f"composer_join.SampleCountPosition) for Composer's protocol (each rank is given its own count), or "
                f'a composer_join.Position subclass of your own (docs/data-pipelines.md).',
            )
        return UnevenInputsError(
            f'{short}; the epoch length, and so schedules and durations, would silently be wrong. Make __len__ of '
            f"each rank's dataset match what it yields, or remove __len__.",
        )

    def _fetch(self, batches: Iterator[Any], step: int) -> tuple[Any, RankStatus, Optional[BaseException]]:
        """This rank's next batch (None once exhausted, or on an idle step), its status for the agreement, any error."""
        now = self._now
        if not now.exhausted:
            try:
                batch = now.peeked.pop() if now.peeked else next(batches)
                if isinstance(batch, Failed):  # a rebalancer's step failed (its transfers were made)
                    raise batch.error
            except StopIteration:
                now.exhausted = True
                if self.own_length is not None and step < self.own_length:  # batch i is trained at step i
                    return None, RankStatus(has_batch=False, short=True), None
            except Exception as e:  # reported to every rank by the agreement, then re-raised here
                return None, RankStatus(has_batch=False, failed=True), e
            else:
                if batch is not IDLE:  # IDLE: read-ahead rebalancing has no batch here, the epoch goes on
                    return batch, self._status(batches, batch, step), None
        return (
            None,
            RankStatus(
                has_batch=False,
                samples=0,
                microbatches=1,
                needs_template=self.learned.template is None,
                structure=0 if self.learned.template is None else fingerprint(self.learned.template),
            ),
            None,
        )

    def _status(self, batches: Iterator[Any], batch: Any, step: int) -> RankStatus:
        """A real batch's row: its counts, its structure, and (at the last step by length) whether more follows."""
        if self.learned.template is None:
            self.learned.template = to_cpu(first_samples(batch, TEMPLATE_SAMPLES))
        samples, microbatches = self.describe(batch)
        overflow = self.check_overflow and self.length is not None and step == self.length - 1 and self._peek(batches)
        content = content_crc(batch) if self.layout.tp > 1 else 0
        return RankStatus(True, samples, microbatches, overflow=overflow, structure=fingerprint(batch), content=content)

    def _peek(self, batches: Iterator[Any]) -> bool:
        """Whether ``batches`` yields another batch; it is kept for the next fetch (none is lost)."""
        try:
            self._now.peeked.append(next(batches))
        except StopIteration:
            self._now.exhausted = True
            return False
        except Exception as e:  # raised by the next fetch, on a step every rank agrees on
            self._now.peeked.append(Failed(e))
        return True

    def _raise_if_needed(self, plan: StepPlan, error: Optional[BaseException], batch: Any = None) -> None:
        failed = [r for r, s in enumerate(plan.statuses) if s.failed]
        if failed:
            msg = (
                f'rank(s) {failed} could not form batch {plan.step} of epoch {self.epoch} (their dataloader raised, '
                f'or their data cannot be shadowed); every rank stops here, the failing rank raises the cause'
            )
            if error is not None:
                raise error
            raise UnevenInputsError(msg)
        short = [r for r, s in enumerate(plan.statuses) if s.short]
        if short:
            raise self._short_error(short, plan.step)
        self.layout.check_rows(plan.statuses, plan.step, self.epoch, self.label)
        if plan.structures_differ:
            mine = describe_structure(batch if batch is not None else self.learned.template)
            structures = dist.all_gather_object(mine)  # only on this error path, on every rank
            per_rank = '; '.join(f'rank {r}: {d}' for r, d in enumerate(structures))
            raise UnevenInputsError(
                f'at step {plan.step} of epoch {self.epoch} rank(s) {plan.joined_ranks} shadow with a batch shaped '
                f"after another step's or another rank's, but the batches differ in structure ({per_rank}). A shadow "
                f"batch copies container types, keys, tensor dtypes and dimensions; make every rank's dataloader "
                f'yield one structure at every step.',
            )
        if self.throw_on_early_termination and plan.active_ranks and plan.joined_ranks:
            counts = ', '.join(f'{self.layout.name(m)}: {n}' for m, n in enumerate(self.report.real_batches))
            raise UnevenInputsError(
                f'rank(s) {plan.joined_ranks} ran out of data at step {plan.step} of epoch {self.epoch} '
                f'while rank(s) {plan.active_ranks} still have batches (batches so far: {counts}). '
                f'UnevenJoin(throw_on_early_termination=True) stops here; set it to False to let exhausted '
                f'ranks join and shadow the others until all are done.',
            )

    def _share_template(self, source: int) -> None:
        box = [self.learned.template if dist.get_global_rank() == source else None]
        dist.broadcast_object_list(box, src=source)
        if self.learned.template is None:
            self.learned.template = box[0]
            log.info(
                'rank %d has no data of its own; shaped its shadow batches after rank %d',
                dist.get_global_rank(),
                source,
            )


def join_dataloader(
    state: State,
    cached: Optional[JoinLoader] = None,
    throw: bool = False,
    microbatch_size: Any = None,
    rebalance: bool = False,
    settings: Sequence[int] = (),
    facts: Optional[Facts] = None,
    install: Callable[[Changes], None] = lambda changes: None,
    positions: Callable[[BatchSource, list[Facts]], Optional[RankPositions]] = lambda source, facts: None,
    start: Optional[Callable[[], Start]] = None,
    report: Optional[EpochReport] = None,
    dataloader: Optional[Iterable] = None,
    length: Optional[int] = None,
    offset: int = 0,
    unsized: bool = False,
    layout: Optional[Layout] = None,
) -> Optional[JoinLoader]:
    """Wrap ``state.dataloader`` in a :class:`JoinLoader` and set it, with the shared length, in its place.

    Called on every rank at the same point (fit, evaluation or ``predict()`` start): one collective to agree on
    the longest rank's length, which also carries every rank's ``settings`` and ``facts``
    (:class:`~composer_join.core.settings.Facts`); None (nothing wrapped) where every rank's dataloader repeats
    samples to even out the shards (``facts.repeats``: Composer's evaluation drops the repeats). ``cached``, a loader made earlier (for the same dataloader: what was learned from
    it is kept, :class:`Learned`), is :class:`JoinLoader`'s ``earlier``. ``throw`` is ``throw_on_early_termination``. Microbatch counts are predicted with
    ``microbatch_size`` (an evaluator's, or a callable giving the size in force), by default the train
    microbatch size in force. ``rebalance``: ``mode='rebalance'`` (:func:`batch_source` picks the source).
    ``settings``: UnevenJoin's (:func:`composer_join.core.settings.row`), checked to be the same on every
    rank in the same collective. ``install(changes)``: the algorithm's changes for each iteration, made
    through ``changes`` (:attr:`JoinLoader.opened`). ``positions(source, facts)``: the per-rank positions of train
    data that keeps one, for the chosen source, from every rank's facts. ``start`` and ``report``: :class:`JoinLoader`'s. ``dataloader``:
    this one instead of ``state.dataloader``, with Composer's cap ``length`` (default: its whole length), whose
    first batch is step ``offset`` of the epoch (the rest of an epoch resumed on another world size). ``unsized``: its length is not
    known (the rest of an epoch a dataset resumed itself on another world size): every step agreed. ``layout``: the
    data-parallel members (:func:`~composer_join.core.layout.trainer_layout`; default every rank its own): under tensor
    parallelism the ranks of a member must have the same length, and an :class:`~composer_join.ExactDistributedSampler`
    left to its defaults shards over members (:func:`~composer_join.data.sampler.shard_by_layout`, for the length
    agreement and each iteration; Composer's cap, read under the world's sharding, follows).
    """
    layout = layout if layout is not None else Layout.flat(dist.get_world_size())
    rank = dist.get_global_rank()
    current = None if state.dataloader_len is None else int(state.dataloader_len)
    if dataloader is not None:
        current = len_or_none(dataloader) if length is None else length
    else:
        dataloader = state.dataloader
    if isinstance(dataloader, JoinLoader):  # a second fit() on the same trainer
        own = dataloader.source.own_length  # with mode='rebalance': the batches its shard contributed
        current = own if own is not None else current
        dataloader = dataloader.dataloader
    with Changes() as changes:
        before = len_or_none(dataloader)
        shard_by_layout(dataloader, layout, rank, changes)
        own_len = None if unsized else len_or_none(dataloader)
    if current is not None and current == before:  # Composer's cap is the whole epoch: the resharded one
        current = own_len
    current = None if unsized else current
    if rebalance and own_len is not None and current is not None:
        own_len = min(own_len, current)  # the batches of its shard this rank contributes per epoch
    shared, check_overflow, own_lens, every = agree_on_length(
        own_len, current, state.device.tensor_to_device, settings, facts
    )
    if every and all(f.repeats for f in every):
        return None
    label = state.dataloader_label
    check_lengths(layout, own_lens, label)
    if microbatch_size is None:
        size = lambda: state.device_train_microbatch_size  # noqa: E731 (read when used: auto microbatching)
    else:
        size = microbatch_size if callable(microbatch_size) else lambda: microbatch_size
    # Composer's DataSpec, so counts are its counts; wrapped for every iteration (undone as it ends)
    spec = spec_for(state, dataloader)

    def describe(batch: Any) -> tuple[int, int]:
        return _describe(spec, batch, size())

    source, lengths = batch_source(
        dataloader,
        Lengths(shared, check_overflow, own_lens),
        rebalance,
        state.device.tensor_to_device,
        lambda batch: describe(batch)[0],
        layout,
    )
    lengths = lengths.shifted(offset)

    def opening(changes: Changes) -> None:
        shard_by_layout(dataloader, layout, rank, changes)
        install(changes)

    loader = JoinLoader(
        source,
        describe=describe,
        lengths=lengths,
        throw_on_early_termination=throw,
        to_device=state.device.tensor_to_device,
        microbatch_size=size,
        opened=lambda: _opened(spec, opening),
        label=label,
        positions=positions(source, every),
        start=start,
        earlier=cached,
        report=report,
        layout=layout,
        others=any(f.others for f in every),
        unregistered=bool(every) and all(f.position == Kind.UNREGISTERED for f in every),
    )
    state.set_dataloader(loader, label, -1 if lengths.shared is None else lengths.shared)
    log.info(
        'UnevenJoin: %s batches per rank %s; every rank runs %s steps.',
        label,
        own_lens,
        lengths.shared if lengths.shared is not None else 'until the last rank runs out',
    )
    return loader


def batch_source(
    dataloader: Iterable,
    lengths: Lengths,
    rebalance: bool,
    to_device: Callable[[torch.Tensor], torch.Tensor],
    count: Callable[[Any], int],
    layout: Optional[Layout] = None,
) -> tuple[BatchSource, Lengths]:
    """Where this rank's batches come from (the one place the kind is chosen), and the lengths the loader plans with.

    Not rebalancing: :class:`~composer_join.core.source.OwnBatches`. Rebalancing with every rank's ``len()``:
    :class:`~composer_join.rebalance.rebalance.RebalancingLoader`, whose lengths are each rank's assigned
    batches, own and received; with some rank's unknown: :class:`~composer_join.rebalance.readahead.ReadAheadRebalancer`,
    step by step (no length known ahead). A rebalancer plans over ``layout``'s data-parallel members.
    """
    per_rank = list(lengths.per_rank or [])
    source: BatchSource
    if not rebalance:
        return OwnBatches(dataloader), lengths
    if None in per_rank:
        source, shared, overflow, assigned = rebalanced_without_len(dataloader, per_rank, to_device, layout)
    else:
        source, shared, overflow, assigned = rebalanced(
            dataloader, cast(list[int], per_rank), lengths.shared, lengths.check_overflow, to_device, count, layout
        )
    return source, Lengths(shared, overflow, assigned)


def _opened(spec: DataSpec, install: Callable[[Changes], None]) -> Changes:
    """The changes of one iteration: the ``DataSpec``'s split of shadow batches, then ``install``'s (the algorithm's)."""
    changes = Changes()
    try:
        ShadowSplit.install(spec, changes)
        install(changes)
    except BaseException:
        changes.undo()
        raise
    return changes


def lift_cap(state: State, loader: JoinLoader) -> Optional[Any]:
    """Let Composer's next loop over ``loader`` run past ``state.dataloader_len``; return the cap to put back.

    Composer's ``_iter_dataloader`` stops after ``state.dataloader_len`` batches, read once, when the
    loop starts. Where that is the longest ``len()`` (``loader.check_overflow``), a rank that yields
    more would lose its extra batches: call this on every rank right before Composer starts the loop
    (``EPOCH_START``, ``EVAL_START``, ``PREDICT_START``), then put the returned cap back in
    ``state.dataloader_len`` once the loop has started (``BEFORE_DATALOADER``) for schedules and
    durations; an evaluation's or prediction's is put back by Composer after its loop. The loader
    then ends the loop itself, on every rank at the same step. Returns None (and changes nothing) if
    ``dataloader_len`` is not the longest ``len()``, say a subset of the batches was asked for.
    """
    cap = state.dataloader_len
    if not loader.check_overflow or cap is None or loader.length is None or int(cap) != loader.length:
        return None
    loader.uncapped = True
    compat.dataloader_cap_off(state)  # Composer's setter would read len(loader) back: no public way to say "no cap"
    return cap


def _describe(spec: DataSpec, batch: Any, microbatch_size: Any) -> tuple[int, int]:
    """(samples, microbatches) as Composer will count and split ``batch`` with ``spec`` (its own ``DataSpec``)."""
    samples = count_samples(spec, batch)
    if samples < 0:
        return -1, 0
    return samples, count_microbatches(spec, batch, microbatch_size, samples)


def _distributed_sampler(dataloader: Any) -> Optional[DistributedSampler]:
    """The ``DistributedSampler`` Composer itself would find in ``dataloader`` (the user's), else None.

    Composer's own look-up (``_get_distributed_sampler``: ``batch_sampler`` first, then ``sampler``), so that
    UnevenJoin reshuffles exactly the samplers Composer reshuffles, and leaves evaluation padding to Composer
    exactly where Composer removes it.
    """
    return compat.distributed_sampler(dataloader) if isinstance(dataloader, DataLoader) else None


def pads_by_repeating(dataloader: Any) -> bool:
    """True if ``dataloader`` shards with a ``DistributedSampler`` that repeats samples to even out the shards."""
    sampler = _distributed_sampler(dataloader)
    try:
        return sampler is not None and sampler.total_size > len(sampler.dataset)  # type: ignore[arg-type]
    except TypeError:  # a dataset without len()
        return False
