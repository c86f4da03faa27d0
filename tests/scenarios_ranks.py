"""Rank-side scenarios for ranks that differ beyond their data: UnevenJoin's settings, custom DataSpecs, list batches.

Not a test module.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from composer import Callback, Trainer
from composer.core import DataSpec
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset

from composer_join import UnevenInputsError, UnevenJoin, is_shadow_step
from rank_scenarios import ToyModel, error_if_expected, make_loader, make_optimizer, quiet_trainer
from toy import FEATURES, shard


def with_settings(per_rank: list[Optional[dict]], shards: list[int], batch_size: int = 4) -> dict[str, Any]:
    """One epoch with ``UnevenJoin(**per_rank[rank])`` on each rank (``None``: no UnevenJoin on that rank).

    Returns the error (``UnevenInputsError``'s message, or another error's type and message), the
    steps trained and the seconds from the start of ``fit`` to the error.
    """
    rank = dist.get_global_rank()
    model = ToyModel('mlp')
    settings = per_rank[rank]
    cfg = dict(shards=shards, batch_size=batch_size)
    trainer = Trainer(
        model=model,
        train_dataloader=make_loader(cfg, rank),
        max_duration='1ep',
        algorithms=[UnevenJoin(**settings)] if settings is not None else [],
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        device='cpu',
        progress_bar=False,
        log_to_console=False,
    )
    start = time.monotonic()
    error: Optional[str] = None
    try:
        trainer.fit()
    except UnevenInputsError as e:
        error = str(e)
    except Exception as e:  # what a rank without UnevenJoin sees
        error = f'{type(e).__name__}: {e}'
    seconds = time.monotonic() - start
    # printed too: where a rank aborts, the launch returns no results, only every rank's output
    print(
        f'rank {rank} stopped after {seconds:.2f} s at batch {int(trainer.state.timestamp.batch)}: {error}', flush=True
    )
    try:
        trainer.close()
    except RuntimeError:  # a barrier, where another rank has died
        pass
    return {'error': error, 'batch': int(trainer.state.timestamp.batch), 'seconds': seconds}


# -- batches of Python lists, custom DataSpecs ------------------------------------------------------------


def records(rank: int, size: int) -> list[dict]:
    """Rank ``rank``'s samples as records: ``{'x': features, 'y': label}``, one dict per sample."""
    x, y = shard(rank, size)
    return [{'x': x[i], 'y': int(y[i])} for i in range(size)]


def strings(rank: int, size: int) -> list[str]:
    """Rank ``rank``'s samples as raw strings ``'label|f0,f1,...'`` (a model that parses its input)."""
    x, y = shard(rank, size)
    return [f'{int(y[i])}|' + ','.join(repr(float(v)) for v in x[i]) for i in range(size)]


class Items(IterableDataset):
    """This rank's own samples, streamed in order, with ``__len__`` (a per-rank shard, no sampler)."""

    def __init__(self, items: list):
        self.items = items

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def parse(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of a list of records or of strings."""
    if batch and isinstance(batch[0], str):
        rows = [s.split('|') for s in batch]
        x = torch.tensor([[float(v) for v in r[1].split(',')] for r in rows], dtype=torch.float32)
        return x.reshape(len(batch), FEATURES), torch.tensor([int(r[0]) for r in rows], dtype=torch.long)
    x = torch.stack([r['x'] for r in batch]) if batch else torch.zeros(0, FEATURES)
    return x, torch.tensor([r['y'] for r in batch], dtype=torch.long)


def pairs(batch: list, microbatch_size: int) -> list:
    """A custom ``split_batch``: microbatches of two samples, whatever the microbatch size."""
    return [batch[i : i + 2] for i in range(0, len(batch), 2)]


class ListModel(ToyModel):
    """The toy model on batches that are Python lists (records or strings)."""

    def __init__(self):
        super().__init__('mlp')
        self.microbatches: list[int] = []  # forward calls per step

    def forward(self, batch):
        x, _ = parse(batch)
        self.forward_sizes.append(len(x))
        return self.module(x)

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, parse(batch)[1])


class Steps(Callback):
    """Per step on this rank: shadow or not, and how many forward passes (microbatches) it ran."""

    def __init__(self):
        self.shadow: list[bool] = []
        self.microbatches: list[int] = []

    def before_train_batch(self, state, logger):
        self.microbatches.append(0)

    def before_forward(self, state, logger):
        self.microbatches[-1] += 1

    def batch_end(self, state, logger):
        self.shadow.append(is_shadow_step(state))


def train_lists(cfg: dict) -> dict[str, Any]:
    """Train on batches that are lists (``cfg['fmt']``: ``records`` or ``strings``) through a ``DataSpec``.

    The ``DataSpec`` counts samples with ``len`` (Composer's default cannot count such batches)
    and, with ``cfg['split'] == 'pairs'``, splits into microbatches of two samples (:func:`pairs`).
    ``cfg['wrapper']``: ``fsdp2`` for FSDP2, else DDP. ``cfg['doubling']``: the ``DataSpec``'s
    ``batch_transforms`` doubles every batch (so it splits into more microbatches than counted).
    """
    rank = dist.get_global_rank()
    samples = (records if cfg['fmt'] == 'records' else strings)(rank, cfg['shards'][rank])
    loader = DataLoader(Items(samples), batch_size=cfg['batch_size'], collate_fn=list)
    extra_spec = {'split_batch': pairs} if cfg.get('split') else {}
    if cfg.get('doubling'):  # an augmentation that doubles every batch after UnevenJoin counted it
        extra_spec['batch_transforms'] = lambda batch: batch + batch
    spec = DataSpec(loader, get_num_samples_in_batch=len, **extra_spec)
    extra = {}
    if cfg.get('wrapper'):
        from scenarios_fsdp import cpu_fsdp_workarounds, parallelism

        cpu_fsdp_workarounds()
        extra['parallelism_config'] = parallelism(cfg['wrapper'], cfg)
    model, steps, join = ListModel(), Steps(), UnevenJoin(**cfg.get('join', {}))
    trainer = quiet_trainer(
        model=model,
        train_dataloader=spec,
        max_duration=f'{cfg.get("epochs", 1)}ep',
        optimizers=make_optimizer(cfg, model.parameters()),
        algorithms=[join],
        callbacks=[steps],
        device_train_microbatch_size=cfg.get('microbatch'),
        ddp_sync_strategy=cfg.get('sync'),
        **extra,
    )
    error = error_if_expected(cfg, trainer.fit)
    if cfg.get('wrapper'):
        from scenarios_fsdp import full_params

        params = full_params(trainer, 'mlp') if error is None else {}
    else:
        params = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    trainer.close()
    return {
        'error': error,
        'params': params,
        'shadow': steps.shadow,
        'microbatches': steps.microbatches,
        'reports': [vars(r).copy() for r in join.reports],
        'sample': int(trainer.state.timestamp.sample),
    }
