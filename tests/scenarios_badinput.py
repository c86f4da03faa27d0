"""Rank-side scenarios for bad input: batches whose structure differs, a len() that overstates, wrong argument types.

Each rank's train dataloader is a plain iterable of prepared batches (``BATCHES`` names how each
rank's are made), so a scenario states exactly what every rank yields at every step. Not a test module.
"""

from __future__ import annotations

from typing import Any

import torch
from composer import Trainer
from composer.utils import dist

import devices
from composer_join import UnevenInputsError, UnevenJoin
from rank_scenarios import ToyModel
from toy import shard


class Batches:
    """This rank's batches, with a ``len()`` of ``claimed`` (their true number by default)."""

    def __init__(self, batches: list, claimed: int | None = None):
        self.batches, self.claimed = batches, claimed
        self.batch_size = 4  # Composer reads it to set the microbatch size

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches) if self.claimed is None else self.claimed


def batch(rank: int, step: int, fmt: str) -> Any:
    """Four samples of rank ``rank``'s data as a tuple, a dict, a dict with an extra key, or float64 features."""
    x, y = (t[4 * step : 4 * step + 4] for t in shard(rank, 4 * (step + 1)))
    if fmt == 'tuple':
        return x, y
    if fmt == 'dict':
        return {'x': x, 'y': y}
    if fmt == 'dict+mask':
        return {'x': x, 'y': y, 'mask': torch.ones(len(y))}
    if fmt == 'float64':
        return x.double().float(), y.int()  # labels as int32 instead of int64
    raise ValueError(fmt)


def train_on(formats: list[list[str]], claimed: list[int | None] | None = None) -> dict[str, Any]:
    """Train one epoch; rank ``r`` yields one batch per entry of ``formats[r]``. Returns the error, if any."""
    rank = dist.get_global_rank()
    model = ToyModel('mlp')
    loader = Batches([batch(rank, s, f) for s, f in enumerate(formats[rank])], (claimed or [None] * 2)[rank])
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        max_duration='1ep',
        algorithms=[UnevenJoin()],
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        device=devices.trainer_device(),
        progress_bar=False,
        log_to_console=False,
    )
    try:
        trainer.fit()
    except UnevenInputsError as e:
        return {'error': str(e), 'batch': int(trainer.state.timestamp.batch)}
    finally:
        trainer.close()
    return {'error': None, 'batch': int(trainer.state.timestamp.batch), 'sample': int(trainer.state.timestamp.sample)}


def wrong_argument(kwargs: dict) -> str:
    """Build ``UnevenJoin(**kwargs)`` on every rank; return the error's type and message."""
    try:
        UnevenJoin(**kwargs)
    except TypeError as e:
        return f'TypeError: {e}'
    return 'accepted'
