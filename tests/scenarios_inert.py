"""Rank-side scenarios for tests/test_inert_shadow.py: models a shadow batch must not reach. Not a test module."""

from __future__ import annotations

from typing import Any

import torch
from composer import Callback
from composer.models import ComposerModel
from composer.utils import dist
from torchmetrics import CatMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

import syncbn_cpu
import toy_inert
from composer_join import UnevenJoin
from rank_scenarios import (
    AsksForUnusedParameters,
    error_if_expected,
    make_evaluator,
    make_loader,
    make_optimizer,
    quiet_trainer,
)
from toy import CLASSES, unpack


class InertModel(ComposerModel):
    def __init__(self, kind: str, loss: str = 'ce', train_metrics: bool = False):
        super().__init__()
        self.train_metrics = train_metrics
        self.module = toy_inert.make(kind, distributed=True)
        if kind == 'syncbn':
            self.module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.module)
        self.kind_loss = loss
        self.forward_sizes: list[int] = []

    def forward(self, batch):
        x, y = unpack(batch)
        self.forward_sizes.append(len(x))
        return toy_inert.run(self.module, x, y, dist.get_global_rank())

    def loss(self, outputs, batch):
        return toy_inert.loss_mean(self.kind_loss, outputs, unpack(batch)[1])

    def get_metrics(self, is_train: bool = False):
        accuracy = MulticlassAccuracy(num_classes=CLASSES, average='micro')
        if is_train:  # a tensor state and a list state (concatenated per-sample losses)
            return {'MulticlassAccuracy': accuracy, 'Losses': CatMetric()} if self.train_metrics else {}
        return {'MulticlassAccuracy': accuracy, 'MeanLoss': MeanMetric()}

    def update_metric(self, batch, outputs, metric):
        y = unpack(batch)[1]
        if isinstance(metric, (MeanMetric, CatMetric)):
            metric.update(torch.nn.functional.cross_entropy(outputs, y, reduction='none'))
        else:
            metric.update(outputs, y)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


class TrainMetricValues(Callback):
    """What Composer computed for the train metrics at the end of every step (on this rank)."""

    def __init__(self):
        self.values: list[dict[str, torch.Tensor]] = []

    def batch_end(self, state, logger):
        self.values.append({k: v.detach().cpu().clone() for k, v in state.train_metric_values.items()})


class EvalStates(Callback):
    """The module's whole state (parameters and buffers) at every evaluation's start, as evaluation reads it."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.states: list[dict[str, torch.Tensor]] = []

    def eval_start(self, state, logger):
        self.states.append(_state(self.module))


def train_inert(cfg: dict, **checkpointing) -> dict[str, Any]:
    """One Composer ``fit`` of a ``toy_inert`` model with UnevenJoin; see ``reference_inert.train``.

    ``checkpointing``: Trainer arguments (``save_folder``, ``save_interval``, ``load_path``).
    """
    syncbn_cpu.install()
    rank = dist.get_global_rank()
    model = InertModel(cfg['model'], cfg.get('loss', 'ce'), cfg.get('train_metrics', False))
    from composer.loggers import InMemoryLogger

    memory, evals, train_values = InMemoryLogger(), EvalStates(model.module), TrainMetricValues()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=make_loader(cfg, rank),
        # second_fit: one epoch, then fit() again on the same trainer for the rest (UnevenJoin wraps anew)
        max_duration='1ep' if cfg.get('second_fit') else f'{cfg.get("epochs", 1)}ep',
        optimizers=make_optimizer(cfg, model.parameters()),
        algorithms=[UnevenJoin(**cfg.get('join', {}))]
        + ([AsksForUnusedParameters()] if cfg.get('find_unused') else []),
        callbacks=[evals, train_values],
        loggers=[memory],
        device_train_microbatch_size=cfg.get('microbatch'),
        ddp_sync_strategy=cfg.get('sync'),
        eval_dataloader=make_evaluator(cfg, rank),
        **checkpointing,
    )

    def fit():
        trainer.fit()
        if cfg.get('second_fit'):
            trainer.fit(duration=f'{cfg["epochs"] - 1}ep')

    try:
        error = error_if_expected(cfg, fit)
    finally:
        trainer.close()
    return {
        'error': error,
        'state': _state(model.module),
        'forward_sizes': model.forward_sizes,
        'eval_states': evals.states,
        'train_metrics': train_values.values,
        'eval': {
            k.split('/')[-1]: [float(v) for _, v in vals]
            for k, vals in memory.data.items()
            if k.startswith('metrics/eval/')
        },
    }


def train_fsdp_topk(cfg: dict) -> dict[str, Any]:
    """``scenarios_fsdp.train`` (FSDP1 or FSDP2, ``cfg['wrapper']``) with the top-4 loss of ``toy_inert``."""
    import scenarios_fsdp

    model = scenarios_fsdp.FSDPToyModel
    original = model.loss
    model.loss = lambda self, outputs, batch: toy_inert.loss_mean('topk', outputs, unpack(batch)[1])
    try:
        return scenarios_fsdp.train(cfg)
    finally:
        model.loss = original


def resume(cfg: dict, folder: str) -> dict[str, Any]:
    """The uninterrupted fit (a checkpoint after every batch), and a fit resumed from batch ``cfg['resume_at']``."""
    import os

    from scenarios_resume import checkpoint

    full_dir = os.path.join(folder, 'full')
    full = train_inert(cfg, save_folder=full_dir, save_interval='1ba', save_overwrite=True)
    resumed = train_inert(cfg, load_path=checkpoint(full_dir, cfg['resume_at']))
    return {'error': full['error'] or resumed['error'], 'state': full['state'], 'resumed': resumed['state']}
