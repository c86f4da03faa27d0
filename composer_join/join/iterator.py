"""The join's loader: what Composer iterates while UnevenJoin is active, and the record of the step being trained.

Owns :class:`~composer_join.join.iterator.JoinLoader`, which only iterates: Composer's ``_iter_dataloader`` calls ``next`` on it once per step on
every rank, and inside that call it

1. asks the :mod:`protocol <composer_join.core.protocol>` what the step whose batch it read a step ahead is (its
   :class:`~composer_join.core.plan.StepPlan`, agreed or planned from the lengths; the iteration's common end; an
   error every rank raises; or, on a planned step, that this rank stops alone);
2. publishes the step's :class:`~composer_join.join.iterator.StepRecord`, the one thing the rest of the join reads about "this step"
   (:attr:`~composer_join.join.iterator.JoinLoader.step`), and records it in the epoch's report;
3. reads the next step's batch from its :class:`~composer_join.core.source.BatchSource` as a typed item (a
   :class:`~composer_join.join.iterator.Batch`, an :class:`~composer_join.join.iterator.Idle` step, a :class:`~composer_join.join.iterator.Failure`) and hands its row to the protocol, which starts its
   agreement where one is due, so that it overlaps this step's training;
4. yields the real batch, or, on a rank that has run out, a *shadow batch*: the same structure with zero samples,
   which Composer counts as zero samples and tokens and splits into one microbatch, so all of Composer's per-step
   collectives still match across ranks.

Also owns :class:`~composer_join.join.iterator.Learned` (what a run learns from one dataloader's batches: the template a rank with no data of its
own is sent once by the lowest rank with data, the stand-in input, list-metric states; handed on only to a later
loader over the same dataloader object, never looked up by label) and :class:`~composer_join.join.iterator.Glue`, the Composer-facing callables
the loader is given by :func:`~composer_join.join.loader.join_dataloader`, which builds it (counting a batch with
Composer's ``DataSpec``, the microbatch size in force, the iteration's register of changes, where an iteration
starts, the sampler's epoch). It imports nothing of Composer's: every collective goes through the injected
:class:`~composer_join.core.protocol.Exchange`, so W simulated ranks run it in one process (``tests/lockstep.py``).

Example (what the algorithm's run reads while a step trains)::

    record = loader.step            # StepRecord(index, plan, size, any_shadow), None outside a step
    loader.publish(replan(record.plan, ...))  # another algorithm reshaped the batch: a new record
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Optional, Union, cast

from composer_join.core.batches import content_crc, first_samples, to_cpu
from composer_join.core.catalogue import TEMPLATE
from composer_join.core.changes import Changes
from composer_join.core.plan import RankStatus, StepPlan
from composer_join.core.protocol import Exchange, Protocol, Rules, Ticket
from composer_join.core.report import EpochReport
from composer_join.core.settings import Facts
from composer_join.core.source import IDLE, BatchSource, Failed
from composer_join.data.resume import Progress, RankPositions, Start
from composer_join.interop.metrics import MetricStates
from composer_join.shadow.structure import describe as describe_structure
from composer_join.shadow.structure import fingerprint

__all__ = ['TEMPLATE_SAMPLES', 'Batch', 'Failure', 'Glue', 'Idle', 'JoinLoader', 'Learned', 'StepRecord']

log = logging.getLogger(__name__)

TEMPLATE_SAMPLES = 2
"""Samples in a shadow forward: two, so that BatchNorm in training mode accepts it."""

Describe = Callable[[Any], tuple[int, int]]


@dataclass
class Learned:
    """What a run learns from one dataloader's batches; kept by the :class:`JoinLoader` made for that dataloader.

    A later loader made for the same dataloader object (the trainer's next fit, or next evaluation with it) takes
    it over; a loader for another dataloader starts with a new one, so nothing learned from one dataloader shapes
    another's stand-ins, whatever their labels. Dropped with the loaders that hold it.
    """

    template: Any = None
    """First samples of a real batch (:attr:`Glue.template_samples`), on the CPU: this rank's own, or (no data of its
    own) the ones another rank sent. Shadow batches copy its structure; every rank's agreement row carries its
    fingerprint."""
    stand_in: Any = None
    """The two samples a stand-in forward runs on, on the device: a real microbatch's first samples on this rank, or
    the template moved there (:class:`~composer_join.join.microbatches.Microbatches`)."""
    metric_states: MetricStates = field(default_factory=MetricStates)
    """The empty states of this dataloader's list-state metrics (:mod:`composer_join.interop.metrics`)."""
    warned: bool = False
    """The warning about a ``len()`` that undercounts was given (once per dataloader)."""

    def share(self, exchange: Exchange, src: int) -> None:
        """Rank ``src``'s template, sent to every rank (one broadcast); kept by a rank that has none."""
        said = TEMPLATE.said(f"rank {src}'s template for ranks that never had data")
        received = exchange.broadcast(self.template if exchange.rank == src else None, src, said)
        if self.template is None:
            self.template = received
            log.info('rank %d has no data of its own; shaped its shadow batches after rank %d', exchange.rank, src)


@dataclass(frozen=True)
class Glue:
    """What the loader needs from Composer, fixed for its life (built by :func:`~composer_join.join.loader.join_dataloader`)."""

    describe: Describe = lambda batch: (-1, 0)
    """``batch -> (samples, microbatches)`` as Composer will count and split it; ``-1`` samples or ``0``
    microbatches where that cannot be known."""
    microbatch_size: Callable[[], Any] = lambda: None
    """``() ->`` the microbatch size in force (automatic microbatching halves it after an OOM)."""
    opened: Callable[[], Changes] = Changes
    """``() ->`` the register of changes for one iteration (:mod:`composer_join.core.changes`), made when the
    iteration opens and undone when it ends, also when the run raises."""
    start: Optional[Callable[[], Start]] = None
    """Train only: ``() ->`` where the next iteration starts in its epoch (:func:`composer_join.data.resume.train_position`),
    read when it starts, so that a mid-epoch resume reshuffles and counts right."""
    reshuffle: Callable[[int], None] = lambda epoch: None
    """At every epoch's start: reshuffle the user's ``DistributedSampler`` as Composer would."""
    template_samples: Optional[int] = TEMPLATE_SAMPLES
    """Samples of this rank's first batch kept as the :attr:`Learned.template`: two, or (None) the whole batch,
    where the ``DataSpec``'s ``batch_transforms`` may change how many samples a batch has (a stand-in made from two
    could then have fewer than two: BatchNorm refuses one)."""


@dataclass(frozen=True)
class StepRecord:
    """The step being trained, as every part of the join reads it; published by the loader, replaced, never edited."""

    index: int
    """The step's index in its epoch (``batch_in_epoch``)."""
    plan: StepPlan
    """The step's plan, its microbatch counts for the microbatch size ``size``."""
    size: Any
    """The microbatch size in force when the step's batch was read (a step ahead) and its counts were taken."""

    @property
    def any_shadow(self) -> bool:
        """Some rank has no real batch at this step: ``bool(plan.joined_ranks)``."""
        return self.plan.any_joined

    def recounted(self, size: Any) -> StepRecord:
        """This step with its microbatch counts for ``size`` (:meth:`~composer_join.core.plan.StepPlan.recounted`)."""
        return StepRecord(self.index, self.plan.recounted(size), size)


_FAILED = RankStatus(has_batch=False, failed=True)
_NOTHING = object()  # what a dataloader's iterator gives where it yields nothing


@dataclass(frozen=True)
class Batch:
    """A read: a real batch this rank trains at the step, and its row."""

    value: Any
    row: RankStatus


@dataclass(frozen=True)
class Idle:
    """A read: no batch at the step (this rank shadows, or ran short of its ``len()``), and its row."""

    row: RankStatus


@dataclass(frozen=True)
class Failure:
    """A read: this rank could not form its batch (``error``: why), and its row."""

    error: BaseException
    row: RankStatus = _FAILED


Item = Union[Batch, Idle, Failure]


class _Ahead(NamedTuple):
    """The next step, read a step ahead: what was read, its ticket with the protocol, the microbatch size then."""

    item: Item
    ticket: Ticket
    size: Any


class _Reader:
    """One iteration's reading: the source's batches as typed items, each with this rank's row for the protocol.

    A batch read to see whether the source yields more than ``len()`` (a peek, at the last step by the longest
    ``len()``) is kept for the next read: none is lost.
    """

    def __init__(self, batches: Iterator[Any], rules: Rules, glue: Glue, learned: Learned, exhausted: bool = False):
        self.batches, self.rules, self.glue, self.learned = batches, rules, glue, learned
        self.exhausted = exhausted  # this rank's dataloader has run out (torch may hand back the same iterator)
        self.peeked: list[Any] = []

    @property
    def ended(self) -> bool:
        """Nothing is left to read."""
        return self.exhausted and not self.peeked

    def read(self, step: int) -> Item:
        """This rank's batch for step ``step``: a batch, an idle step (none), or a failure."""
        ended_now = False
        if not self.exhausted:
            try:
                batch = self.peeked.pop() if self.peeked else next(self.batches)
            except StopIteration:
                self.exhausted = ended_now = True
            except Exception as e:  # reported to every rank by the agreement, then re-raised here
                return Failure(e)
            else:
                if isinstance(batch, Failed):  # a rebalancer's step failed (its transfers were made)
                    return Failure(batch.error)
                if batch is not IDLE:  # IDLE: read-ahead rebalancing has no batch here, the epoch goes on
                    return Batch(batch, self._row(batch, step))
        template = self.learned.template
        return Idle(self.rules.row_without_batch(step, ended_now, None if template is None else fingerprint(template)))

    def _row(self, batch: Any, step: int) -> RankStatus:
        """A real batch's row: its counts, its structure, and (at the last step by length) whether more follows."""
        if self.learned.template is None:
            kept = self.glue.template_samples
            self.learned.template = to_cpu(first_samples(batch, sys.maxsize if kept is None else kept))
        samples, microbatches = self.glue.describe(batch)
        more = self.rules.past(step) or (self.rules.peeks(step) and self._peek())
        content = content_crc(batch) if self.rules.layout.tp > 1 else 0
        return RankStatus(True, samples, microbatches, overflow=more, structure=fingerprint(batch), content=content)

    def structure(self, item: Item) -> str:
        """This rank's batch structure at the step (or its template's), in words: for the error where they differ."""
        return describe_structure(item.value if isinstance(item, Batch) else self.learned.template)

    def _peek(self) -> bool:
        """Whether the source yields another batch; it is kept for the next read."""
        try:
            self.peeked.append(next(self.batches))
        except StopIteration:
            self.exhausted = True
            return False
        except Exception as e:  # raised by the next read, on a step every rank agrees on
            self.peeked.append(Failed(e))
        return True


@dataclass
class _Iteration:
    """What one iteration (an epoch, an evaluation) keeps; a new one at every start."""

    protocol: Protocol
    steps: int = 0  # steps yielded so far (from the step it started at: nonzero for an epoch resumed mid-way)
    trained: int = 0  # own real samples yielded (-1: uncountable)
    trained_before: int = 0  # the same before the last step yielded
    finished_on_resume: bool = False  # its epoch was trained before a checkpoint: it read nothing
    reader: Optional[_Reader] = None  # its batches
    ahead: Optional[_Ahead] = None  # the next step
    record: Optional[StepRecord] = None  # the step being trained, as published
    recount: Optional[tuple[StepRecord, StepRecord]] = None  # it, and it for the microbatch size in force


class JoinLoader:
    """One rank's dataloader, made to end every epoch on all ranks at the same step.

    Args:
        source: where this rank's batches come from (:class:`~composer_join.core.source.BatchSource`: its own
            dataloader, or a rebalancer over it), chosen by :func:`~composer_join.join.loader.batch_source`.
        glue: what it needs from Composer (:class:`Glue`).
        rules: what the protocol decides from (:class:`~composer_join.core.protocol.Rules`).
        exchange: the collectives (:class:`~composer_join.core.protocol.Exchange`).
        learned: what was learned from this dataloader's batches before (:class:`Learned`), or a new record.
        positions: train data that keeps its own position (:class:`~composer_join.data.resume.RankPositions`):
            the user's dataloader is opened through it.
        report: the current epoch's report, if it goes on (a checkpoint's, resumed).
        facts: every rank's :class:`~composer_join.core.settings.Facts` from the first agreement (some rank's trainer
            has other algorithms; what the wrapper learned, for a fit's start).
    """

    def __init__(
        self,
        source: BatchSource,
        glue: Glue,
        rules: Rules,
        exchange: Exchange,
        learned: Optional[Learned] = None,
        positions: Optional[RankPositions] = None,
        report: Optional[EpochReport] = None,
        facts: Sequence[Facts] = (),
    ):
        self.source, self.glue, self.rules, self.exchange = source, glue, rules, exchange
        self.learned = learned if learned is not None else Learned()
        self.positions, self.facts = positions, tuple(facts)
        self.report = report or self._new_report(0)
        self.epoch = self.report.epoch
        # the current step's register of changes: made when a step's batch is yielded, undone when Composer asks for
        # the next one, when the iteration ends, or when the run raises; None between steps
        self.step_changes: Optional[Changes] = None
        self.uncapped = False  # Composer iterates without its dataloader_len cap this time (see Rules.lifts)
        # () -> None, called once when the next iteration starts (Composer's loop has read its cap): puts it back
        self.on_iteration: Optional[Callable[[], None]] = None
        self._resumed: tuple[int, bool] = (0, False)  # own samples trained, own data ended, before a mid-epoch resume
        self._now = _Iteration(Protocol(rules, exchange, self.epoch))
        # the last iteration started (see close_iteration); held weakly: Python closes it once Composer drops it
        self._iteration: Optional[weakref.ref[Iterator[Any]]] = None

    def _new_report(self, epoch: int) -> EpochReport:
        layout = self.rules.layout
        return EpochReport(epoch=epoch, world_size=layout.members, tensor_parallel=layout.tp)

    # -- what the algorithm reads ---------------------------------------------------------------------

    @property
    def dataloader(self) -> Any:
        """This rank's own dataloader (the user's)."""
        return self.source.dataloader

    @property
    def describe(self) -> Describe:
        """``batch -> (samples, microbatches)`` as Composer counts and splits it (:attr:`Glue.describe`)."""
        return self.glue.describe

    @property
    def length(self) -> Optional[int]:
        return self.rules.length

    @property
    def finished_on_resume(self) -> bool:
        """The current iteration ended at once: its epoch was trained before the checkpoint it resumed."""
        return self._now.finished_on_resume

    @property
    def step(self) -> Optional[StepRecord]:
        """The step being trained (None outside an iteration), its microbatch counts for the size in force now.

        The counts were taken when the batch was read, a step ahead; if Composer has changed the microbatch size
        since (automatic microbatching, after a CUDA OOM, on every rank alike), this is a new record with the counts
        recomputed from the agreed samples (:meth:`StepRecord.recounted`).
        """
        now = self._now
        record, size = now.record, self.glue.microbatch_size()
        if record is None or size == record.size:
            return record
        if now.recount is None or now.recount[0] is not record or now.recount[1].size != size:
            now.recount = (record, record.recounted(size))
        return now.recount[1]

    def current_plan(self) -> Optional[StepPlan]:
        """The plan of :attr:`step` (None outside an iteration)."""
        record = self.step
        return record.plan if record is not None else None

    @property
    def shadowing(self) -> bool:
        """This rank has no real batch at :attr:`step` (False outside an iteration)."""
        record = self.step
        return record is not None and not record.plan.has_batch(self.rules.rank)

    def publish(self, plan: StepPlan) -> StepRecord:
        """Make and publish a new record of the step being trained with ``plan`` (its counts taken again after
        another algorithm reshaped the batch, :func:`~composer_join.interop.replan.replan`); returns it."""
        record = self._now.record
        if record is None:
            raise RuntimeError('UnevenJoin: a step plan published outside a step')
        self._now.record = replace(record, plan=plan)
        return self._now.record

    def progress(self, steps: Optional[int] = None) -> Progress:
        """Where this rank stands in the epoch (samples trained and used, bytes sent, own data ended) after the steps
        yielded, or the epoch's first ``steps`` (Composer's ``batch_in_epoch``: one fewer if a run raised in the last)."""
        now = self._now
        ahead_batch = now.ahead is not None and now.ahead.item.row.has_batch
        ended = now.reader is not None and now.reader.ended and not ahead_batch
        steps, trained = (now.steps - 1, now.trained_before) if steps == now.steps - 1 else (now.steps, now.trained)
        offset = self.rules.lengths.offset
        return Progress(
            trained=trained,
            used=self.source.used(steps - offset, trained),
            sent=self.source.sent(steps - offset),
            ended=self.source.ends_with_own_data and ended and trained == now.trained,
        )

    def resume(self, own: dict[str, Any], saved: list[dict[str, Any]]) -> None:
        """Before a mid-epoch resumed iteration: this rank's checkpoint entry (``own``) and every rank's (``saved``).

        The epoch's partial report gets every rank's exact count (on steps planned from the lengths, the report
        alone had not received them yet).
        """
        self._resumed = (int(own['trained']), bool(own.get('ended', False)))
        self.source.resume(int(own['used']), int(own.get('sent', 0)))
        self.report.real_samples = self.rules.layout.leaders([int(entry['trained']) for entry in saved])

    def __getattr__(self, name: str) -> Any:
        """Other attributes are the wrapped dataloader's (``batch_size``, ``dataset``: SeqLengthWarmup reads them)."""
        source = self.__dict__.get('source')
        if source is None or name.startswith('__'):
            raise AttributeError(name)
        return getattr(source.dataloader, name)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("some rank's train dataloader has no len(), so the epoch length is unknown")
        return self.length

    def samples(self, batch: Any) -> int:
        """Samples in ``batch`` (a microbatch, say), as Composer counts them; -1 if they cannot be counted."""
        return self.glue.describe(batch)[0]

    def set_epoch(self, epoch: int) -> None:
        """Called at every epoch start: reshuffles a ``DistributedSampler`` as Composer would."""
        self.epoch = epoch
        self.glue.reshuffle(epoch)

    def epoch_done(self) -> bool:
        """Whether the step just yielded is its epoch's last (then a checkpoint taken after it is an epoch boundary).

        Known from the lengths, or from the next step's agreement, already under way on every rank (waited for
        here, no new collective); False outside an iteration, or where the next step is planned without one.
        """
        now = self._now
        if now.record is None:
            return False
        return now.protocol.epoch_done(now.ahead.ticket if now.ahead is not None else None)

    def check_ended_together(self) -> None:
        """Raise on every rank if this epoch (or evaluation) ended early because some rank could not form a batch.

        Call on every rank once Composer's loop over this loader has ended (``EPOCH_END``, ``EVAL_END``). On a step
        planned from the lengths, a rank whose dataloader raises (or ends before its ``len()``) stops iterating, and
        Composer's own per-step "exhausted" all-reduce ends the loop on every rank at that step. Every rank then sees
        fewer steps than planned and, only then, agrees on who failed (one collective) and raises: the failing rank
        its own error, the others :class:`UnevenInputsError` naming it
        (:meth:`~composer_join.core.protocol.Protocol.check_ended_together`). Otherwise a no-op, no collective.
        """
        self._now.protocol.check_ended_together(self._now.steps)

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
        started, self.on_iteration = self.on_iteration, None
        if started is not None:
            started()
        if self.rules.reads_nothing(self.uncapped):  # Composer asks for no batch: would it lose one?
            yields = next(iter(self.dataloader), _NOTHING) is not _NOTHING
            Protocol(self.rules, self.exchange, self.epoch).check_nothing_unread(yields)
        iteration = self._iterating()
        self._iteration = weakref.ref(iteration)
        return iteration

    def _iterating(self) -> Iterator[Any]:
        changes = self.glue.opened()
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
        return self.positions.open(self.dataloader, resumed, self.samples, lambda: self.progress().used)

    def _iterate(self) -> Iterator[Any]:
        first, skipped, finished, rereads = 0, 0, False, False
        if self.glue.start is not None:
            epoch, first, skipped, finished, rereads = self.glue.start()
            self.set_epoch(epoch)
        trained_before, ended_before = self._resumed if first else (0, False)
        if (first + skipped == 0 and not rereads) or self.report.epoch != self.epoch:  # else: the report's epoch
            self.report = self._new_report(self.epoch)
        if finished:  # every batch of the epoch was trained before the checkpoint: end it, reading nothing
            protocol = Protocol(self.rules, self.exchange, self.epoch, first, ended=True)
            self._now = _Iteration(protocol, steps=first, finished_on_resume=True)
            return
        offset = self.rules.lengths.offset
        batches = self.source.epoch(first - offset, self._open)
        protocol = Protocol(self.rules, self.exchange, self.epoch, first, uncapped=self.uncapped)
        self.uncapped = False
        # a position loaded where this rank's data had ended may start the library's next epoch: read nothing
        exhausted = ended_before and self.source.ends_with_own_data
        reader = _Reader(batches, self.rules, self.glue, self.learned, exhausted)
        now = self._now = _Iteration(protocol, steps=first, trained=trained_before, reader=reader)
        now.ahead = self._read_ahead(first)
        step = first
        try:
            while now.ahead is not None:
                item, ticket, size = now.ahead
                error = item.error if isinstance(item, Failure) else None
                plan = protocol.plan(ticket, error)
                if plan is None:  # only this rank knows it has no batch: it stops, and Composer stops every rank
                    self.source.make_transfers(batches, step + 1 - offset)
                    return
                self.source.observe(plan)  # read-ahead rebalancing: buffer levels (or bounds) for the next step
                structure = functools.partial(reader.structure, item)  # gathered only where structures differ
                verdict = protocol.verdict(plan, error, lambda: self.report.real_batches, structure)
                if verdict.error is not None:
                    raise verdict.error
                if verdict.ends:
                    self._warn_if_beyond(protocol)
                    return
                if verdict.template_from is not None:
                    self.learned.share(self.exchange, verdict.template_from)
                now.record = StepRecord(step, plan, size)
                if step >= first + skipped:  # not a batch Composer spins past on resumption
                    self.report.record(self.rules.layout.member_plan(plan))
                # Read the next batch (and start its agreement) now: it completes while this step trains.
                # With a known length none past it is read, unless some rank yields more (protocol.beyond).
                now.ahead = None if protocol.last(step) else self._read_ahead(step + 1)
                now.steps = step + 1
                now.trained_before = now.trained
                if isinstance(item, Batch):
                    samples = item.row.samples
                    now.trained = -1 if min(now.trained, samples) < 0 else now.trained + samples
                step_changes = self.step_changes = Changes()
                try:
                    yield item.value if isinstance(item, Batch) else first_samples(self.learned.template, 0)
                finally:  # Composer asks for the next batch, or the iteration ends (also when the run raises)
                    self.step_changes = None
                    step_changes.undo()
                step += 1
        finally:
            now.record, now.ahead = None, None

    def _read_ahead(self, step: int) -> _Ahead:
        """Read step ``step``'s batch and hand its row to the protocol, which starts the step's agreement if due."""
        size = self.glue.microbatch_size()
        item = cast(_Reader, self._now.reader).read(step)
        source = self.source
        ticket = self._now.protocol.ahead(step, item.row, source.planned_locally(), source.status_columns())
        return _Ahead(item, ticket, size)

    def _warn_if_beyond(self, protocol: Protocol) -> None:
        """Once per loader, on rank 0, at the end of an epoch that went on past ``length``: say so, and what it does."""
        if self.learned.warned:
            return
        message = protocol.beyond_warning(self.report.real_batches, self._now.steps)
        if message is not None:
            self.learned.warned = True
            warnings.warn(message, stacklevel=2)
