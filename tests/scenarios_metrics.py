"""Rank side of ``test_metrics.py``: a ``ComposerClassifier`` with every kind of metric state. Not a test module.

The user's way: ``ComposerClassifier(train_metrics=MetricCollection(...), val_metrics=MetricCollection(...))``,
an ``Evaluator`` on this rank's own eval shard, a short uneven ``fit``. The run records the
parameters before every step and evaluation and the metric values Composer computed, which the
test compares with one process computing the same metrics over all the data.
"""

from __future__ import annotations

from typing import Any

import torch
from composer import Callback
from composer.core import Evaluator
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import DataLoader

import metric_kinds
from composer_join import UnevenJoin
from rank_scenarios import ShardWithLen, quiet_trainer
from toy import CLASSES, make_module, shard


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])


def values(metrics: dict) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


class KindsClassifier(ComposerClassifier):
    def __init__(self, train_kinds, eval_kinds):
        super().__init__(
            module=make_module('mlp'),
            num_classes=CLASSES,
            train_metrics=metric_kinds.collection(train_kinds),
            val_metrics=metric_kinds.collection(eval_kinds),
        )

    def update_metric(self, batch, outputs, metric):
        metric_kinds.update(metric, batch[0], batch[1], outputs)


class MetricRecorder(Callback):
    """Parameters before each step and evaluation; what Composer computed after each (on this rank)."""

    def __init__(self):
        self.step_params, self.train, self.shadow = [], [], []
        self.eval_params, self.eval = [], []

    def batch_start(self, state, logger):
        self.step_params.append(flat(state.model))

    def batch_end(self, state, logger):
        self.train.append(values(state.train_metric_values))

    def eval_start(self, state, logger):
        self.eval_params.append(flat(state.model))

    def eval_end(self, state, logger):
        self.eval.append(values(state.eval_metric_values))


class FourClassClassifier(ComposerClassifier):
    """The issue-28 user's model: ``ComposerClassifier`` over 4 classes (the data has 3), AUROC and AP on eval.

    With ``probabilities`` the metrics are updated with softmax scores; without, with the logits, as
    ``ComposerClassifier.update_metric`` does.
    """

    def __init__(self, probabilities: bool):
        super().__init__(
            module=metric_kinds.four_class_module(),
            num_classes=metric_kinds.FOUR,
            val_metrics=metric_kinds.four_class_collection(),
        )
        self.probabilities = probabilities

    def update_metric(self, batch, outputs, metric):
        metric.update(outputs.softmax(-1) if self.probabilities else outputs, batch[1])


def metric_kinds_run(cfg: dict) -> dict[str, Any]:
    """One uneven ``fit`` (train metrics at every step), an evaluation at its end (and ``trainer.eval()`` if ``eval_again``).

    ``cfg['four_classes']`` (True: probabilities, False: logits) trains :class:`FourClassClassifier` instead.
    """
    rank = dist.get_global_rank()
    x, y = shard(rank, cfg['shards'][rank])
    ex, ey = shard(cfg.get('eval_seed', 50) + rank, cfg['eval_shards'][rank])
    model = (
        FourClassClassifier(cfg['four_classes'])
        if 'four_classes' in cfg
        else KindsClassifier(
            cfg.get('train_kinds', metric_kinds.TRAIN_KINDS), cfg.get('eval_kinds', metric_kinds.EVAL_KINDS)
        )
    )
    recorder = MetricRecorder()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=DataLoader(ShardWithLen(x, y), batch_size=cfg['batch_size']),
        eval_dataloader=Evaluator(
            label='eval',
            dataloader=DataLoader(ShardWithLen(ex, ey), batch_size=cfg['eval_batch_size']),
            device_eval_microbatch_size=cfg.get('eval_microbatch'),
        ),
        max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[UnevenJoin()] if cfg.get('join', True) else [],
        callbacks=[recorder],
    )
    try:
        trainer.fit()
        if cfg.get('eval_again'):  # a second evaluation reuses what the first learned
            trainer.eval()
    finally:
        trainer.close()
    return {
        'step_params': recorder.step_params,
        'train': recorder.train,
        'eval_params': recorder.eval_params,
        'eval': recorder.eval,
    }
