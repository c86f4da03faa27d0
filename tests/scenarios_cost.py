"""Rank-side scenarios for tests/test_collective_cost.py: batches of varying sizes, a failing eval dataloader.

Not a test module.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

import rank_scenarios
from toy import shard


class PlannedBatches:
    """This rank's shard cut into batches of the sizes ``cfg['batch_plan'][rank]`` (as token-budget batching
    gives: sizes vary from step to step and rank to rank), an iterable with ``len()``."""

    def __init__(self, cfg: dict, rank: int):
        self.sizes = cfg['batch_plan'][rank]
        self.x, self.y = shard(rank, sum(self.sizes))

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):
        start = 0
        for n in self.sizes:
            yield self.x[start : start + n], self.y[start : start + n]
            start += n


def train_batch_plan(cfg: dict) -> dict[str, Any]:
    """``rank_scenarios.train`` on :class:`PlannedBatches` instead of fixed-size batches."""
    original = rank_scenarios.make_loader
    rank_scenarios.make_loader = lambda cfg, rank: PlannedBatches(cfg, rank)
    try:
        return rank_scenarios.train(cfg)
    finally:
        rank_scenarios.make_loader = original


def train_failing_eval(cfg: dict) -> dict[str, Any]:
    """``rank_scenarios.train`` whose rank ``r`` has an eval dataloader that raises at sample ``cfg['eval_fail_at'][r]``
    (a dict keyed by rank, so that tests/rank_orders.py rotates it)."""
    original = rank_scenarios.make_eval_loader

    def failing(cfg: dict, rank: int):
        loader = original(cfg, rank)
        if rank not in cfg['eval_fail_at']:
            return loader
        dataset = rank_scenarios.Misbehaving(loader.dataset.x, loader.dataset.y, fail_at=cfg['eval_fail_at'][rank])
        return DataLoader(dataset, batch_size=loader.batch_size)

    rank_scenarios.make_eval_loader = failing
    try:
        return rank_scenarios.train(cfg)
    finally:
        rank_scenarios.make_eval_loader = original
