"""Rank-side scenarios with Hugging Face models (a tiny GPT-2 in Composer's ``HuggingFaceModel``),
and with a model that mutates the batches it is given. Not a test module.

Each function runs on every rank of a :func:`harness.launch` and returns plain data that the test
compares with :mod:`reference_hf` (or :mod:`reference` for the toy model).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from composer.core import DataSpec, Evaluator
from composer.loggers import InMemoryLogger
from composer.metrics.nlp import LanguageCrossEntropy
from composer.models import ComposerModel, HuggingFaceModel
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics import MeanMetric, Metric

from composer_join import UnevenJoin
from rank_scenarios import Recorder, ShardWithLen, eval_logged, quiet_trainer
from reference_hf import collate, eval_shard, make_gpt2, optimizer_for, train_shard
from toy import make_module, shard


class Sequences(IterableDataset):
    """This rank's token sequences, streamed in order, with ``__len__``."""

    def __init__(self, seqs: list[torch.Tensor]):
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self):
        return iter(self.seqs)


class TokensEvaluated(Metric):
    """How many next-token predictions an evaluation scored (summed over ranks on compute)."""

    def __init__(self):
        super().__init__()
        self.add_state('n', default=torch.tensor(0), dist_reduce_fx='sum')

    def update(self, output: Any, target: torch.Tensor) -> None:
        self.n += (target != -100).sum()

    def compute(self) -> torch.Tensor:
        return self.n


def loss_generating_tokens(batch: dict) -> dict[str, int]:
    """Composer's token counts for a causal-LM batch: all positions, and those with a next-token label."""
    return {'total': int(batch['input_ids'].numel()), 'loss_generating': int((batch['labels'][:, 1:] != -100).sum())}


def hf_train(cfg: dict) -> dict[str, Any]:
    """One Composer ``fit`` of the tiny GPT-2 on this rank's shards, as ``cfg`` describes (see ``reference_hf.train``)."""
    rank = dist.get_global_rank()
    padded = cfg.get('tokens', False)
    model = HuggingFaceModel(make_gpt2(), use_logits=True, eval_metrics=[LanguageCrossEntropy(), TokensEvaluated()])
    optimizer = optimizer_for(cfg, model.parameters())
    train_loader = DataLoader(
        Sequences(train_shard(rank, cfg['shards'][rank], padded)), batch_size=cfg['batch_size'], collate_fn=collate
    )
    eval_loader = DataLoader(
        Sequences(eval_shard(rank, cfg['eval_shards'][rank], padded)),
        batch_size=cfg.get('eval_batch_size', 4),
        collate_fn=collate,
    )
    join = UnevenJoin(**cfg['join']) if cfg.get('join') is not None else None
    recorder, memory = Recorder(), InMemoryLogger()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=DataSpec(train_loader, get_num_tokens_in_batch=loss_generating_tokens),
        eval_dataloader=Evaluator(
            label='eval', dataloader=eval_loader, metric_names=['LanguageCrossEntropy', 'TokensEvaluated']
        ),
        eval_interval=cfg.get('eval_interval', '1ep'),
        max_duration=f'{cfg["epochs"]}ep',
        optimizers=optimizer,
        algorithms=[join] if join is not None else [],
        callbacks=[recorder],
        loggers=[memory],
        device_train_microbatch_size=cfg.get('microbatch'),
        ddp_sync_strategy=cfg.get('sync'),
        accumulate_train_batch_on_tokens=cfg.get('tokens', False),
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    ts = trainer.state.timestamp
    return {
        'params': {k: v.detach().clone() for k, v in model.model.named_parameters()},
        'step_params': recorder.params,
        'eval_params': recorder.eval_params,
        'eval': eval_logged(memory),
        'samples': int(ts.sample),
        'batches': int(ts.batch),
    }


class Mutating(ComposerModel):
    """A model that takes its batch apart, as Hugging Face models do: pops ``x`` and ``y`` in
    ``forward`` and ``eval_forward``, and scales what is left in place. Records every batch object
    it was handed (and keeps it alive, so that ``id`` stays unique) to count repeats."""

    def __init__(self):
        super().__init__()
        self.module = make_module('mlp')
        self.handed: list[dict] = []
        self.repeats = 0
        self.y = None

    def _take(self, batch: dict) -> torch.Tensor:
        self.repeats += any(b is batch for b in self.handed)
        self.handed.append(batch)
        x, self.y = batch.pop('x'), batch.pop('y')
        batch['input_ids'].mul_(2)
        return x

    def forward(self, batch):
        return self.module(self._take(batch))

    def eval_forward(self, batch, outputs=None):
        return self.module(self._take(batch))

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, self.y)

    def get_metrics(self, is_train: bool = False):
        return {} if is_train else {'MeanLoss': MeanMetric()}

    def update_metric(self, batch, outputs, metric):
        metric.update(F.cross_entropy(outputs, self.y, reduction='none'))


def _dict_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> DataLoader:
    def collate(samples):
        xs, ys = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
        return {'x': xs, 'y': ys, 'input_ids': torch.ones(len(ys), 4, dtype=torch.long)}

    return DataLoader(ShardWithLen(x, y), batch_size=batch_size, collate_fn=collate)


def mutating_train(cfg: dict) -> dict[str, Any]:
    """Train and evaluate :class:`Mutating` on the toy data (train shards as ``reference.train``, eval
    shards as ``reference.evaluate``), evaluating ``cfg['eval_interval']``."""
    rank = dist.get_global_rank()
    model = Mutating()
    recorder, memory = Recorder(), InMemoryLogger()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=_dict_loader(*shard(rank, cfg['shards'][rank]), cfg['batch_size']),
        eval_dataloader=Evaluator(
            label='eval',
            dataloader=_dict_loader(*shard(50 + rank, cfg['eval_shards'][rank]), 4),
            metric_names=['MeanLoss'],
        ),
        eval_interval=cfg['eval_interval'],
        max_duration=f'{cfg["epochs"]}ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        algorithms=[UnevenJoin(**cfg['join'])],
        callbacks=[recorder],
        loggers=[memory],
        device_train_microbatch_size=cfg.get('microbatch'),
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    return {
        'params': {k: v.detach().clone() for k, v in model.module.named_parameters()},
        'repeats': model.repeats,
        'forwards': len(model.handed),
        'shadow_steps': sum(recorder.shadow),
        'eval_params': recorder.eval_params,
        'eval': [float(v) for _, v in memory.data.get('metrics/eval/MeanLoss', [])],
        'samples': int(trainer.state.timestamp.sample),
    }
