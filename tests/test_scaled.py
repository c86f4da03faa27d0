"""The join at scale, by one-rank simulation (``tests/scaled.py``): checked against every rank simulated at once at
small W, then run at W=1,024 (issue #48)."""

from __future__ import annotations

import math
import statistics
from dataclasses import fields

import numpy as np
import pytest

from composer_join.core.report import EpochReport
from composer_join.rebalance.planning import Schedule
from scaled import STRIDE, Shards, run_rank
from simulated import Shard, simulate


def _report(report: EpochReport) -> dict:
    return {f.name: getattr(report, f.name) for f in fields(report)}


@pytest.mark.parametrize('mode', ['shadow', 'rebalance'])
@pytest.mark.parametrize('seed', [0, 1])
def test_one_rank_matches_every_rank_simulated_at_once(mode, seed):
    """Each rank's run with the others modelled is its run among real ranks: every step's batch, the reports; and the
    rank sent the model's row at every exchange (``scaled.ModelExchange``)."""
    shards = Shards.spread(8, 6, seed=seed)
    full = simulate(
        [Shard(list(shards.sizes(r)), first=r * STRIDE) for r in range(8)], epochs=2, rebalance=mode == 'rebalance'
    )
    for rank in range(8):
        assert full.runs[rank].error is None
        one = run_rank(shards, rank, epochs=2, mode=mode)
        assert one.epochs == [[s.ids for s in epoch] for epoch in full.runs[rank].epochs]
        assert [_report(r) for r in one.reports] == [_report(r) for r in full.runs[rank].reports]


def _check_schedule(shards: Shards, plan: Schedule) -> None:
    """Every batch once, steps = ceil(total / W)."""
    n = shards.n
    assert plan.length == math.ceil(shards.total() / shards.world)
    assert (np.asarray(plan.own) + np.asarray(plan.given) == n).all()
    batches = [(d, i) for d in range(shards.world) for i in range(n[d])]
    trained = [plan.cell(s, r) for r in range(shards.world) for s in range(plan.length)]
    assert sorted(c for c in trained if c is not None) == batches  # every batch once


def test_at_1024_ranks():
    """W=1,024, shards of 20 batches +-10%, 1% empty, 1% twice: on sampled ranks (empty, doubled, the longest, the
    shortest non-empty, rank 0), every rank runs the same steps and trains each batch once, shadowing or
    rebalancing; an agreed step's decisions stay in array operations (a loose bound: before #48 4 ms)."""
    shards = Shards.spread(1024, 20, seed=3)
    n = shards.n
    ranks = {0, int(np.argmin(n)), int(np.argmax(n)), int(np.argmin(np.where(n > 0, n, 10**9)))}
    for rank in sorted(ranks):
        out = run_rank(shards, rank)
        steps = out.epochs[0]
        assert len(steps) == n.max()  # the longest shard's count, on every rank
        assert [s for s in steps if s is not None] == [shards.ids(rank, i) for i in range(n[rank])]
        assert statistics.median(out.agreed_seconds) < 1e-3
    plan = Schedule.of(n.tolist())
    _check_schedule(shards, plan)
    receivers = {q for d in range(1024) for s in range(plan.length) for q in plan.receivers(d, s)}
    for rank in sorted(ranks | set(list(receivers)[:2])):
        out = run_rank(shards, rank, mode='rebalance')
        assert len(out.epochs[0]) == plan.length
        cells = [plan.cell(s, rank) for s in range(plan.length)]
        assert out.epochs[0] == [None if c is None else shards.ids(*c) for c in cells]
        assert out.setup < 5
