"""Rank-side scenarios: ``Trainer.predict()``, Composer's callbacks and Trainer options with UnevenJoin
on uneven shards. Not a test module: each function runs on every rank of a :func:`harness.launch`.
"""

from __future__ import annotations

from typing import Any

import torch
from composer import Callback
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import UnevenJoin, is_shadow_step
from rank_scenarios import ShardWithLen, ToyModel, quiet_trainer
from scenarios_fsdp import cpu_fsdp_workarounds, parallelism
from toy import shard


class PredictRecorder(Callback):
    """At every ``PREDICT_BATCH_END``: output rows, batch rows, shadow or not, ``predict_timestamp`` samples."""

    def __init__(self):
        self.seen: list[tuple[int, int, bool, int]] = []

    def predict_batch_end(self, state, logger):
        self.seen.append((len(state.outputs), len(state.batch[0]), is_shadow_step(state),
                          int(state.predict_timestamp.sample)))


def predict(cfg: dict) -> dict[str, Any]:
    """``trainer.predict()`` (no fit) on this rank's shard ``cfg['shards'][rank]``, under ``cfg['wrapper']``."""
    rank = dist.get_global_rank()
    if cfg.get('wrapper') in ('fsdp1', 'fsdp2'):
        cpu_fsdp_workarounds()
    model = ToyModel('mlp')
    recorder = PredictRecorder()
    trainer = quiet_trainer(
        model=model, callbacks=[recorder], parallelism_config=parallelism(cfg.get('wrapper'), cfg),
        algorithms=[UnevenJoin()] if cfg.get('join', True) else [],
    )
    x, y = shard(60 + rank, cfg['shards'][rank])
    loader = DataLoader(ShardWithLen(x, y), batch_size=cfg.get('batch_size', 8))
    try:
        outputs = trainer.predict(loader, return_outputs=cfg.get('return_outputs', True))
        ts = trainer.state.predict_timestamp
    finally:
        trainer.close()
    return {
        'outputs': [o.detach().cpu().clone() for o in outputs],
        'seen': recorder.seen,
        'predict_sample': int(ts.sample), 'predict_batch': int(ts.batch),
    }
