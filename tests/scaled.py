"""One rank's real join at any world size: its ``JoinLoader``, ``Protocol`` and rebalancer, the others' rows modelled.

``tests/simulated.py`` runs every rank's real objects at once (a thread each): its time and memory grow as
``W^2 x steps``. Here one rank (``rank``) runs the real objects, driven as Composer drives them
(``simulated.fit``: the length cap, one "exhausted" all-reduce per step), and every collective it issues is
answered by :class:`Model`, which supplies the other ranks' rows as the agreement would: the first agreement's
lengths, and each agreed step's rows (``W x 13``, built with array operations, O(W) memory per step). The model
also predicts this rank's own row, and every exchange checks that the rank sent exactly that: so a run on rank
``r`` checks the model for ``r``, and runs on every rank of a small world, compared with ``simulated.simulate``,
check it for all (``tests/test_scaled.py``).

Shards (:class:`Shards`): rank ``r`` has ``n[r]`` batches of ``batch`` samples, its last of ``last[r]``; sample ids
``r * STRIDE + i``. Modes: ``'shadow'``, and ``'rebalance'`` with every rank's ``len()`` (the sized schedule: the
model reads the rank's own :class:`~composer_join.rebalance.rebalance.RebalancingLoader`'s, which every rank
computes alike). Transfers go through :class:`ModelChannel`: a receiver is handed the batch the schedule says,
a donor's sends are recorded.

Example::

    shards = Shards.spread(1024, mean=20, seed=0)
    out = run_rank(shards, rank=5)      # Outcome: per step the ids rank 5 trained (None: shadow), timings
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

from composer_join.core.layout import Layout
from composer_join.core.plan import RankStatus
from composer_join.core.protocol import Exchange, Lengths, Pending, Rules, agreed_lengths
from composer_join.join.iterator import Glue, JoinLoader
from composer_join.join.loader import batch_source
from composer_join.rebalance.rebalance import RebalancingLoader
from composer_join.rebalance.transfer import BatchChannel, Wire
from composer_join.shadow.structure import fingerprint
from simulated import FLAG

__all__ = ['STRIDE', 'Model', 'ModelChannel', 'Outcome', 'Shards', 'run_rank']

STRIDE = 10**9
"""Rank ``r``'s sample ids start at ``r * STRIDE``."""

COLUMNS = len(RankStatus(True).row())
_FIELDS = {name: i for i, name in enumerate(RankStatus.__dataclass_fields__)}
_AGREEMENT = re.compile(r'the agreement on batch (\d+) of epoch (\d+)')


@dataclass(frozen=True)
class Shards:
    """Every rank's shard: ``n[r]`` batches of ``batch`` samples, the last of ``last[r]`` (1..batch)."""

    n: np.ndarray
    last: np.ndarray
    batch: int = 4

    @property
    def world(self) -> int:
        return len(self.n)

    @classmethod
    def spread(cls, world: int, mean: int, seed: int = 0, batch: int = 4) -> Shards:
        """The issue's shards: ``mean`` batches +-10%, 1% of ranks (at least one) empty, 1% with twice the data."""
        rng = np.random.default_rng(seed)
        n = rng.integers(int(mean * 0.9), int(mean * 1.1) + 1, size=world)
        k = max(1, world // 100)
        picked = rng.permutation(world)
        n[picked[:k]] = 0
        n[picked[k : 2 * k]] *= 2
        last = rng.integers(1, batch + 1, size=world)
        return cls(n.astype(np.int64), last.astype(np.int64), batch)

    def sizes(self, rank: int) -> np.ndarray:
        """Samples per batch of ``rank``'s shard."""
        out = np.full(int(self.n[rank]), self.batch, dtype=np.int64)
        if len(out):
            out[-1] = self.last[rank]
        return out

    def ids(self, rank: int, index: int) -> list[int]:
        size = self.batch if index < self.n[rank] - 1 else int(self.last[rank])
        start = rank * STRIDE + index * self.batch
        return list(range(start, start + size))

    def total(self) -> int:
        return int(self.n.sum())


class _Loader:
    """A user's dataloader over one rank's shard: exact ``len()``, batches of sample ids."""

    def __init__(self, shards: Shards, rank: int):
        self.shards, self.rank = shards, rank

    def __len__(self) -> int:
        return int(self.shards.n[self.rank])

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield torch.tensor(self.shards.ids(self.rank, i), dtype=torch.int64)


class Model:
    """The other ranks' rows, as the agreement gives them (see the module docstring)."""

    def __init__(self, shards: Shards, rank: int, microbatch: int, mode: str):
        self.shards, self.rank, self.microbatch, self.mode = shards, rank, microbatch, mode
        self.fp = fingerprint(torch.zeros(1, dtype=torch.int64))
        self.schedule: Optional[Any] = None  # the sized rebalance schedule (the rank's own loader's: a Schedule)
        self.assigned: Optional[np.ndarray] = None
        self.planned = 0
        self.build_seconds = 0.0  # spent building tables: not the join's cost

    def take(self, loader: JoinLoader) -> None:
        """What every rank computes alike from the lengths: the schedule, the planned steps."""
        source = loader.source
        if isinstance(source, RebalancingLoader):
            self.schedule = source.plan if hasattr(source, 'plan') else _Rows(source.steps)
            self.assigned = np.asarray(source.assigned, dtype=np.int64)
        self.planned = loader.rules.planned

    def first(self) -> np.ndarray:
        n = self.shards.n
        return np.stack([n, n], axis=1)

    def agreement(self, step: int, epoch: int) -> np.ndarray:
        """Every rank's row at agreed step ``step`` of ``epoch`` (array operations only)."""
        w, shards = self.shards.world, self.shards
        table = np.zeros((w, COLUMNS), dtype=np.int64)
        if self.schedule is None:
            has = step < shards.n
            samples = np.where(step == shards.n - 1, shards.last, shards.batch)
            owners, own_n = np.arange(w), shards.n
        else:
            cells = [self.schedule.cell(step, r) for r in range(w)] if step < self.schedule.length else [None] * w
            has = np.array([c is not None for c in cells])
            owners = np.array([-1 if c is None else c[0] for c in cells])
            index = np.array([-1 if c is None else c[1] for c in cells])
            own_n = shards.n[np.maximum(owners, 0)]
            samples = np.where(index == own_n - 1, shards.last[np.maximum(owners, 0)], shards.batch)
        samples = np.where(has, samples, 0)
        table[:, _FIELDS['has_batch']] = has
        table[:, _FIELDS['samples']] = samples
        table[:, _FIELDS['microbatches']] = np.where(has, -(-samples // self.microbatch), 1)
        # a rank that never saw a batch has no template until the first agreed step of the first epoch sends it
        seen = self.shards.n > 0 if self.schedule is None else self.assigned > 0  # type: ignore[operator]
        needs = ~seen & (epoch == 0) & (step <= self.planned)
        table[:, _FIELDS['needs_template']] = needs & ~has
        table[:, _FIELDS['structure']] = np.where(has | ~needs, self.fp, 0)
        if step == self.planned:  # the samples of the planned steps, reported with the first agreed step
            table[:, _FIELDS['unreported_samples']] = self._unreported()
        return table

    def _unreported(self) -> np.ndarray:
        if self.schedule is None:
            return np.full(self.shards.world, self.planned * self.shards.batch, dtype=np.int64)
        shards = self.shards
        out = np.full(shards.world, self.planned * shards.batch, dtype=np.int64)
        plan = self.schedule
        if hasattr(plan, 'transfers'):  # a Schedule: only owners' last batches are partial; find who trains them
            trained_by = {(d, i): (r, s) for s, r, d, i in plan.transfers()}
            for d in np.flatnonzero(shards.n > 0).tolist():
                last = int(shards.n[d]) - 1
                own_step = plan.own[d] - 1
                mine = own_step >= 0 and plan.cell(own_step, d) == (d, last)
                where = (d, own_step) if mine else trained_by[(d, last)]
                if where[1] < self.planned:
                    out[where[0]] -= shards.batch - shards.last[d]
            return out
        out[:] = 0
        for step in range(self.planned):
            cells = [self.schedule.cell(step, r) for r in range(self.shards.world)]
            out += [0 if c is None else len(self.shards.ids(*c)) for c in cells]
        return out


class _Rows:
    """A schedule given as its rows (before #48, ``RebalancingLoader.steps``), read as a Schedule is."""

    def __init__(self, rows: list[list[Any]]):
        self.rows, self.length = rows, len(rows)

    def cell(self, step: int, rank: int) -> Any:
        return self.rows[step][rank]


class ModelChannel(BatchChannel):
    """One rank's transfers, with the others modelled: a receive is handed the batch the schedule says."""

    def __init__(self, rank: int, shards: Shards, model: Model):
        wire = Wire.__new__(Wire)  # (no process group)
        wire.rank, wire.group = rank, None
        super().__init__(wire=wire)
        self.shards, self.model = shards, model
        self.sends: list[tuple[int, int, list[int]]] = []  # (step, receiver, ids)

    def send(self, batch: Any, dst: int, step: int) -> Optional[Exception]:
        self.sends.append((step, dst, batch.tolist()))
        packed = self.pack(batch)
        self.bytes_sent += len(packed.header) + (0 if packed.payload is None else packed.payload.numel())
        return None

    def receive(self, src: int, step: int) -> Any:
        cell = self.model.schedule.cell(step, self.rank)  # type: ignore[union-attr]
        assert cell is not None and cell[0] == src, (step, self.rank, cell, src)
        return torch.tensor(self.shards.ids(*cell), dtype=torch.int64)


class _Table(Pending):
    def __init__(self, table: np.ndarray):
        self.table = table

    def wait(self) -> Any:
        return self.table.tolist()  # what TorchExchange's wait returns: the table as lists

    def array(self) -> Any:
        return self.table  # what TorchExchange's array returns (on the CPU: the tensor's memory, no copy)


class ModelExchange(Exchange):
    """One rank's exchange, the others' rows from :class:`Model`; checks that this rank sends the model's own row."""

    def __init__(self, model: Model, rank: int, world: int):
        self.model, self.rank, self.world = model, rank, world
        self.issued: list[str] = []
        self.bytes = 0

    def rows(self, row: Sequence[int], what: str) -> Pending:
        start = time.thread_time()
        self.issued.append(what)
        own = np.asarray([int(v) for v in row], dtype=np.int64)
        if what == 'the first agreement':
            table = self.model.first()
        elif what == FLAG:
            table = np.broadcast_to(own, (self.world, len(own)))  # every rank ends the loop at the same step
        else:
            match = _AGREEMENT.fullmatch(what)
            assert match, what
            table = self.model.agreement(int(match[1]), int(match[2]))
            self.bytes += table.nbytes
        assert (table[self.rank] == own).all(), (
            f'rank {self.rank}, {what}: sent {own.tolist()}, model {table[self.rank].tolist()}'
        )
        self.model.build_seconds += time.thread_time() - start
        return _Table(table)

    def reduce(self, values: Any, op: str, what: str) -> Any:
        raise AssertionError('not in a scaled run')

    def gather(self, obj: Any, what: str) -> list[Any]:
        raise AssertionError('no error path in a scaled run')

    def broadcast(self, obj: Any, src: int, what: str) -> Any:
        assert obj is not None or src != self.rank
        return obj if obj is not None else torch.zeros(2, dtype=torch.int64)  # a template of this structure


@dataclass
class Outcome:
    """One rank's run: per epoch, per step the ids it trained (None: shadowed); cost figures."""

    epochs: list[list[Optional[list[int]]]] = field(default_factory=list)
    agreed: int = 0  # agreed steps
    seconds: float = 0.0  # this rank's CPU time in the loop (the thread's: what other processes take is not in it;
    # the model's tables excluded)
    agreed_seconds: list[float] = field(default_factory=list)  # per agreed step: its CPU time (tables excluded)
    planned_seconds: list[float] = field(default_factory=list)  # per planned step
    setup: float = 0.0  # building the loader (the sized schedule, for rebalancing)
    bytes: int = 0  # agreement bytes, per rank, all steps
    sends: list[tuple[int, int, list[int]]] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)  # each epoch's EpochReport
    loader: Optional[JoinLoader] = None


def run_rank(
    shards: Shards, rank: int, epochs: int = 1, mode: str = 'shadow', microbatch: int = 2, reads: bool = True
) -> Outcome:
    """Rank ``rank``'s run over ``shards`` (see the module docstring); ``reads``: read the step's record each step as
    the algorithm does (the gradient factor, this rank's samples, whether some rank shadows, microbatch evenness)."""
    world = shards.world
    layout = Layout.flat(world)
    model = Model(shards, rank, microbatch, mode)
    exchange = ModelExchange(model, rank, world)
    out = Outcome()
    start = time.thread_time()
    dataloader = _Loader(shards, rank)
    own = len(dataloader)
    table = exchange.rows([own, own], 'the first agreement').wait()
    shared, check_overflow, per_rank = agreed_lengths([r[0] for r in table], [r[1] for r in table])
    glue = Glue(describe=lambda batch: (len(batch), -(-len(batch) // microbatch)), microbatch_size=lambda: microbatch)
    channel = ModelChannel(rank, shards, model) if mode == 'rebalance' else None
    lengths = Lengths(shared, check_overflow, per_rank)
    source, lengths = batch_source(
        dataloader, lengths, mode == 'rebalance', lambda t: t, len, layout, exchange, channel
    )
    lengths = replace(lengths, lifted=False)
    loader = JoinLoader(source, glue, Rules(lengths, rank, layout), exchange)
    model.take(loader)
    out.setup = time.thread_time() - start - model.build_seconds
    model.build_seconds = 0.0
    out.loader = loader
    start = time.thread_time()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        cap = loader.length
        steps: list[Optional[list[int]]] = []
        out.epochs.append(steps)
        batches = iter(loader)
        for _ in range(cap if cap is not None else 10**9):
            t0, b0 = time.thread_time(), model.build_seconds
            try:
                batch = next(batches)
            except StopIteration:
                break
            record = loader.step
            assert record is not None
            plan = record.plan
            out.agreed += plan.agreed
            if reads:  # what the algorithm reads at every step
                record.any_shadow, plan.grad_factor(True), plan.even_microbatches
                plan.statuses[rank].samples  # noqa: B018
            own = plan.has_batch(rank)
            spent = time.thread_time() - t0 - (model.build_seconds - b0)
            (out.agreed_seconds if plan.agreed else out.planned_seconds).append(spent)
            steps.append(batch.tolist() if own else None)
        batches.close()
        loader.check_ended_together()
        out.reports.append(loader.report)
    out.seconds = time.thread_time() - start - model.build_seconds
    out.bytes = exchange.bytes
    out.sends = channel.sends if channel is not None else []
    return out
