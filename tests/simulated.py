"""The join's loader on W simulated ranks in one process: Composer's loop as it drives the loader, without a Trainer.

Each rank (a thread, ``tests/lockstep.py``) builds what ``join_dataloader`` builds (the first agreement's lengths
through the exchange, the protocol's ``Rules``, the loader's ``Glue``, the source) over a :class:`Shard` of its own,
and iterates it as Composer's ``_iter_dataloader`` does: the length cap (lifted where ``lift_cap`` lifts it), one
"exhausted" all-reduce per step (which ends the loop on every rank when one rank's iterator stops), and
``check_ended_together`` at the epoch's end. What each rank trained is recorded per step (:class:`Step`), with the
step record the loader published; a rank that raises returns what it trained until then and the error.

Nothing here decides what a step is: the expected outcome of a run is computed by the tests, from the shards alone.

Example (two ranks, 3 and 1 batches of 2 samples)::

    sim = simulate([Shard([2, 2, 2]), Shard([2], first=1000)])
    [[s.ids for s in epoch] for epoch in sim.runs[1].epochs]  # [[[1000, 1001], None, None]]: rank 1 shadows twice
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from composer_join.core.layout import Layout, check_lengths
from composer_join.core.plan import len_or_none
from composer_join.core.protocol import Exchange, Lengths, Rules, agreed_lengths
from composer_join.core.report import EpochReport
from composer_join.join.iterator import Glue, JoinLoader, StepRecord
from composer_join.join.loader import batch_source
from composer_join.rebalance.transfer import BatchChannel
from lockstep import Lockstep
from lockstep import run as run_ranks

__all__ = ['FLAG', 'Run', 'Shard', 'ShardLoader', 'Simulation', 'Step', 'simulate']

FLAG = "Composer's exhausted flag"
"""What the lockstep log calls Composer's per-step all-reduce (``issued`` in :func:`simulate`'s result)."""


@dataclass(frozen=True)
class Shard:
    """One rank's data: samples per batch, in order; ``claimed``: its ``len()`` (``'exact'``: the number of batches,
    None: it has none); ``fail_at``: the batch whose read raises; ``first``: its first sample id; ``dtype``: of its
    batches."""

    sizes: Sequence[int]
    claimed: Any = 'exact'
    fail_at: Optional[int] = None
    first: int = 0
    dtype: torch.dtype = torch.int64

    @property
    def length(self) -> Optional[int]:
        return len(self.sizes) if self.claimed == 'exact' else self.claimed

    def ids(self, batch: int) -> list[int]:
        start = self.first + sum(self.sizes[:batch])
        return list(range(start, start + self.sizes[batch]))


class ShardLoader:
    """A user's dataloader over a :class:`Shard`: a ``len()`` as claimed, batches of sample ids, a read that raises."""

    def __init__(self, shard: Shard, rank: int):
        self.shard, self.rank = shard, rank

    def __len__(self) -> int:
        if self.shard.length is None:
            raise TypeError('no len()')
        return self.shard.length

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self.shard.sizes)):
            if i == self.shard.fail_at:
                raise RuntimeError(f'read error at batch {i} of rank {self.rank}')
            yield torch.tensor(self.shard.ids(i), dtype=self.shard.dtype)


@dataclass(frozen=True)
class Step:
    """What one rank trained at one step: the sample ids of its real batch (None: it shadowed), the step record the
    loader published, and whether the loader said the step ends the epoch."""

    ids: Optional[list[int]]
    record: StepRecord
    epoch_done: bool


@dataclass
class Run:
    """One rank's run: per epoch its steps, the loader, and the error it stopped with (None: it finished)."""

    epochs: list[list[Step]] = field(default_factory=list)
    reports: list[EpochReport] = field(default_factory=list)  # each finished epoch's
    loader: Optional[JoinLoader] = None
    error: Optional[BaseException] = None


def loader_for(
    shard: Shard,
    lockstep: Lockstep,
    rank: int,
    layout: Layout,
    throw: bool = False,
    microbatch: int = 2,
    rebalance: bool = False,
    lifted: bool = True,
) -> JoinLoader:
    """What ``join_dataloader`` builds on ``rank``, over ``shard``: the first agreement, then the source
    (``batch_source``, the glue's own: a rebalancer's transfers go through the lockstep's wire) and the loader.
    ``lifted``: the ranks' dataloaders may yield more than their ``len()`` (as an ``IterableDataset`` read by several
    workers does, :attr:`~composer_join.core.protocol.Lengths.lifted`), so Composer's cap is lifted where it must be."""
    exchange = lockstep.exchange(rank)
    dataloader = ShardLoader(shard, rank)
    own = len_or_none(dataloader)
    row = [-1 if own is None else own] * 2  # the trainer's cap is the whole epoch
    table = exchange.rows(row, 'the first agreement').wait()
    shared, check_overflow, per_rank = agreed_lengths([r[0] for r in table], [r[1] for r in table])
    check_lengths(layout, per_rank, 'train')
    glue = Glue(describe=lambda batch: (len(batch), -(-len(batch) // microbatch)), microbatch_size=lambda: microbatch)
    lengths = Lengths(shared, check_overflow, per_rank)
    channel = BatchChannel(wire=lockstep.wire(rank)) if rebalance else None
    source, lengths = batch_source(dataloader, lengths, rebalance, lambda t: t, len, layout, exchange, channel)
    lengths = replace(lengths, lifted=lifted)
    return JoinLoader(source, glue, Rules(lengths, rank, layout, throw=throw), exchange)


def composer_loop(loader: JoinLoader, exchange: Exchange, cap: Optional[int]) -> Iterator[Any]:
    """Composer's ``_iter_dataloader``: at most ``cap`` batches, and one "exhausted" all-reduce per step."""
    batches = iter(loader) if cap is None else itertools.islice(loader, cap)
    while True:
        try:
            batch, done = next(batches), 0
        except StopIteration:
            batch, done = None, 1
        if max(row[0] for row in exchange.rows([done], FLAG).wait()):
            return
        yield batch


def fit(loader: JoinLoader, exchange: Exchange, epochs: int, run: Run) -> None:
    """Train ``epochs`` epochs as Composer does with UnevenJoin: the cap lifted at each epoch's start where it must be."""
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        cap = loader.length
        if loader.rules.lifts(cap):  # what lift_cap decides
            loader.uncapped, cap = True, None
        steps: list[Step] = []
        run.epochs.append(steps)
        for batch in composer_loop(loader, exchange, cap):
            record = loader.step
            assert record is not None and record.index == len(steps)
            shadow = not record.plan.has_batch(exchange.rank)
            assert shadow == (len(batch) == 0)  # a shadow batch has zero samples, a real one has some
            steps.append(Step(None if shadow else batch.tolist(), record, loader.epoch_done()))
        assert loader.step is None  # outside a step, no record
        loader.check_ended_together()
        run.reports.append(loader.report)


@dataclass
class Simulation:
    """Every rank's :class:`Run`, the collectives each rank issued (by what they said they were), the transfers' messages
    never received (per sender and receiver), and the warnings."""

    runs: list[Run]
    issued: list[list[str]]
    undelivered: dict[tuple[int, int], int]
    warnings: list[str]


def simulate(
    shards: Sequence[Shard],
    epochs: int = 1,
    layout: Optional[Layout] = None,
    throw: bool = False,
    microbatch: int = 2,
    timeout: float = 20.0,
    rebalance: bool = False,
    lifted: bool = True,
) -> Simulation:
    """Every rank's run over its shard (``shards[rank]``), ``epochs`` epochs, in one process (``rebalance``:
    ``mode='rebalance'``)."""
    layout = layout or Layout.flat(len(shards))

    def rank_main(rank: int, lockstep: Lockstep) -> Run:
        run = Run()
        try:
            run.loader = loader_for(shards[rank], lockstep, rank, layout, throw, microbatch, rebalance, lifted)
            fit(run.loader, lockstep.exchange(rank), epochs, run)
        except Exception as e:  # the test checks it
            run.error = e
        return run

    with warnings.catch_warnings(record=True) as caught:  # (the warnings module is global: not per thread)
        warnings.simplefilter('always')
        runs, lockstep = run_ranks(len(shards), rank_main, timeout)
    return Simulation(runs, lockstep.issued, lockstep.undelivered, [str(w.message) for w in caught])
