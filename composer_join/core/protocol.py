"""The join's protocol: what each step of an iteration is, decided from every rank's rows, the same on every rank.

Owns every decision the join's loader (:class:`~composer_join.join.iterator.JoinLoader`) takes while Composer
iterates over a dataloader (an epoch, an evaluation, a ``predict()``), and the messages of the errors they end in:

* what the first agreement's lengths mean (:func:`agreed_lengths`, :class:`Lengths`) and what is fixed for a
  loader (:class:`Rules`): the leading steps planned from the lengths alone, where the last step peeks past the
  longest ``len()`` (and where a batch is itself past it), whether Composer's length cap is lifted, this rank's row
  where it has no batch;
* per step, a step ahead (:meth:`Protocol.ahead`): whether the step is planned alone or agreed, and when its
  agreement starts: a step ahead, overlapping the previous step's training, except the first agreed step's, which
  starts only when that step is asked for (a rank that cannot form its batch on the last planned step stops without
  it, so the others must not start it early);
* per step, when it is asked for (:meth:`Protocol.plan`, :meth:`Protocol.verdict`): its :class:`StepPlan` (who
  trains, who shadows), and what the step is (:class:`Verdict`): a step to train, the iteration's common end, or an
  error every rank raises (a rank that failed or ran short of its ``len()``, a tensor-parallel group whose ranks
  hold different batches, batch structures a shadow batch cannot copy, ``throw_on_early_termination``, batches
  past the longest ``len()`` that Composer would drop), and which rank sends a template to ranks that never saw a
  batch; or, on a planned step where this rank has no batch, that it stops alone;
* whether the iteration goes on past the longest ``len()`` (:meth:`Protocol.last`), whether the step just trained
  ends the epoch (:meth:`Protocol.epoch_done`), the warning at the end of an epoch that went past it;
* after a loop that ended early on a planned step, who failed, and the error (:meth:`Protocol.check_ended_together`).

It imports no Composer and issues no collective itself: the rows are exchanged through an injected
:class:`Exchange` (on real ranks :class:`~composer_join.core.exchange.TorchExchange`, an all-reduce; in the tests,
``tests/lockstep.py``, which runs W simulated ranks in lockstep in one process). Cost: nothing beyond the exchange.

Example (one rank of two, on a step planned from the lengths: no exchange)::

    rules = Rules(Lengths(shared=5, check_overflow=True, per_rank=[5, 3]), rank=0, layout=Layout.flat(2))
    protocol = Protocol(rules, exchange)
    ticket = protocol.ahead(0, RankStatus(True, 8, 1), source_plans=False)   # step 0 < rules.planned: no agreement
    verdict = protocol.verdict(protocol.plan(ticket))                         # Verdict(plan, trains every rank)
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Union, cast

from composer_join.core.catalogue import NOTHING_UNREAD, STEP_AGREEMENT, STRUCTURES, WHO_FAILED
from composer_join.core.errors import UnevenInputsError
from composer_join.core.plan import RankStatus, Statuses, StepPlan, plan_from_lengths, steps_planned_from_lengths

if TYPE_CHECKING:
    import torch

    from composer_join.core.layout import Layout

__all__ = [
    'Agreement',
    'Exchange',
    'Lengths',
    'Pending',
    'Protocol',
    'Rules',
    'Ticket',
    'Verdict',
    'agreed_lengths',
]


class Pending(abc.ABC):
    """An exchange of rows under way (:meth:`Exchange.rows`)."""

    @abc.abstractmethod
    def wait(self) -> list[list[int]]:
        """Wait for every rank's row; the table, one row per rank."""

    def array(self) -> Any:
        """Wait for every rank's row; the table as an array (``world_size x len(row)`` integers, one row per rank).

        What the per-step agreement reads: an exchange whose rows arrive in a tensor overrides it to hand that
        over without making a Python object per rank (:class:`~composer_join.core.exchange.TorchExchange`)."""
        return self.wait()


class Exchange(abc.ABC):
    """The collectives the protocol rides on, injected; called on every rank in the same order. ``what``: the call's
    words, naming its entry of :mod:`composer_join.core.catalogue` (:meth:`~composer_join.core.catalogue.Collective.said`).

    Attributes:
        rank: this rank.
        world: the number of ranks.
    """

    rank: int
    world: int

    @abc.abstractmethod
    def rows(self, row: Sequence[int], what: str) -> Pending:
        """Start giving every rank every rank's ``row`` (integers, the same length on every rank); ``what``: the
        exchange and the step, in words, for what a rank says if a peer is gone while it waits."""

    @abc.abstractmethod
    def reduce(self, values: torch.Tensor, op: str, what: str) -> torch.Tensor:
        """``values`` (a tensor, the same shape on every rank) reduced over every rank, ``op`` ``'max'`` or ``'sum'``;
        returned (on the exchange's device)."""

    @abc.abstractmethod
    def gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj`` (picklable), on every rank: only on error paths and at checkpoints."""

    @abc.abstractmethod
    def broadcast(self, obj: Any, src: int, what: str) -> Any:
        """Rank ``src``'s ``obj`` (picklable), on every rank."""


def agreed_lengths(
    own_lens: Sequence[int], current_lens: Sequence[int]
) -> tuple[Optional[int], bool, list[Optional[int]]]:
    """What the first agreement's lengths mean: ``(shared, check_overflow, per_rank)``.

    ``own_lens``: every rank's ``len()`` (-1: none); ``current_lens``: every rank's trainer's cap on it (-1: none).
    ``shared``: the steps per epoch on every rank, the longest cap, or None where some rank's is unknown;
    ``check_overflow``: ``shared`` is the longest ``len()`` (no trainer asked for fewer batches), so batches past it
    would be lost unless the epoch goes on; ``per_rank``: every rank's ``len()``, None where it has none.

    Example:
        >>> agreed_lengths([5, 3], [5, 3]), agreed_lengths([5, 3], [2, 2]), agreed_lengths([5, -1], [5, -1])
        ((5, True, [5, 3]), (2, False, [5, 3]), (None, False, [5, None]))
    """
    shared = max(current_lens) if min(current_lens) >= 0 else None
    check_overflow = shared is not None and list(own_lens) == list(current_lens)
    return shared, check_overflow, [None if n < 0 else n for n in own_lens]


@dataclass(frozen=True)
class Lengths:
    """What the length agreement gave (:func:`agreed_lengths`), for one iteration kind."""

    shared: Optional[int]
    """Steps per epoch on every rank (the longest rank's), or None if some rank's dataloader has no ``len()``."""
    check_overflow: bool = False
    """``shared`` is the longest ``len()`` (nothing asked for fewer batches): peek past it at the last step; if some
    dataloader yields more, its extra batches train on agreed steps when Composer's cap is lifted
    (:meth:`Rules.lifts`), else every rank fails (they would be lost)."""
    per_rank: Optional[Sequence[Optional[int]]] = None
    """Every rank's own ``len()`` (None where it has none): the steps before the shortest rank's last batch are
    planned without a collective."""
    offset: int = 0
    """The iteration's first batch is step ``offset`` of its epoch (the rest of an epoch resumed on another world
    size, :mod:`composer_join.data.elastic`); ``shared`` and ``per_rank`` count from the epoch's start."""
    lifted: bool = False
    """Some rank's dataloader may yield more batches than its ``len()`` (an ``IterableDataset`` read by several
    workers, :class:`~composer_join.core.settings.Facts` ``overcounts``): Composer's cap is lifted while its loop
    starts (:meth:`Rules.lifts`), so the extra batches train on agreed steps. Elsewhere the cap stays, and a
    dataloader that yields more than the longest ``len()`` stops every rank (:meth:`Protocol.verdict`)."""

    def shifted(self, offset: int) -> Lengths:
        """These lengths, for an iteration whose first batch is step ``offset`` of its epoch."""
        if not offset:
            return self
        per_rank = None if self.per_rank is None else [None if n is None else offset + n for n in self.per_rank]
        shared = None if self.shared is None else offset + self.shared
        return Lengths(shared, self.check_overflow, per_rank, offset, self.lifted)


@dataclass(frozen=True)
class Rules:
    """What one loader's decisions are taken from, fixed for its life; the same on every rank but ``rank``.

    Args:
        lengths: what the length agreement gave.
        rank: this rank.
        layout: the data-parallel members (:class:`~composer_join.core.layout.Layout`). Under tensor parallelism
            every step is agreed and the ranks of a member must hold the same batch.
        throw: ``throw_on_early_termination``.
        label: the dataloader's label (``'train'``, an evaluator's), for messages.
        unregistered: train data whose position UnevenJoin does not know on every rank (left to Composer): an epoch
            resumed from it that runs short names that as the likelier cause.
        dataset: the dataset's class name, for that message.
    """

    lengths: Lengths
    rank: int
    layout: Layout
    throw: bool = False
    label: str = 'train'
    unregistered: bool = False
    dataset: str = 'NoneType'

    @property
    def world(self) -> int:
        return self.layout.world_size

    @property
    def length(self) -> Optional[int]:
        return self.lengths.shared

    @property
    def own_length(self) -> Optional[int]:
        """This rank's ``len()``, if it has one: running out before it is an error."""
        per_rank = self.lengths.per_rank
        return per_rank[self.rank] if per_rank else None

    @functools.cached_property
    def planned(self) -> int:
        """Leading steps of every epoch planned from the lengths alone, with no collective (none under TP); computed
        once (it reads every rank's length)."""
        if self.layout.tp > 1:  # every step agreed: the ranks of a tensor-parallel group must hold one batch
            return 0
        return steps_planned_from_lengths(self.lengths.per_rank, self.length)

    def agreed(self, step: int, source_plans: bool) -> bool:
        """Whether step ``step`` is agreed: it is not one of the :attr:`planned` leading steps, and the source does not
        know every rank has a batch there (``source_plans``: read-ahead rebalancing, not under TP)."""
        return step >= self.planned and not (self.layout.tp == 1 and source_plans)

    def peeks(self, step: int) -> bool:
        """Whether this rank, having a batch at ``step``, reads one more to see whether it yields more than ``len()``
        (at the last step by the longest ``len()``, where batches past it would otherwise be lost)."""
        length = self.length
        return self.lengths.check_overflow and length is not None and step == length - 1

    def past(self, step: int) -> bool:
        """Whether a batch at ``step`` is itself more than the longest ``len()`` promised: the first step of an
        iteration whose length is 0 (every ``len()`` 0), read like any first step, where no step has peeked."""
        length = self.length
        return self.lengths.check_overflow and length is not None and step >= length

    def reads_nothing(self, uncapped: bool) -> bool:
        """Whether Composer's loop over this loader asks for no batch at all, where a batch would be lost: every
        ``len()`` is 0, no cap was asked for (:attr:`Lengths.check_overflow`) and the cap is not lifted (``uncapped``):
        Composer takes ``islice(loader, 0)``, so no step reads, and no step peeks. The same on every rank."""
        return self.lengths.check_overflow and self.length == 0 and not uncapped

    def lifts(self, cap: Any) -> bool:
        """Whether Composer's cap ``cap`` (its ``dataloader_len``) must be lifted for a loop over this loader: it is
        the longest ``len()``, and some rank's dataloader may yield more (:attr:`Lengths.lifted`), whose extra batches
        would be lost."""
        length, lengths = self.length, self.lengths
        return (
            lengths.lifted and lengths.check_overflow and cap is not None and length is not None and int(cap) == length
        )

    def row_without_batch(self, step: int, ended_now: bool, template: Optional[int]) -> RankStatus:
        """This rank's row at a step where it has no batch: its dataloader ended just now (``ended_now``) before its
        ``len()`` (it ran short), else it shadows; ``template``: the fingerprint of its template (None: it has none,
        it must be sent one)."""
        own = self.own_length
        if ended_now and own is not None and step < own:  # batch i is trained at step i
            return RankStatus(has_batch=False, short=True)
        return RankStatus(False, samples=0, microbatches=1, needs_template=template is None, structure=template or 0)

    def where(self, step: int, epoch: int) -> str:
        """Step ``step`` in words (for what a rank says when a peer is gone)."""
        return f'batch {step} of epoch {epoch}' if self.label == 'train' else f'batch {step} of {self.label!r}'


class Agreement:
    """One step's agreement, under way: started on every rank in the same order, then :meth:`plan` waits for it.

    Example::

        pending = Agreement(step, RankStatus(has_batch=True, samples=8, microbatches=1), exchange, 'batch 4 of epoch 0')
        ...  # other work; other collectives may be issued meanwhile, in the same order on every rank
        plan = pending.plan()
    """

    def __init__(self, step: int, row: RankStatus, exchange: Exchange, where: str = ''):
        self.step = step
        self._pending = exchange.rows(row.row(), STEP_AGREEMENT.said(f'the agreement on {where or f"step {step}"}'))
        self._plan: Optional[StepPlan] = None

    def plan(self) -> StepPlan:
        """Wait for every rank's row (once) and return the common plan."""
        if self._plan is None:
            self._plan = StepPlan(step=self.step, statuses=Statuses(self._pending.array()))
        return self._plan


@dataclass(frozen=True)
class Ticket:
    """A step whose batch this rank has read (a step ahead): its row, and whether and how it is agreed."""

    step: int
    row: RankStatus
    """This rank's row: for an agreed step with the samples of planned steps not yet reported and the source's
    columns."""
    agreed: bool
    agreement: Optional[Agreement] = None
    """The agreement, started when the batch was read; None on a planned step, and on the first agreed step (started
    when the step is asked for)."""


@dataclass(frozen=True)
class Verdict:
    """What a step is, the same on every rank: train it (``plan``), end the iteration here, or raise ``error``."""

    plan: StepPlan
    error: Optional[BaseException] = None
    """Every rank raises here: the failing rank its own error, the others an :class:`UnevenInputsError`."""
    ends: bool = False
    """No rank has data left: the iteration ends at this step on every rank, which trains nothing."""
    template_from: Optional[int] = None
    """The lowest rank with data sends its template to the ranks that never saw a batch (one broadcast)."""


class Protocol:
    """One iteration's decisions on one rank, step by step (the module docstring says which, and who calls them).

    Args:
        rules: the loader's :class:`Rules`.
        exchange: the injected :class:`Exchange`.
        epoch: the epoch the iteration belongs to, for messages.
        first: the step the iteration starts at (nonzero: an epoch resumed mid-way).
        uncapped: Composer iterates without its length cap (:meth:`Rules.lifts`): batches past the longest ``len()``
            may train on agreed steps.
        ended: the iteration is over before it starts (its epoch was trained before the checkpoint it resumed).
    """

    def __init__(
        self,
        rules: Rules,
        exchange: Exchange,
        epoch: int = 0,
        first: int = 0,
        uncapped: bool = False,
        ended: bool = False,
    ):
        self.rules, self.exchange = rules, exchange
        self.epoch, self.first, self.uncapped = epoch, first, uncapped
        self.ended = ended  # ended by agreement (no rank has data left), or before it started
        self.beyond = False  # it goes on past the shared length: some rank yields more than its len()
        self.unreported = 0  # own samples on planned steps, not yet sent in an agreement (-1: uncountable)
        self.failure: Optional[tuple[int, Optional[BaseException]]] = None  # step and cause, on a planned step

    # -- a step ahead ------------------------------------------------------------------------------

    def ahead(
        self, step: int, own: RankStatus, source_plans: bool = False, columns: Optional[Mapping[str, Any]] = None
    ) -> Ticket:
        """This rank has read step ``step``'s batch (``own``: its row): whether the step is agreed, and its agreement.

        A planned step's samples are sent with the next agreement. An agreed step's row carries them and the
        source's ``columns``; its agreement starts now, overlapping the current step's training, unless it is the
        first agreed step (see the module docstring). ``source_plans``: the source knows every rank has a batch here
        (:meth:`~composer_join.core.source.BatchSource.planned_locally`).
        """
        if not self.rules.agreed(step, source_plans):
            if own.has_batch:  # sent with the next agreement (-1 once some batch could not be counted)
                uncountable = min(self.unreported, own.samples) < 0
                self.unreported = -1 if uncountable else self.unreported + own.samples
            return Ticket(step, own, agreed=False)
        row = replace(own, unreported_samples=self.unreported, **(columns or {}))
        early = step > self.rules.planned
        agreement = Agreement(step, row, self.exchange, self.rules.where(step, self.epoch)) if early else None
        return Ticket(step, row, agreed=True, agreement=agreement)

    # -- the step, when it is asked for -------------------------------------------------------------

    def plan(self, ticket: Ticket, error: Optional[BaseException] = None) -> Optional[StepPlan]:
        """The step's plan: agreed (waited for here), or planned from the lengths; None where this rank stops alone.

        On a planned step only this rank knows it has no batch (its dataloader raised, ``error``, or ended before
        its ``len()``): it stops iterating, Composer's own per-step "exhausted" all-reduce ends the loop on every
        rank at that step, and :meth:`check_ended_together` says why.
        """
        if not ticket.agreed:
            if not ticket.row.has_batch:
                self.failure = (ticket.step, error)  # error None: it ended before its len()
                return None
            return plan_from_lengths(ticket.step, self.rules.rank, ticket.row, self.rules.world)
        agreement = ticket.agreement
        if agreement is None:  # agreed now (the label, for a lost peer's message, made only here)
            agreement = Agreement(ticket.step, ticket.row, self.exchange, self.rules.where(ticket.step, self.epoch))
        plan = agreement.plan()
        self.unreported = 0  # in the plan now, so in the report (or, spun past, already in it)
        return plan

    def verdict(
        self,
        plan: StepPlan,
        error: Optional[BaseException] = None,
        counts: Union[Sequence[int], Callable[[], Sequence[int]]] = (),
        structure: Callable[[], str] = lambda: '',
    ) -> Verdict:
        """What the step of ``plan`` is (a planned step: trained). ``error``: what this rank's read raised;
        ``counts``: every member's real batches so far (the epoch's report; or a callable giving them, read only for
        the message that needs them); ``structure``: this rank's
        batch (or template) structure in words, gathered from every rank where structures differ (then an error)."""
        if not plan.agreed:
            return Verdict(plan)
        failure = self._failure(plan, error, counts, structure)
        if failure is not None:
            return Verdict(plan, error=failure)
        if not plan.num_active:
            self.ended = True
            return Verdict(plan, ends=True)
        overflow = plan.ranks_where('overflow')
        if overflow and not self.uncapped:  # Composer stops at its cap, the longest len(): they would be lost
            return Verdict(plan, error=self._overflow_error(overflow))
        self.beyond = self.beyond or bool(overflow)
        return Verdict(plan, template_from=plan.template_source)

    def check_nothing_unread(self, yields: bool) -> None:
        """Where Composer reads no batch (:meth:`Rules.reads_nothing`), on every rank as its loop starts: ``yields``,
        this rank's dataloader yields a batch all the same (its ``len()`` of 0 undercounts). One exchange of one
        integer per rank; every rank raises the overflow error naming the ranks that would lose batches."""
        said = NOTHING_UNREAD.said(f'the check that no {self.rules.label} dataloader of len() 0 yields a batch')
        table = self.exchange.rows([int(yields)], said).wait()
        overflow = [r for r, row in enumerate(table) if row[0]]
        if overflow:
            raise self._overflow_error(overflow)

    def last(self, step: int) -> bool:
        """Whether ``step`` is the iteration's last by the shared length (none past it is read), unless some rank
        yields more (:attr:`beyond`)."""
        length = self.rules.length
        return length is not None and step + 1 >= length and not self.beyond

    def epoch_done(self, ahead: Optional[Ticket]) -> bool:
        """Whether the step just yielded is its epoch's last, ``ahead`` being the next step's ticket (None: none is
        read). Known from the lengths, or from the next step's agreement, already under way on every rank (waited for
        here, no new collective); False where the next step is planned or its agreement has not started."""
        if ahead is None:
            return True
        return ahead.agreed and ahead.agreement is not None and not ahead.agreement.plan().num_active

    def beyond_warning(self, counts: Sequence[int], steps: int) -> Optional[str]:
        """On rank 0, at the end of an epoch that went on past the shared length: what to warn (None: nothing).
        ``counts``: every member's real batches in the epoch; ``steps``: the steps it ran."""
        per_rank, layout = self.rules.lengths.per_rank, self.rules.layout
        if not self.beyond or self.rules.rank != 0 or per_rank is None:
            return None
        per_member = layout.leaders(per_rank)
        over = [(m, n, own) for m, (n, own) in enumerate(zip(counts, per_member)) if own is not None and n > own]
        ranks = '; '.join(f'{layout.name(m)} yielded {n} batches, its len() is {own}' for m, n, own in over)
        length = cast(int, self.rules.length)
        return (
            f'UnevenJoin: the {self.rules.label} dataloader yields more batches than its len() says in epoch '
            f'{self.epoch} ({ranks}): an IterableDataset read by several DataLoader workers ends each worker with its '
            f'own partial batch. UnevenJoin treats len() as a hint: the epoch ran {steps} steps, every extra batch '
            f'trained once, on steps agreed by all ranks. Composer still counts {length} batches per epoch (the '
            f'longest len()), so a schedule computed from len() (a max_duration, or an LR schedule, in epochs) '
            f'runs {steps - length} steps per epoch ahead of training and ends early. Give the '
            f"dataset a __len__ that counts each worker's batches, or state durations in batches or samples."
        )

    # -- after the loop ------------------------------------------------------------------------------

    def check_ended_together(self, steps: int) -> None:
        """Raise on every rank if the loop ended after ``steps`` steps, before the shared length, not by agreement.

        Then some rank stopped alone on a planned step (:meth:`plan`): the ranks agree on who (one exchange), gather
        the causes where some rank raised (only then), and every rank raises, the failing one its own error, the
        others :class:`UnevenInputsError` naming it and its cause. Where no rank failed, Composer ended the epoch by its
        own count (it re-read the dataloader from its start within the epoch, ``spin_dataloaders=False``, and reached
        its ``dataloader_len``): nothing is raised. Where the loop reached the shared length, a no-op, no exchange.
        """
        length = self.rules.length
        if length is None or self.ended or steps >= length:
            return
        step, error = self.failure if self.failure is not None else (None, None)
        short = self.failure is not None and error is None
        what = WHO_FAILED.said('the agreement on which ranks could not form a batch')
        table = self.exchange.rows([-1 if step is None else step, int(short)], what).wait()
        failed = [None if s < 0 else (int(s), bool(f)) for s, f in table]
        if all(f is None for f in failed):
            return  # no rank failed: Composer ended the epoch by its own count (fit(duration=...), spin_dataloaders)
        causes: list[Optional[str]] = []
        if any(f is not None and not f[1] for f in failed):  # on every rank alike: only on this error path
            cause = None if error is None else f'{type(error).__name__}: {error}'
            causes = self.exchange.gather(cause, WHO_FAILED.said('the gather of the causes of the ranks that failed'))
        if error is not None:
            raise error
        ran_short = [r for r, f in enumerate(failed) if f is not None and f[1]]
        if ran_short:
            raise self._short_error(ran_short, min(f[0] for f in failed if f is not None and f[1]))
        ranks = [r for r, f in enumerate(failed) if f is not None]
        at = sorted({f[0] for f in failed if f is not None})
        raise UnevenInputsError(
            f'rank(s) {ranks} could not form batch {", ".join(map(str, at))} of epoch {self.epoch} (their '
            f'dataloader raised); every rank stops here, the failing rank raises the cause: '
            + '; '.join(f'rank {r}: {cause}' for r, cause in enumerate(causes) if cause is not None),
        )

    # -- the errors ----------------------------------------------------------------------------------

    def _failure(
        self,
        plan: StepPlan,
        error: Optional[BaseException],
        counts: Union[Sequence[int], Callable[[], Sequence[int]]],
        structure: Callable[[], str],
    ) -> Optional[BaseException]:
        """The error every rank raises at an agreed step, if any, in order of precedence."""
        failed = plan.ranks_where('failed')
        if failed:
            if error is not None:
                return error
            return UnevenInputsError(
                f'rank(s) {failed} could not form batch {plan.step} of epoch {self.epoch} (their dataloader raised, '
                f'or their data cannot be shadowed); every rank stops here, the failing rank raises the cause'
            )
        short = plan.ranks_where('short')
        if short:
            return self._short_error(short, plan.step)
        try:
            self.rules.layout.check_rows(plan.statuses, plan.step, self.epoch, self.rules.label)
        except UnevenInputsError as e:
            return e
        if plan.structures_differ:
            said = STRUCTURES.said(f"the gather of the batches' structures at step {plan.step}")
            structures = self.exchange.gather(structure(), said)  # only on this error path, on every rank
            per_rank = '; '.join(f'rank {r}: {d}' for r, d in enumerate(structures))
            return UnevenInputsError(
                f'at step {plan.step} of epoch {self.epoch} rank(s) {plan.joined_ranks} shadow with a batch shaped '
                f"after another step's or another rank's, but the batches differ in structure ({per_rank}). A shadow "
                f"batch copies container types, keys, tensor dtypes and dimensions; make every rank's dataloader "
                f'yield one structure at every step.',
            )
        if self.rules.throw and plan.num_active and plan.any_joined:
            layout = self.rules.layout
            batches = ', '.join(
                f'{layout.name(m)}: {n}' for m, n in enumerate(counts() if callable(counts) else counts)
            )
            return UnevenInputsError(
                f'rank(s) {plan.joined_ranks} ran out of data at step {plan.step} of epoch {self.epoch} '
                f'while rank(s) {plan.active_ranks} still have batches (batches so far: {batches}). '
                f'UnevenJoin(throw_on_early_termination=True) stops here; set it to False to let exhausted '
                f'ranks join and shadow the others until all are done.',
            )
        return None

    def _overflow_error(self, ranks: list[int]) -> UnevenInputsError:
        where = ', in an epoch resumed mid-way from a checkpoint' if self.first > 0 else ''
        return UnevenInputsError(
            f'the {self.rules.label} dataloader of rank(s) {ranks} yielded more than the {self.rules.length} batches '
            f'per epoch that the longest len() promised{where}, and Composer stops every epoch at that length: the '
            f"extra batches would be silently dropped. Make __len__ of each rank's dataset match what it yields, or "
            f'remove __len__ so the epoch ends when the data does. (Where an IterableDataset is read by several '
            f'DataLoader workers, UnevenJoin trains such extra batches: each worker ends with its own partial batch.)',
        )

    def _short_error(self, ranks: list[int], step: int) -> UnevenInputsError:
        """The error for dataloaders that ended after ``step`` batches, before their ``len()``; in an epoch resumed
        from a position left to Composer, the likelier cause."""
        short = (
            f'the dataloader of rank(s) {ranks} ran out after {step} batches in epoch {self.epoch}, fewer '
            f'than its len() promised (this rank: len() {self.rules.own_length})'
        )
        if self.rules.unregistered and self.first > 0:
            dataset = self.rules.dataset
            return UnevenInputsError(
                f'{short}, in an epoch resumed from batch {self.first}. The position of the train data '
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
