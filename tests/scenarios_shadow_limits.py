"""Rank-side scenarios for tests/test_shadow_limits.py (issue 46, cases 7-9). Not a test module.

Every scenario fits one of :mod:`reference_shadow_limits`'s models for 2 epochs, batches of 4, on this rank's shard
(an ``IterableDataset`` with ``len()``), with UnevenJoin or (``stock``) without, and returns the ids of the real
samples each step trained, the final parameters, and the error it raised (its type and message) if it raised.
"""

from __future__ import annotations

import time
from typing import Any

import torch.nn.functional as F
from composer import Callback, Trainer
from composer.models import ComposerModel
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset

import composer_join
import devices
from composer_join import UnevenJoin, is_shadow_step
from reference_shadow_limits import data, make, optimizer


class Ids(IterableDataset):
    """This rank's samples ``(x, y, id)``, in order, with ``len()``."""

    def __init__(self, kind: str, rank: int, size: int):
        self.x, self.y = data(kind, rank, size)
        self.ids = [1000 * rank + i for i in range(size)]

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(zip(self.x, self.y, self.ids))


class Model(ComposerModel):
    def __init__(self, kind: str):
        super().__init__()
        self.module = make(kind, distributed=True)

    def forward(self, batch):
        return self.module(batch[0])

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1])


class StepIds(Callback):
    """The ids of the real samples each step trained on this rank."""

    def __init__(self):
        self.steps: dict[int, list[int]] = {}

    def before_forward(self, state, logger):
        ids = self.steps.setdefault(int(state.timestamp.batch), [])
        if not is_shadow_step(state):
            ids.extend(int(i) for i in state.batch[2])


def fit(cfg: dict) -> dict[str, Any]:
    """``cfg``: ``kind``, ``shards``; optional ``microbatch``, ``strategy`` (Composer's ``ddp_sync_strategy``),
    ``static_graph``, ``stock`` (no UnevenJoin)."""
    rank = dist.get_global_rank()
    kind = cfg['kind']
    model = Model(kind)
    steps = StepIds()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(Ids(kind, rank, cfg['shards'][rank]), batch_size=4),
        max_duration='2ep',
        optimizers=optimizer(kind, model.parameters()),
        algorithms=[] if cfg.get('stock') else [UnevenJoin()],
        callbacks=[steps],
        device=devices.trainer_device(),
        progress_bar=False,
        log_to_console=False,
        seed=0,
        device_train_microbatch_size=cfg.get('microbatch'),
        ddp_sync_strategy=cfg.get('strategy'),
    )
    if cfg.get('static_graph'):
        trainer.state.model._set_static_graph()  # torch's own switch; Composer has no option for it
    error, started = None, time.monotonic()
    try:
        trainer.fit()
    except Exception as e:  # reported to the test, which says what it expected
        error = (type(e).__name__, str(e))
    finally:
        trainer.close()
    return {
        'steps': steps.steps,
        'params': {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()},
        'error': error,
        'seconds': time.monotonic() - started,
        'module': composer_join.__file__,
    }
