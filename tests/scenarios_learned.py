"""Rank-side scenarios for tests/test_learned.py: one trainer, several dataloaders of different shapes. Not a test module.

:func:`sequence` builds one Composer ``Trainer`` with UnevenJoin over :class:`toy_seq.SeqModule` and runs the
scenario's calls on it in order: ``fit`` (the first one the trainer's own ``train_dataloader``, later ones
``fit(train_dataloader=..., reset_time=True)``), ``eval`` (``trainer.eval(eval_dataloader=...)``: Composer labels
every such dataloader ``'eval'``) and ``predict``. Each dataloader is this rank's shard of a data set of
:data:`DATA` (its sequence length, whether it has a ``mask``, the long and the short rank's samples). What each
call gives, per rank, is what the test compares with :func:`toy_seq.reference`; a call that raises ends the
sequence, its error kept.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from composer import Callback
from composer.models import ComposerModel
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics import CatMetric, MeanMetric

from composer_join import UnevenJoin
from rank_scenarios import quiet_trainer
from toy_seq import LR, MOMENTUM, SeqModule, collate, run, seq_shard

BATCH = 4
# name: (sequence length, with a mask, (the long rank's samples, the short rank's)), and a seed
DATA: dict[str, tuple[int, bool, tuple[int, int], int]] = {
    'A': (8, False, (10, 4), 10),  # train: the short rank shadows steps 1 and 2
    'X': (8, False, (9, 3), 20),  # eval: the short rank shadows batches 1 and 2 (learns X's list-state shapes)
    'P': (12, True, (6, 1), 30),  # predict
    'Y': (16, True, (7, 0), 40),  # eval: the short rank has no sample at all
    'B': (16, True, (9, 2), 50),  # train: the short rank shadows steps 1 and 2
    'B0': (16, True, (9, 0), 60),  # train: the short rank has no sample at all
}


def samples(name: str, rank: int, short: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s samples of data set ``name`` when rank ``short`` is the short one."""
    length, masked, (long_n, short_n), seed = DATA[name]
    return seq_shard(seed + rank, short_n if rank == short else long_n, length, masked)


def per_rank(name: str, short: int, world: int = 2) -> list[list[dict[str, torch.Tensor]]]:
    return [samples(name, r, short) for r in range(world)]


class Shard(IterableDataset):
    """This rank's samples, streamed in order, with ``len()`` (the way sharded data reaches Composer)."""

    def __init__(self, items: list[dict[str, torch.Tensor]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def loader(name: str, rank: int, short: int) -> DataLoader:
    return DataLoader(Shard(samples(name, rank, short)), batch_size=BATCH, collate_fn=collate)


class SeqModel(ComposerModel):
    """:class:`toy_seq.SeqModule` with a cross-entropy loss; metrics: ``Tokens`` (a ``CatMetric`` of the per-token
    outputs, ``n x L``: its list states take the dataloader's shape) and ``MeanLoss``; train metrics: ``Tokens``."""

    def __init__(self):
        super().__init__()
        self.module = SeqModule()

    def forward(self, batch):
        return run(self.module, batch)

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs['logits'], batch['labels'])

    def get_metrics(self, is_train: bool = False):
        metrics = {'Tokens': CatMetric()}
        return metrics if is_train else {**metrics, 'MeanLoss': MeanMetric()}

    def update_metric(self, batch, outputs, metric):
        if isinstance(metric, MeanMetric):
            metric.update(F.cross_entropy(outputs['logits'], batch['labels'], reduction='none'))
        else:
            metric.update(outputs['tokens'])


class TrainTokens(Callback):
    """Per training step, the train ``Tokens`` Composer computed (every rank's real rows)."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def batch_end(self, state, logger):
        self.steps.append(state.train_metric_values['Tokens'].detach().cpu().clone())


def _params(model: SeqModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}


def sequence(cfg: dict) -> dict[str, Any]:
    """``cfg['calls']`` (``'fit A'``, ``'eval X'``, ``'predict P'``, ...) on one trainer; rank ``cfg['short']`` short."""
    rank, short = dist.get_global_rank(), cfg['short']
    calls = [c.split() for c in cfg['calls']]
    assert calls[0][0] == 'fit'
    model, recorder = SeqModel(), TrainTokens()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=loader(calls[0][1], rank, short),
        max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        algorithms=[UnevenJoin()],
        callbacks=[recorder],
    )
    results: list[dict[str, Any]] = []
    error = None
    try:
        for i, (kind, name) in enumerate(calls):
            if kind == 'fit':
                recorder.steps = []
                if i == 0:
                    trainer.fit()
                else:
                    trainer.fit(train_dataloader=loader(name, rank, short), duration='1ep', reset_time=True)
                results.append({'train_tokens': recorder.steps, 'params': _params(model)})
            elif kind == 'eval':
                trainer.eval(eval_dataloader=loader(name, rank, short))
                values = trainer.state.eval_metric_values
                results.append({'Tokens': values['Tokens'].cpu().clone(), 'MeanLoss': float(values['MeanLoss'])})
            else:
                outputs = trainer.predict(loader(name, rank, short), return_outputs=True)
                tokens = [o['tokens'].cpu() for o in outputs]
                results.append({'predictions': torch.cat(tokens) if tokens else None, 'batches': len(tokens)})
    except Exception as e:  # the test names the call and its error
        error = (len(results), f'{type(e).__name__}: {e}')
    finally:
        trainer.close()
    return {'results': results, 'error': error}
