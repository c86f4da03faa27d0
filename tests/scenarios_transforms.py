"""Rank-side scenarios for tests/test_transforms.py: a ``DataSpec`` whose ``batch_transforms`` change the batch.

Each rank reads its shard of ``uint8`` features (``x``, ``n x FEATURES``) and labels through a ``DataSpec`` with a
``batch_transforms`` (:data:`TRANSFORMS`): ``'float'`` (``x / 255`` as floats, the shape of Composer's own image
recipes: the model cannot take the loader's ``uint8``) or ``'views'`` (that, and every sample twice, the second
time mirrored: a batch of 8 trains 16 samples). :func:`run` fits (optionally from a checkpoint of an earlier fit,
``resume_at``), then evaluates and predicts with the same transform, and returns the weights after every step, the
evaluation's metrics and the predictions. Not a test module; the reference (``tests/test_transforms.py``) applies
the same transform in one process without composer_join.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from composer import Callback, Trainer
from composer.core import DataSpec, Evaluator
from composer.models import ComposerModel
from composer.utils import dist
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric, SumMetric

import devices
from rank_scenarios import ShardWithLen
from toy import CLASSES, FEATURES, make_module

BATCH = 8
LR, MOMENTUM = 0.1, 0.9


def shard(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples: ``uint8`` features, labels (the same in every process)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, FEATURES), generator=g, dtype=torch.uint8), torch.randint(
        0, CLASSES, (n,), generator=g
    )


def to_float(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0].float() / 255, batch[1]


def two_views(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = to_float(batch)
    return torch.cat([x, x.flip(-1)]), torch.cat([y, y])


TRANSFORMS: dict[str, Callable[[Any], Any]] = {'float': to_float, 'views': two_views}


def spec(seed: int, n: int, transform: str) -> DataSpec:
    return DataSpec(DataLoader(ShardWithLen(*shard(seed, n)), batch_size=BATCH), batch_transforms=TRANSFORMS[transform])


class LossSum(SumMetric):
    """The summed per-sample loss."""


class Count(SumMetric):
    """The samples evaluated."""


class Model(ComposerModel):
    """``toy.make_module('mlp')`` on float features; eval metrics: the summed loss and the samples evaluated."""

    def __init__(self):
        super().__init__()
        self.module = make_module('mlp')

    def forward(self, batch):
        return self.module(batch[0])

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1])

    def get_metrics(self, is_train: bool = False):
        return {} if is_train else {'LossSum': LossSum(), 'Count': Count(), 'MeanLoss': MeanMetric()}

    def update_metric(self, batch, outputs, metric):
        losses = F.cross_entropy(outputs, batch[1], reduction='none')
        if isinstance(metric, Count):
            metric.update(torch.tensor(float(len(losses))))
        elif isinstance(metric, LossSum):
            metric.update(losses.sum())
        else:
            metric.update(losses)


class StepParams(Callback):
    def __init__(self):
        self.params: list[torch.Tensor] = []

    def batch_end(self, state, logger):
        module = state.model.module.module if hasattr(state.model, 'module') else state.model.module
        self.params.append(torch.cat([p.detach().cpu().flatten() for p in module.parameters()]))


def run(cfg: dict) -> dict[str, Any]:
    """Fit on ``cfg['shards']`` (train seeds ``10 + rank``) with ``cfg['transform']``; then evaluate on
    ``cfg['eval_shards']`` (seeds ``50 + rank``) and predict ``cfg['predict_shards']`` (seeds ``70 + rank``), if
    given. ``resume_at``: fit once with a checkpoint after every batch into ``cfg['folder']``, then again from the one
    after that batch. ``join``: UnevenJoin's settings, or None (stock Composer)."""
    from composer_join import UnevenJoin

    rank = dist.get_global_rank()
    transform = cfg['transform']

    def fit(**kwargs: Any) -> tuple[Trainer, Model, StepParams, Any]:
        model, steps = Model(), StepParams()
        join = UnevenJoin(**cfg['join']) if cfg.get('join') is not None else None
        evaluators = []
        if cfg.get('eval_shards') is not None:
            evaluators.append(Evaluator(label='eval', dataloader=spec(50 + rank, cfg['eval_shards'][rank], transform)))
        trainer = Trainer(
            model=model,
            train_dataloader=spec(10 + rank, cfg['shards'][rank], transform),
            eval_dataloader=evaluators or None,
            eval_interval=cfg.get('eval_interval', '1ep') if evaluators else 1,
            max_duration=f'{cfg.get("epochs", 1)}ep',
            optimizers=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
            algorithms=[join] if join is not None else [],
            callbacks=[steps],
            device=devices.trainer_device(),
            device_train_microbatch_size=cfg.get('microbatch'),
            ddp_sync_strategy=cfg.get('sync'),
            progress_bar=False,
            log_to_console=False,
            seed=0,
            **kwargs,
        )
        trainer.fit()  # (a rank that raised is not closed: its barrier would hide the error)
        return trainer, model, steps, join

    out: dict[str, Any] = {}
    if cfg.get('resume_at') is not None:
        folder = os.path.join(cfg['folder'], 'full')
        trainer, *_ = fit(save_folder=folder, save_interval='1ba')
        trainer.close()
        (path,) = glob.glob(os.path.join(folder, f'ep*-ba{cfg["resume_at"]}-rank0.pt'))
        trainer, model, steps, join = fit(load_path=path)
    else:
        trainer, model, steps, join = fit()
    try:
        out['params'] = {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()}
        out['step_params'] = steps.params
        out['samples'] = int(trainer.state.timestamp.sample)
        out['reports'] = [vars(r).copy() for r in join.reports] if join is not None else []
        if cfg.get('eval_shards') is not None:
            values = trainer.state.eval_metric_values
            out['eval'] = {k: float(v) for k, v in values.items()}
        if cfg.get('predict_shards') is not None:
            predicted = trainer.predict(spec(70 + rank, cfg['predict_shards'][rank], transform), return_outputs=True)
            out['predictions'] = torch.cat([o.cpu() for o in predicted]) if predicted else torch.zeros(0, CLASSES)
    finally:
        trainer.close()
    return out
