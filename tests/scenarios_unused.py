"""Rank-side scenarios for tests/test_unused_parameters.py: a parameter only one rank's data uses. Not a test module.

The model is ``toy.Branchy``: its ``extra`` layer is used by label-0 samples only. The long rank's samples never
have label 0; the short rank's always do. So once the short rank has run out, no real sample of a step uses
``extra``: in one process it gets no gradient, and SGD with momentum leaves it alone. Samples carry ids
(``1000 * rank + i``) so the test replays every step in one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from composer import Callback
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset

from composer_join import UnevenJoin, is_shadow_step
from rank_scenarios import AsksForUnusedParameters, ToyModel, quiet_trainer
from toy import CLASSES, make_module, shard


def labelled(rank: int, size: int, uses_extra: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s features; labels 0 (``extra`` used) or never 0 (``extra`` unused)."""
    x, y = shard(rank, size)
    return x, torch.zeros_like(y) if uses_extra else 1 + y % (CLASSES - 1)


class Ids(IterableDataset):
    """This rank's own samples ``(x, y, id)``, streamed in order, with ``len()``."""

    def __init__(self, rank: int, size: int, uses_extra: bool):
        self.x, self.y = labelled(rank, size, uses_extra)
        self.ids = [1000 * rank + i for i in range(size)]

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(zip(self.x, self.y, self.ids))


class StepIds(Callback):
    def __init__(self):
        self.steps: dict[int, list[int]] = {}

    def before_forward(self, state, logger):
        ids = self.steps.setdefault(int(state.timestamp.batch), [])
        if not is_shadow_step(state):
            ids.extend(int(i) for i in state.batch[2])


def fit(cfg: dict) -> dict[str, Any]:
    """2 epochs with UnevenJoin; ``static_graph``: DDP's static graph (the shadow rank then runs the template)."""
    rank = dist.get_global_rank()
    dataset = Ids(rank, cfg['shards'][rank], uses_extra=rank == cfg['short'])
    model = ToyModel('branch')
    steps = StepIds()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=DataLoader(dataset, batch_size=4),
        max_duration='2ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        algorithms=[UnevenJoin(), AsksForUnusedParameters()],
        callbacks=[steps],
    )
    if cfg.get('static_graph'):
        trainer.state.model._set_static_graph()  # torch's own switch; Composer has no option for it
    try:
        trainer.fit()
    finally:
        trainer.close()
    return {'steps': steps.steps, 'params': {k: v.detach().clone() for k, v in model.module.named_parameters()}}


def torch_join(cfg: dict) -> dict[str, Any]:
    """The same data and model in a plain torch loop under ``DistributedDataParallel.join`` (its own semantics)."""
    rank = dist.get_global_rank()
    dataset = Ids(rank, cfg['shards'][rank], uses_extra=rank == cfg['short'])
    module = make_module('branch')
    ddp = torch.nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        with ddp.join():
            for x, y, _ids in DataLoader(dataset, batch_size=4):
                optimizer.zero_grad()
                F.cross_entropy(ddp(x, y), y).backward()
                optimizer.step()
    return {'params': {k: v.detach().clone() for k, v in module.named_parameters()}}
