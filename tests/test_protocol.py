"""The join's protocol in one process: every rule table-driven, and whole runs of W simulated ranks checked for its
invariants, on chosen cases and on random ones (hypothesis).

The rules (``composer_join.core.protocol``) are called directly, one rank at a time, with every other rank's row
given (:class:`Given`). The runs build the real ``JoinLoader`` on every simulated rank (``tests/simulated.py``: W
threads, collectives met in order by ``tests/lockstep.py``, which fails a run whose ranks issue different
collectives, or wait for one some rank never issues) and iterate it as Composer's loop does. Their expected outcome
is computed here from the shards alone (:func:`expected`), not from the code: in ``mode='shadow'`` member ``m``
trains its ``t``-th batch at step ``t`` and shadows once it has none; an epoch lasts as many steps as the longest
member yields batches; the first fault (a read that raises, a ``len()`` that promises more than the dataloader yields,
or with ``throw_on_early_termination`` the first step where some member has no batch while others have) stops every
rank at that step, every rank raising, the failing rank its own error. The invariants checked on every run: every
batch trained once, by its member, at its step; every rank the same steps and, where agreed, the same plan; an
agreement at every step where some member has no batch (none of the steps planned from the lengths is one), and
agreements exactly where the lengths leave the step open; ``epoch_done`` exactly at each epoch's last step.

These replace the multi-process scenarios that only exercised these decisions: a failing dataloader at other steps
and with the other rank failing (``fails_at_step_*``, ``len_overstates@1``: tests/test_collective_cost.py;
``loader_fails@1``: tests/test_join_core.py; ``gift_read_fails@1``: tests/test_rebalance.py;
``readahead_fails_*@1``: tests/test_rebalance_unsized.py; ``rebalance_len_*_swapped``: tests/test_len_hints.py),
each with the assertions it had there. One of each stays there, on real ranks: the scenarios that check real
collectives, real training and Composer's own loop all stay.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import composer_join
import test_rebalance
import test_rebalance_unsized as unsized
from composer_join.core.errors import UnevenInputsError
from composer_join.core.layout import Layout
from composer_join.core.plan import RankStatus
from composer_join.core.protocol import Exchange, Lengths, Pending, Protocol, Rules, Ticket, agreed_lengths
from lockstep import Hang, Mismatch
from simulated import FLAG, Shard, Simulation, simulate

S = RankStatus
REAL = S(True, 8, 1, structure=7)
SHADOW = S(False, 0, 1, structure=7)
FLAT2, TP2 = Layout.flat(2), Layout(((0, 1),))


class _Done(Pending):
    def __init__(self, table: list[list[int]]):
        self.table = table

    def wait(self) -> list[list[int]]:
        return self.table


class Given(Exchange):
    """One rank's exchange in a table-driven case: the other ranks' rows (and gathered objects) are given."""

    def __init__(self, rank: int, rows: Sequence[Any] = (), gathered: Sequence[Any] = ()):
        self.rank, self.world = rank, max(len(rows), len(gathered), rank + 1)
        self.others, self.gathered = list(rows), list(gathered)
        self.issued: list[str] = []

    def rows(self, row: Sequence[int], what: str) -> Pending:
        self.issued.append(what)
        table = [r.row() if isinstance(r, RankStatus) else list(r) for r in self.others]
        table[self.rank] = list(row)
        return _Done(table)

    def reduce(self, values: Any, op: str, what: str) -> Any:
        raise AssertionError('not in these cases')

    def gather(self, obj: Any, what: str) -> list[Any]:
        self.issued.append('gather')
        return [obj if r == self.rank else g for r, g in enumerate(self.gathered)]

    def broadcast(self, obj: Any, src: int, what: str) -> Any:
        raise AssertionError('not in these cases')


def rules(per_rank: Sequence[Optional[int]] = (5, 3), layout: Layout = FLAT2, rank: int = 0, **kw: Any) -> Rules:
    """Rules over lengths agreed from ``per_rank`` (each rank's own ``len()``, None: none), no cap asked for."""
    own = [-1 if n is None else n for n in per_rank]
    shared, check_overflow, lens = agreed_lengths(own, own)
    return Rules(Lengths(shared, check_overflow, lens), rank, layout, **kw)


# -- the rules, one at a time ------------------------------------------------------------------------


def test_the_protocol_imports_no_composer_and_no_collective():
    """What the protocol runs on: its module and the core modules it imports (Layout and torch only for type checking;
    the catalogue of collectives is words)."""
    root = Path(composer_join.__file__).parent / 'core'
    for name in ('protocol', 'plan', 'errors', 'catalogue'):
        tree = ast.parse((root / f'{name}.py').read_text())
        imported = set()
        for node in tree.body:  # module level; an `if TYPE_CHECKING:` block runs nothing
            if isinstance(node, ast.ImportFrom):
                imported.add(node.module or '')
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        ours = {m for m in imported if m.startswith('composer_join')}
        assert ours <= {'composer_join.core.errors', 'composer_join.core.plan', 'composer_join.core.catalogue'}, (
            name,
            ours,
        )
        assert not {m for m in imported - ours if m.split('.')[0] in ('composer', 'torch')}, (name, imported)


@pytest.mark.parametrize(
    ('own', 'current', 'expected'),
    [
        ([5, 3], [5, 3], (5, True, [5, 3])),  # the longest len(); a rank yielding more must be seen
        ([5, 3], [4, 3], (4, False, [5, 3])),  # the trainer asked for fewer: batches past it are not trained
        ([5, -1], [5, -1], (None, False, [5, None])),  # some rank has no len(): the length is unknown
        ([0, 0], [0, 0], (0, True, [0, 0])),
    ],
)
def test_the_first_agreement_gives_the_shared_length(own, current, expected):
    assert agreed_lengths(own, current) == expected


@pytest.mark.parametrize(
    ('per_rank', 'layout', 'source_plans', 'agreed'),
    [
        ((5, 3), FLAT2, False, [False, False, True, True, True]),  # planned before the shortest rank's last batch
        ((5, 3, 4), Layout.flat(3), False, [False, False, True, True, True]),
        ((5, 1), FLAT2, False, [True] * 5),  # the shortest rank's only batch is its last
        ((5, None), FLAT2, False, [True] * 5),  # a rank without len(): every step agreed
        ((5, None), FLAT2, True, [False] * 5),  # but where read-ahead rebalancing knows every rank has a batch
        ((5, 5), TP2, False, [True] * 5),  # tensor parallelism: every step agreed (a group must hold one batch)
        ((5, 5), TP2, True, [True] * 5),
    ],
)
def test_which_steps_are_agreed(per_rank, layout, source_plans, agreed):
    r = rules(per_rank, layout)
    assert [r.agreed(step, source_plans) for step in range(5)] == agreed


def test_a_planned_step_needs_no_exchange_and_its_samples_ride_on_the_first_agreement():
    exchange = Given(0, [REAL, REAL])
    protocol = Protocol(rules((5, 3)), exchange)
    tickets = [protocol.ahead(step, S(True, n, 1)) for step, n in enumerate([8, 5])]
    assert [t.agreed for t in tickets] == [False, False] and exchange.issued == []
    plan = protocol.plan(tickets[0])
    assert plan is not None and not plan.agreed and plan.statuses == (S(True, 8, 1), S(True))
    assert protocol.verdict(plan).plan is plan and protocol.verdict(plan).error is None
    first = protocol.ahead(2, S(True, 3, 1, structure=7), columns={'held': 2})
    assert first.agreed and first.agreement is None and exchange.issued == []  # started when asked for
    assert first.row.unreported_samples == 13 and first.row.held == 2
    plan = protocol.plan(first)
    assert plan is not None and plan.agreed and exchange.issued == ['the agreement on batch 2 of epoch 0']
    assert protocol.unreported == 0
    nxt = protocol.ahead(3, S(True, 4, 1))
    assert nxt.agreement is not None and len(exchange.issued) == 2  # later agreed steps start a step ahead


def test_an_uncountable_planned_batch_makes_the_unreported_samples_uncountable():
    protocol = Protocol(rules((5, 3)), Given(0, [REAL, REAL]))
    protocol.ahead(0, S(True, -1, 0))
    protocol.ahead(1, S(True, 8, 1))
    assert protocol.ahead(2, S(True, 8, 1)).row.unreported_samples == -1


def test_a_rank_without_a_batch_on_a_planned_step_stops_alone_and_says_why_at_the_end():
    error = RuntimeError('disk')
    protocol = Protocol(rules((5, 3)), Given(0, [[-1, 0], [-1, 0]], gathered=[None, None]))
    assert protocol.plan(protocol.ahead(1, S(False, failed=True)), error) is None
    assert protocol.failure == (1, error)
    with pytest.raises(RuntimeError, match='disk'):  # its own error, after the exchange every rank makes
        protocol.check_ended_together(1)
    assert protocol.exchange.issued == ['the agreement on which ranks could not form a batch', 'gather']  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ('rank', 'row', 'failure', 'gathered', 'raises'),
    [
        (0, [2, 0], None, [None, 'RuntimeError: disk'], 'rank(s) [1] could not form batch 2 of epoch 0 (their '),
        (0, [2, 1], None, [], 'rank(s) [1] ran out after 2 batches in epoch 0, fewer than its len() promised'),
        (1, [2, 1], (2, None), [], 'rank(s) [1] ran out after 2 batches in epoch 0'),  # ran short: no cause to gather
    ],
)
def test_after_a_loop_that_ended_early_every_rank_names_who_failed(rank, row, failure, gathered, raises):
    others = [[-1, 0], row] if rank == 0 else [[-1, 0], [0, 0]]
    protocol = Protocol(rules((5, 3), rank=rank), Given(rank, others, gathered))
    protocol.failure = failure
    with pytest.raises(UnevenInputsError) as e:
        protocol.check_ended_together(2)
    assert raises in str(e.value)
    if gathered:
        assert 'rank 1: RuntimeError: disk' in str(e.value)


@pytest.mark.parametrize(
    ('per_rank', 'ended', 'steps'), [((5, None), False, 2), ((5, 3), True, 2), ((5, 3), False, 5), ((5, 3), False, 6)]
)
def test_a_loop_that_ended_together_needs_no_exchange(per_rank, ended, steps):
    exchange = Given(0, [REAL, REAL])
    Protocol(rules(per_rank), exchange, ended=ended).check_ended_together(steps)
    assert exchange.issued == []


@dataclass(frozen=True)
class Case:
    """A table-driven verdict: every rank's row at an agreed step, this rank, and what the step is."""

    statuses: tuple[RankStatus, ...]
    expected: Any  # 'train', 'ends', ('template', rank), ('beyond',), or (error type, text)
    rank: int = 0
    layout: Layout = FLAT2
    error: Optional[BaseException] = None
    rules: dict = None  # type: ignore[assignment]
    protocol: dict = None  # type: ignore[assignment]
    gathered: tuple = ()


OWN = RuntimeError('own read error')
VERDICTS = {
    'every rank trains': Case((REAL, REAL), 'train'),
    'a rank shadows': Case((REAL, SHADOW), 'train'),
    'no rank has data: the iteration ends': Case((SHADOW, SHADOW), 'ends'),
    'a rank that never saw a batch gets a template from the lowest rank with data': Case(
        (S(False, 0, 1, needs_template=True), SHADOW, REAL, REAL), ('template', 2), layout=Layout.flat(4)
    ),
    'a template needed where no rank has data: the end, nothing sent': Case(
        (S(False, 0, 1, needs_template=True), SHADOW), 'ends'
    ),
    'a failed rank raises its own error': Case(
        (REAL, S(False, failed=True)), (RuntimeError, 'own read error'), rank=1, error=OWN
    ),
    'the others name the failed rank': Case(
        (REAL, S(False, failed=True)), (UnevenInputsError, 'rank(s) [1] could not form batch 3 of epoch 2')
    ),
    'a failure comes before a rank that ran short': Case(
        (S(False, short=True), S(False, failed=True)), (UnevenInputsError, 'rank(s) [1] could not form batch')
    ),
    'a rank that ran short of its len()': Case(
        (REAL, S(False, short=True)),
        (UnevenInputsError, 'rank(s) [1] ran out after 3 batches in epoch 2, fewer than its len() promised (this '),
    ),
    'ran short in an epoch resumed from a position left to Composer': Case(
        (REAL, S(False, short=True)),
        (UnevenInputsError, 'in an epoch resumed from batch 2. The position of the train data (ListDataset)'),
        rules={'unregistered': True, 'dataset': 'ListDataset'},
        protocol={'first': 2},
    ),
    'ran short from the start of an epoch with a position left to Composer: the plain message': Case(
        (REAL, S(False, short=True)), (UnevenInputsError, 'remove __len__'), rules={'unregistered': True}
    ),
    'a tensor-parallel group whose ranks hold different batches': Case(
        (REAL, replace(REAL, samples=7)),
        (UnevenInputsError, 'the ranks of tensor-parallel group 0 (ranks [0, 1]) hold different train batches'),
        layout=TP2,
    ),
    'a tensor-parallel group whose batches differ in content': Case(
        (replace(REAL, content=1), replace(REAL, content=2)), (UnevenInputsError, 'contents CRC 00000002'), layout=TP2
    ),
    'a content not taken on one rank is not compared': Case((REAL, replace(REAL, content=2)), 'train', layout=TP2),
    'structures differ where a rank shadows': Case(
        (REAL, replace(SHADOW, structure=9)),
        (UnevenInputsError, 'differ in structure (rank 0: mine; rank 1: float32[1d]). A shadow batch'),
        gathered=('', 'float32[1d]'),
    ),
    'structures may differ where no rank shadows': Case((REAL, replace(REAL, structure=9)), 'train'),
    'throw_on_early_termination where a rank ran out': Case(
        (REAL, SHADOW),
        (UnevenInputsError, 'rank(s) [1] ran out of data at step 3 of epoch 2 while rank(s) [0] still have batches '),
        rules={'throw': True},
    ),
    'throw_on_early_termination at the end: none thrown': Case((SHADOW, SHADOW), 'ends', rules={'throw': True}),
    'a rank yields more than the longest len(): the epoch goes on': Case(
        (replace(REAL, overflow=True), SHADOW), ('beyond',), protocol={'uncapped': True}
    ),
    'more than len() in an epoch resumed mid-way, which Composer stops at len()': Case(
        (replace(REAL, overflow=True), SHADOW),
        (UnevenInputsError, 'rank(s) [0] yielded more than the 5 batches per epoch that the longest len() promised'),
    ),
}


@pytest.mark.parametrize('name', list(VERDICTS))
def test_what_an_agreed_step_is(name):
    case = VERDICTS[name]
    world = len(case.statuses)
    exchange = Given(case.rank, case.statuses, [(g or 'mine') for g in case.gathered] if case.gathered else ())
    per_rank = (5,) * world if case.layout.tp > 1 else (5, 3, 4, 4)[:world]
    r = rules(per_rank, case.layout, case.rank, **(case.rules or {}))
    protocol = Protocol(r, exchange, epoch=2, **(case.protocol or {}))
    ticket = Ticket(3, case.statuses[case.rank], agreed=True)
    plan = protocol.plan(ticket, case.error)
    assert plan is not None and plan.statuses == case.statuses
    verdict = protocol.verdict(plan, case.error, counts=[3, 3], structure=lambda: 'mine')
    if case.expected == 'train' or case.expected[0] in ('template', 'beyond'):
        assert verdict.error is None and not verdict.ends
        assert verdict.template_from == (case.expected[1] if case.expected[0] == 'template' else None)
        assert protocol.beyond == (case.expected[0] == 'beyond')
    elif case.expected == 'ends':
        assert verdict.ends and verdict.error is None and protocol.ended
    else:
        kind, text = case.expected
        assert type(verdict.error) is kind and text in str(verdict.error), verdict.error
        if case.error is not None:
            assert verdict.error is case.error
        if name.startswith('throw'):
            assert 'batches so far: rank 0: 3, rank 1: 3' in str(verdict.error)
    assert exchange.issued[-1:] == (['gather'] if case.gathered else [exchange.issued[-1]])


@pytest.mark.parametrize(
    ('per_rank', 'beyond', 'last', 'peeks'),
    [
        ((5, 3), False, [False] * 4 + [True], [False] * 4 + [True]),
        ((5, 3), True, [False] * 5, [False] * 4 + [True]),  # some rank yields more: on, step by step
        ((5, None), False, [False] * 5, [False] * 5),  # no length: until the agreement says the end
    ],
)
def test_the_last_step_by_length_and_the_peek_past_it(per_rank, beyond, last, peeks):
    protocol = Protocol(rules(per_rank), Given(0, [REAL, REAL]))
    protocol.beyond = beyond
    assert [protocol.last(step) for step in range(5)] == last
    assert [protocol.rules.peeks(step) for step in range(5)] == peeks


def test_a_batch_where_every_len_is_0_is_more_than_len_promised():
    assert rules((0, 0)).past(0) and not rules((5, 3)).past(4) and not rules((0, None)).past(0)


@pytest.mark.parametrize('order', [(0, 1), (1, 0)])
def test_a_len_that_hides_batches_stops_every_rank_where_no_rank_may_yield_more_than_its_len(order):
    """Issue 51: Composer's cap holds where every rank's ``len()`` is taken as exact (no IterableDataset read by several
    workers): a rank that yields more than the longest ``len()`` stops every rank, naming it, never a silent loss."""
    shards = [Shard((8,) * 3, 'exact', first=0), Shard((8,) * 5, 2, first=1000)]
    shards = [shards[i] for i in order]
    sim = simulate(shards, lifted=False)
    hiding = order.index(1)
    for run in sim.runs:
        assert isinstance(run.error, UnevenInputsError), run.error
        assert f'rank(s) [{hiding}] yielded more than the 3 batches' in str(run.error)


def test_composers_cap_is_lifted_only_where_it_is_the_longest_len_and_some_rank_may_yield_more():
    r = Rules(Lengths(5, True, [5, 3], lifted=True), 0, FLAT2)  # some rank reads an IterableDataset with workers
    assert r.lifts(5) and not r.lifts(4) and not r.lifts(None)
    capped = Rules(Lengths(4, False, [5, 3], lifted=True), 0, FLAT2)  # the trainer asked for 4 batches
    assert not capped.lifts(4) and not rules((5, None)).lifts(None)
    assert not rules((5, 3)).lifts(5)  # every len() exact: Composer's cap holds, as without UnevenJoin


@pytest.mark.parametrize(
    ('step', 'ended_now', 'template', 'row'),
    [
        (2, True, 7, S(False, short=True)),  # ended before its len() (3): it ran short
        (3, True, 7, S(False, 0, 1, structure=7)),  # ended at its len(): it shadows
        (1, False, 7, S(False, 0, 1, structure=7)),  # idle (read-ahead rebalancing): it shadows
        (4, False, None, S(False, 0, 1, needs_template=True)),  # never saw a batch: it needs a template
    ],
)
def test_the_row_of_a_rank_without_a_batch(step, ended_now, template, row):
    assert rules((5, 3), rank=1).row_without_batch(step, ended_now, template) == row


def test_the_epoch_is_known_done_from_the_lengths_or_the_next_agreement_under_way():
    protocol = Protocol(rules((5, 3)), Given(0, [SHADOW, SHADOW]))
    assert protocol.epoch_done(None)  # nothing read past the last step by length
    assert not protocol.epoch_done(protocol.ahead(0, REAL))  # planned: unknown
    assert not protocol.epoch_done(protocol.ahead(2, SHADOW))  # the first agreed step's agreement: not started
    assert protocol.epoch_done(protocol.ahead(3, SHADOW))  # started a step ahead: no rank has data
    protocol = Protocol(rules((5, 3)), Given(0, [REAL, SHADOW]))
    assert not protocol.epoch_done(protocol.ahead(3, REAL))


def test_rank_0_warns_at_the_end_of_an_epoch_past_the_longest_len_naming_each_rank():
    protocol = Protocol(rules((5, 3)), Given(0), epoch=1)
    assert protocol.beyond_warning([6, 3], 6) is None  # nothing went past
    protocol.beyond = True
    message = protocol.beyond_warning([6, 4], 6)
    assert message is not None and '(rank 0 yielded 6 batches, its len() is 5; rank 1 yielded 4 batches' in message
    assert 'epoch 1' in message and 'runs 1 steps per epoch ahead' in message
    other = Protocol(rules((5, 3), rank=1), Given(1))
    other.beyond = True
    assert other.beyond_warning([6, 4], 6) is None  # rank 0 warns for all


# -- whole runs, W simulated ranks -----------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Per data-parallel member: batch sizes, claimed ``len()`` ('exact', None or a number), batch that fails."""

    sizes: tuple[tuple[int, ...], ...]
    claimed: tuple[Any, ...] = ()
    fail_at: tuple[Optional[int], ...] = ()
    tp: int = 1
    throw: bool = False
    epochs: int = 1
    rebalance: bool = False

    @property
    def members(self) -> int:
        return len(self.sizes)

    def shard(self, m: int) -> Shard:
        claimed = self.claimed[m] if self.claimed else 'exact'
        return Shard(self.sizes[m], claimed, self.fail_at[m] if self.fail_at else None, first=1000 * m)

    def shards(self) -> list[Shard]:
        return [self.shard(m) for m in range(self.members) for _ in range(self.tp)]

    def layout(self) -> Layout:
        return Layout(tuple(tuple(range(m * self.tp, (m + 1) * self.tp)) for m in range(self.members)))

    def run(self, timeout: float = 20.0) -> Simulation:
        return simulate(
            self.shards(), self.epochs, self.layout(), self.throw, timeout=timeout, rebalance=self.rebalance
        )


Cell = Optional[tuple[int, int]]  # (owner member, index of the batch in its shard); None: the member shadows


@dataclass(frozen=True)
class Outcome:
    """What a run must do: per step, per member, the batch it trains (the last epoch's steps, where a fault stops it),
    which steps are agreed (None: those past the leading ``planned`` ones), and the error, if any."""

    cells: list[list[Cell]]
    planned: int = 0
    agreed: Optional[list[bool]] = None
    stop: Optional[tuple[int, str, tuple[int, ...]]] = None  # (step, 'failed' | 'short' | 'throw', members)

    @property
    def steps(self) -> int:
        return len(self.cells)


def sized_schedule(counts: list[int]) -> list[list[Cell]]:
    """Per step, per member, its batch under rebalancing with every ``len()`` known, from tests/test_rebalance.py's
    reference (the README's rule): members with batches left train their own; the others, in increasing order, are
    given the donors' batches in the order that reference lists them."""
    left, cells = list(counts), []
    for step in test_rebalance.expected_steps(counts):
        holders = [m for m in range(len(counts)) if left[m] > 0]
        row: list[Cell] = [None] * len(counts)
        for m, cell in zip(holders, step):
            row[m] = cell
        for m, cell in zip([m for m in range(len(counts)) if m not in holders], step[len(holders) :]):
            row[m] = cell
        for owner, _ in step:
            left[owner] -= 1
        cells.append(row)
    return cells


def expected(cfg: Config) -> Outcome:
    """The outcome, from the shards alone (the module docstring's rules; rebalancing: the rebalancing tests')."""
    shards = [cfg.shard(m) for m in range(cfg.members)]
    yields = [len(s.sizes) for s in shards]
    lengths = [s.length for s in shards]
    if cfg.rebalance:  # fault-free, exact len()s or none
        if None not in lengths:
            cells = sized_schedule(yields)
            assigned = [sum(row[m] is not None for row in cells) for m in range(cfg.members)]
            return Outcome(cells, max(0, min(assigned) - 1) if cfg.tp == 1 else 0)
        agreed = unsized.agreed_steps(yields) if cfg.tp == 1 else None
        return Outcome(unsized.simulate(yields), 0, agreed)
    faults: dict[int, list[tuple[str, int]]] = {}
    for m, s in enumerate(shards):
        if s.fail_at is not None:
            faults.setdefault(s.fail_at, []).append(('failed', m))
        elif s.length is not None and yields[m] < s.length:
            faults.setdefault(yields[m], []).append(('short', m))
    stop: Optional[tuple[int, str, tuple[int, ...]]] = None
    if faults:
        step = min(faults)
        kinds = {k for k, _ in faults[step]}
        kind = 'failed' if 'failed' in kinds else 'short'
        stop = (step, kind, tuple(m for k, m in faults[step] if k == kind))
    if cfg.throw and min(yields) < max(yields) and (stop is None or min(yields) < stop[0]):
        stop = (min(yields), 'throw', tuple(m for m in range(cfg.members) if yields[m] == min(yields)))
    steps = max(yields) if stop is None else stop[0]
    cells = [[(m, t) if t < yields[m] else None for m in range(cfg.members)] for t in range(steps)]
    sized = None not in lengths and cfg.tp == 1
    return Outcome(cells, max(0, min(lengths) - 1) if sized else 0, None, stop)  # type: ignore[type-var, operator]


def check(cfg: Config, sim: Simulation) -> None:
    """The run did exactly what :func:`expected` says, and kept the invariants of the module docstring."""
    layout, outcome = cfg.layout(), expected(cfg)
    shards = [cfg.shard(m) for m in range(cfg.members)]
    runs, world = sim.runs, layout.world_size
    for rank, run in enumerate(runs):
        assert not isinstance(run, BaseException), f'rank {rank}: {run!r}'
        assert not isinstance(run.error, (Hang, Mismatch, AssertionError)), f'rank {rank}: {run.error!r}'
    assert sim.undelivered == {}, sim.undelivered  # every batch sent was received
    epochs = cfg.epochs if outcome.stop is None else 1
    for rank, run in enumerate(runs):
        m = layout.member(rank)
        assert len(run.epochs) == epochs, f'rank {rank}: {len(run.epochs)} epochs'
        for epoch, steps in enumerate(run.epochs):
            assert len(steps) == outcome.steps, f'rank {rank}, epoch {epoch}'
            for t, step in enumerate(steps):
                cell = outcome.cells[t][m]
                ids = None if cell is None else shards[cell[0]].ids(cell[1])
                assert step.ids == ids, f'rank {rank}, epoch {epoch}, step {t}'
                plan, truth = step.record.plan, [c is not None for c in outcome.cells[t]]
                if not plan.agreed:  # planned alone only where every member has a batch
                    alone = not outcome.agreed[t] if outcome.agreed is not None else t < outcome.planned
                    assert all(truth) and alone, f'step {t} planned alone'
                else:
                    assert [plan.has_batch(r) for r in range(world)] == [truth[layout.member(r)] for r in range(world)]
                    assert outcome.agreed[t] if outcome.agreed is not None else t >= outcome.planned, f'step {t}'
                    assert all(other.epochs[epoch][t].record.plan == plan for other in runs), f'plans differ at {t}'
                assert step.record.any_shadow == (not all(truth))
                if outcome.stop is None:
                    assert step.epoch_done == (t == outcome.steps - 1), f'epoch_done at {t}'
                elif step.epoch_done:  # said only where the next step's agreement, under way, has no batch to train
                    assert not any(t + 1 < len(s.sizes) and s.fail_at != t + 1 for s in shards), f'epoch_done at {t}'
        if outcome.stop is None:
            assert run.error is None, f'rank {rank}: {run.error!r}'
            trained = [[c for row in outcome.cells if (c := row[n]) is not None] for n in range(cfg.members)]
            for report in run.reports:  # every member's counts reach every rank, planned steps' samples too
                assert report.real_batches == [len(c) for c in trained]
                assert report.real_samples == [sum(shards[o].sizes[i] for o, i in c) for c in trained]
                assert report.shadow_steps == [outcome.steps - len(c) for c in trained]
            continue
        step, kind, members = outcome.stop
        ranks = [r for r in range(world) if layout.member(r) in members]
        error, says = run.error, ''
        if kind == 'failed' and m in members:
            assert type(error) is RuntimeError and f'read error at batch {step} of rank {rank}' in str(error), error
            continue
        if kind == 'failed':
            says = f'rank(s) {ranks} could not form batch {step} of epoch 0'
        elif kind == 'short':
            says = f'rank(s) {ranks} ran out after {step} batches in epoch 0'
        else:
            says = f'ran out of data at step {step} of epoch 0'
        assert type(error) is UnevenInputsError and says in str(error), error
    if outcome.stop is None:  # agreements exactly where the lengths (or levels) leave a step open, and at the end
        loader = runs[0].loader
        assert loader is not None
        if outcome.agreed is not None:
            per_epoch = sum(outcome.agreed) + 1
        elif loader.length == 0 and not loader.rules.lifts(0):  # Composer's cap is 0: it never asks for a batch
            per_epoch = 0
        else:
            per_epoch = outcome.steps - outcome.planned + (0 if loader.length == outcome.steps > 0 else 1)
        for rank, issued in enumerate(sim.issued):
            agreements = [w for w in issued if w.startswith('the agreement on batch')]
            assert len(agreements) == per_epoch * cfg.epochs, (rank, issued)
            assert issued.count(FLAG) == (outcome.steps + 1) * cfg.epochs


SCENARIOS = {
    # the measured stock failure's shape: 5 and 3 batches, two epochs
    'five_and_three': Config(((8,) * 5, (8, 8, 5)), epochs=2),
    'three_ranks_one_empty': Config(((4,) * 5, (), (4, 4, 4, 1)), epochs=2),
    'only_the_last_rank_has_data': Config(((), (), (4, 4, 4, 1)), epochs=2),
    'one_batch_each': Config(((8,), (3,)), epochs=2),
    'without_len': Config(((8,) * 5, (8, 8, 5)), claimed=('exact', None), epochs=2),
    'a_len_that_hides_batches': Config(((8,) * 3, (8,) * 5), claimed=('exact', 2)),
    'a_len_that_undercounts_on_the_longest_rank': Config(((8,) * 6, (8,) * 2), claimed=(5, 'exact'), epochs=2),
    'a_len_of_zero_that_hides_batches': Config(((8, 8), (8,)), claimed=(0, 0), epochs=2),  # none may be dropped
    # tests/test_collective_cost.py's failing scenarios (5 batches each: steps 0 to 3 planned), both rank orders
    'fails_at_step_0': Config(((8,) * 5, (8,) * 5), fail_at=(None, 0)),
    'fails_at_step_1': Config(((8,) * 5, (8,) * 5), fail_at=(None, 1)),
    'fails_at_step_3': Config(((8,) * 5, (8,) * 5), fail_at=(3, None)),
    'fails_at_step_0@1': Config(((8,) * 5, (8,) * 5), fail_at=(0, None)),
    'fails_at_step_1@1': Config(((8,) * 5, (8,) * 5), fail_at=(1, None)),
    'fails_at_step_3@1': Config(((8,) * 5, (8,) * 5), fail_at=(None, 3)),
    'len_overstates': Config(((8,) * 5, (8,) * 3), claimed=('exact', 5)),
    'len_overstates@1': Config(((8,) * 3, (8,) * 5), claimed=(5, 'exact')),
    # tests/test_join_core.py's: a read error at the first agreed step, both rank orders; throw_on_early_termination
    'loader_fails': Config(((8,) * 3, (8,) * 5), fail_at=(None, 2)),
    'loader_fails@1': Config(((8,) * 5, (8,) * 3), fail_at=(2, None)),
    'throw': Config(((8,) * 5, (8, 8, 5)), throw=True),
    'throw_even': Config(((8,) * 2, (8,) * 2), throw=True, epochs=2),
    'fails_past_the_longest_len': Config(((8,) * 3, (8,) * 5), claimed=('exact', 2), fail_at=(None, 4)),
    'tensor_parallel': Config(((4,) * 5, (4, 4, 1)), tp=2, epochs=2),
    'tensor_parallel_fails': Config(((4,) * 5, (4, 4, 1)), fail_at=(None, 1), tp=2),
    # rebalancing, every len() known (tests/test_rebalance.py's shapes) and without (tests/test_rebalance_unsized.py's)
    'rebalance_2_1': Config(((8,) * 10, (8,) * 5), rebalance=True, epochs=2),
    'rebalance_empty_three': Config(((4,) * 10, (), (4, 4, 4, 1)), rebalance=True, epochs=2),
    'rebalance_four_4_1': Config(((8,) * 8, (8,) * 2, (8,) * 2, (8,) * 2), rebalance=True),
    'rebalance_tensor_parallel': Config(((8,) * 5, ()), tp=2, rebalance=True),
    'readahead_2_1': Config(((8,) * 10, (8,) * 5), claimed=(None, None), rebalance=True, epochs=2),
    'readahead_mixed_empty': Config(((8,) * 5 + (3,), ()), claimed=(None, 'exact'), rebalance=True, epochs=2),
    'readahead_three_mixed_empty': Config(((4,) * 10, (), (4, 4, 4, 1)), claimed=(None, None, 'exact'), rebalance=True),
    'readahead_four_4_1': Config(((8,) * 8, (8,) * 2, (8,) * 2, (8,) * 2), claimed=(None,) * 4, rebalance=True),
    'readahead_tensor_parallel': Config(((8,) * 5, (8,)), claimed=(None, None), tp=2, rebalance=True),
}


@pytest.mark.parametrize('name', list(SCENARIOS))
def test_whole_runs_of_simulated_ranks(name):
    cfg = SCENARIOS[name]
    sim = cfg.run()
    check(cfg, sim)
    if name == 'throw':
        assert 'rank 0: 3, rank 1: 3' in str(sim.runs[0].error)
    if name.startswith('len_overstates'):  # the rank that ran short says its own len()
        short = 1 if name == 'len_overstates' else 0
        assert 'fewer than its len() promised (this rank: len() 5)' in str(sim.runs[short].error)
    if name.startswith('fails_at_step'):  # the others name the failing rank's cause (the gather, on this path only)
        (failing,) = [m for m, f in enumerate(cfg.fail_at) if f is not None]
        cause = f'rank {failing}: RuntimeError: read error at batch {cfg.fail_at[failing]} of rank {failing}'
        assert cause in str(sim.runs[1 - failing].error)
    if name.startswith('a_len_that'):  # rank 0 warns once per fit, not once per epoch
        (warned,) = sim.warnings
        assert 'yields more batches than its len() says in epoch 0' in warned


E = (8,)
REBALANCING_STOPS = {  # name: (config, each rank's error: type, text), as the multi-process tests assert them
    # tests/test_rebalance_unsized.py: a read error mid-epoch (read ahead: it shows at step 1), on a step nobody agreed
    # on (read at step 2: step 2 trains, step 3 stops all), while filling the buffer at the epoch's start
    'readahead_fails_mid_epoch': (
        Config((E * 5, E), claimed=(None, None), fail_at=(4, None), rebalance=True),
        [(RuntimeError, 'read error at batch 4 of rank 0'), (UnevenInputsError, 'rank(s) [0] could not form batch 1')],
    ),
    'readahead_fails_mid_epoch@1': (
        Config((E, E * 5), claimed=(None, None), fail_at=(None, 4), rebalance=True),
        [(UnevenInputsError, 'rank(s) [1] could not form batch 1'), (RuntimeError, 'read error at batch 4 of rank 1')],
    ),
    'readahead_fails_on_a_step_nobody_agreed_on': (
        Config((E * 10, E * 10), claimed=(None, None), fail_at=(4, None), rebalance=True),
        [(RuntimeError, 'read error at batch 4 of rank 0'), (UnevenInputsError, 'rank(s) [0] could not form batch 3')],
    ),
    'readahead_fails_on_a_step_nobody_agreed_on@1': (
        Config((E * 10, E * 10), claimed=(None, None), fail_at=(None, 4), rebalance=True),
        [(UnevenInputsError, 'rank(s) [1] could not form batch 3'), (RuntimeError, 'read error at batch 4 of rank 1')],
    ),
    'readahead_fails_at_the_start': (
        Config((E * 5, E), claimed=(None, None), fail_at=(None, 0), rebalance=True),
        [
            (UnevenInputsError, 'rank(s) [1] could not read the first batches of the epoch'),
            (RuntimeError, 'read error at batch 0 of rank 1'),
        ],
    ),
    'readahead_fails_at_the_start@1': (
        Config((E, E * 5), claimed=(None, None), fail_at=(0, None), rebalance=True),
        [
            (RuntimeError, 'read error at batch 0 of rank 0'),
            (UnevenInputsError, 'rank(s) [0] could not read the first batches of the epoch'),
        ],
    ),
    # tests/test_rebalance.py: a donor whose read of a gift fails; a len() that hides batches
    'gift_read_fails': (
        Config((E * 5, E), fail_at=(2, None), rebalance=True),
        [(RuntimeError, 'read error at batch 2 of rank 0'), (UnevenInputsError, 'rank 0 could not read or send')],
    ),
    'gift_read_fails@1': (
        Config((E, E * 5), fail_at=(None, 2), rebalance=True),
        [(UnevenInputsError, 'rank 1 could not read or send'), (RuntimeError, 'read error at batch 2 of rank 1')],
    ),
    'len_too_short': (
        Config((E * 5, E), claimed=(2, 'exact'), rebalance=True),
        [
            (UnevenInputsError, 'yielded more than the 2 batches'),
            (UnevenInputsError, 'rank(s) [0] could not form batch'),
        ],
    ),
    # a rank that stops alone on a planned step still makes the transfer of the step the others read ahead
    'stops_alone_before_a_transfer': (
        Config((E * 6, E * 2), fail_at=(1, None), rebalance=True),
        [(RuntimeError, 'read error at batch 1 of rank 0'), (UnevenInputsError, 'rank(s) [0] could not form batch 1')],
    ),
    'stops_alone_before_a_transfer@1': (
        Config((E * 2, E * 6), fail_at=(None, 1), rebalance=True),
        [(UnevenInputsError, 'rank(s) [1] could not form batch 1'), (RuntimeError, 'read error at batch 1 of rank 1')],
    ),
}
WRONG_LEN = {  # tests/test_len_hints.py: rebalancing plans from the len()s, so a wrong one stops every rank
    # rank 1's len() says 1 batch, it yields 2: it learns so at step 0, a step nobody agrees on, and it receives a
    # batch of rank 0 at step 1
    'rebalance_len_under': Config(((1,) * 3, (1,) * 2), claimed=('exact', 1), rebalance=True),
    'rebalance_len_under_swapped': Config(((1,) * 2, (1,) * 3), claimed=(1, 'exact'), rebalance=True),
    # rank 1's len() says 2, it yields 1: it learns so at step 1, and it receives a batch at step 2
    'rebalance_len_over': Config(((1,) * 5, (1,)), claimed=('exact', 2), rebalance=True),
    'rebalance_len_over_swapped': Config(((1,), (1,) * 5), claimed=(2, 'exact'), rebalance=True),
}


@pytest.mark.parametrize('name', list(REBALANCING_STOPS))
def test_rebalancing_stops_every_rank_where_a_read_fails(name):
    cfg, errors = REBALANCING_STOPS[name]
    sim = cfg.run()
    assert sim.undelivered == {}  # the failing rank made the transfers the others expected: nobody waits
    for rank, (run, (kind, text)) in enumerate(zip(sim.runs, errors)):
        assert type(run.error) is kind and text in str(run.error), (rank, run.error)
    assert len({len(run.epochs[0]) if run.epochs else 0 for run in sim.runs}) == 1  # the same steps on every rank


@pytest.mark.parametrize('name', list(WRONG_LEN))
def test_a_wrong_len_in_rebalance_mode_stops_every_rank_and_names_it(name):
    cfg = WRONG_LEN[name]
    rank = next(m for m, c in enumerate(cfg.claimed) if c != 'exact')
    claimed, size = cfg.claimed[rank], len(cfg.sizes[rank])
    sim = cfg.run()
    assert sim.undelivered == {}
    for run in sim.runs:
        message = str(run.error)
        assert isinstance(run.error, UnevenInputsError) and f'rank {rank}' in message, message
        assert f'len() {claimed}' in message or f'len() promised {claimed}' in message, message
        if size > claimed:  # shadow mode treats a len() that undercounts as a hint: the way out
            assert f'yielded more than the {claimed}' in message and "mode='shadow'" in message, message
        else:  # ... but not one that overcounts (its steps planned from the lengths would be wrong)
            assert f'yielded {size} batches' in message, message
            assert "mode='shadow'" not in message and 'remove __len__' in message, message


def test_a_rank_without_data_is_sent_a_template_once():
    cfg = SCENARIOS['only_the_last_rank_has_data']
    sim = cfg.run()
    for issued in sim.issued:
        assert issued.count('broadcast from 2') == 1  # in the first epoch only: then the rank has one
    assert all(run.loader.learned.template.tolist() == [2000, 2001] for run in sim.runs)


def test_batches_that_differ_in_structure_stop_every_rank_where_one_shadows():
    shards = [Shard((2, 2, 2)), Shard((2,), first=1000, dtype=torch.float32)]
    sim = simulate(shards)
    for run in sim.runs:
        assert isinstance(run.error, UnevenInputsError), run.error
        assert 'differ in structure (rank 0: int64[1d]; rank 1: float32[1d])' in str(run.error), run.error


def test_a_tensor_parallel_group_given_different_batches_stops_every_rank():
    shards = [Shard((4, 4)), Shard((4, 4), first=500), Shard((4,), first=1000), Shard((4,), first=1000)]
    sim = simulate(shards, layout=Layout(((0, 1), (2, 3))))
    for run in sim.runs:
        assert isinstance(run.error, UnevenInputsError) and 'tensor-parallel group 0 (ranks [0, 1])' in str(run.error)
        assert run.epochs == [[]]  # at the first step, before any is trained


# -- random runs (hypothesis) --------------------------------------------------------------------------


@st.composite
def configs(draw) -> Config:
    tp = draw(st.sampled_from([1, 1, 2]))
    members = draw(st.integers(1, 4 if tp == 1 else 3))
    sizes = tuple(tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=5))) for _ in range(members))
    claims = []
    for s in sizes:  # a len() that is exact, missing, or undercounts; overcounting is a fault (below)
        claims.append(
            draw(st.sampled_from(['exact', 'exact', 'exact', None, max(0, len(s) - draw(st.integers(1, 2)))]))
        )
    if draw(st.integers(0, 3)) == 0:  # a quarter of the draws rebalance, with exact len()s or without
        claims = [c if c is None else 'exact' for c in claims]
        return Config(sizes, tuple(claims), (), tp, False, draw(st.integers(1, 2)), rebalance=True)
    fail_at: list[Optional[int]] = [None] * members
    faulty = draw(st.integers(-1, members - 1))  # at most one member misbehaves
    if faulty >= 0:
        n = len(sizes[faulty])
        if n and draw(st.booleans()):  # often where planned steps end: the shortest member's last batch, or before
            edge = min(len(s) for s in sizes) - 1
            fail_at[faulty] = draw(st.sampled_from([i for i in {0, edge - 1, edge, n - 1} if 0 <= i < n]))
        else:
            claims[faulty] = len(sizes[faulty]) + draw(st.integers(1, 2))
    return Config(sizes, tuple(claims), tuple(fail_at), tp, draw(st.booleans()), draw(st.integers(1, 2)))


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(configs())
def test_random_runs_keep_the_invariants(cfg):
    check(cfg, cfg.run(timeout=10))


def test_the_reference_of_these_tests():
    """:func:`expected` on the cases whose outcome the multi-process tests assert."""

    def outcome(name: str) -> tuple:
        o = expected(SCENARIOS[name])
        return o.steps, o.planned, o.stop

    assert outcome('five_and_three') == (5, 2, None)
    assert outcome('fails_at_step_3') == (3, 4, (3, 'failed', (0,)))
    assert outcome('len_overstates') == (3, 4, (3, 'short', (1,)))
    assert outcome('throw') == (3, 2, (3, 'throw', (1,)))
    assert outcome('a_len_that_hides_batches') == (5, 1, None)
    assert sized_schedule([3, 0]) == [[(0, 0), (0, 1)], [(0, 2), None]]  # composer_join's docstring example
