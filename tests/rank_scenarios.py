"""What the ranks of a distributed test run: Composer training with and without UnevenJoin, and torch's join.

Each function runs on every rank of a :func:`harness.launch` and returns plain data (tensors, lists,
dicts) that the test compares with :mod:`reference`. Not a test module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from composer import Callback, Trainer
from composer.core import Algorithm, DataSpec, Evaluator
from composer.loggers import InMemoryLogger
from composer.models import ComposerModel
from composer.optim import CosineAnnealingScheduler
from composer.utils import dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy

import devices
import reference
from composer_join import UnevenInputsError, UnevenJoin, is_shadow_step
from composer_join.collectives import CollectiveCounter
from composer_join.data.sampler import ExactDistributedSampler
from toy import (
    CLASSES,
    lm_batch,
    lm_shard,
    lm_token_losses,
    lm_tokens,
    logits,
    make_batch,
    make_lm,
    make_module,
    shard,
    unpack,
)


class ShardWithLen(IterableDataset):
    """This rank's shard, streamed in order, with ``__len__`` (the way sharded data reaches Composer)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __iter__(self):
        return iter(zip(self.x, self.y))


class Misbehaving(ShardWithLen):
    """A shard whose ``__len__`` says ``claimed`` samples, or whose reading fails at sample ``fail_at``."""

    def __init__(self, x, y, claimed=None, fail_at=None):
        super().__init__(x, y)
        self.claimed, self.fail_at = claimed, fail_at

    def __len__(self) -> int:
        return len(self.y) if self.claimed is None else self.claimed

    def __iter__(self):
        for i, sample in enumerate(zip(self.x, self.y)):
            if i == self.fail_at:
                raise RuntimeError(f'disk read error at sample {i}')
            yield sample


class ShardNoLen(IterableDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


class SamplesSeen(Metric):
    """A train metric that counts the samples it is updated with (synced across ranks on compute)."""

    def __init__(self):
        super().__init__()
        self.add_state('n', default=torch.tensor(0), dist_reduce_fx='sum')
        self.local_updates: list[int] = []

    def update(self, y: torch.Tensor) -> None:
        self.n += len(y)
        self.local_updates.append(len(y))

    def compute(self) -> torch.Tensor:
        return self.n


class ToyModel(ComposerModel):
    def __init__(self, kind: str, train_metrics: bool = False):
        super().__init__()
        self.module = make_module(kind)
        self.train_metrics = train_metrics
        self.forward_sizes: list[int] = []

    def forward(self, batch):
        x, y = unpack(batch)
        self.forward_sizes.append(len(x))
        return logits(self.module, x, y)

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, unpack(batch)[1])

    def get_metrics(self, is_train: bool = False):
        if not is_train:
            # a per-sample mean (Composer's CrossEntropy metric averages per-batch means instead)
            return {
                'MulticlassAccuracy': MulticlassAccuracy(num_classes=CLASSES, average='micro'),
                'MeanLoss': MeanMetric(),
            }
        return {'SamplesSeen': SamplesSeen()} if self.train_metrics else {}

    def update_metric(self, batch, outputs, metric):
        y = unpack(batch)[1]
        if isinstance(metric, SamplesSeen):
            metric.update(y)
        elif isinstance(metric, MeanMetric):
            metric.update(F.cross_entropy(outputs, y, reduction='none'))
        else:
            metric.update(outputs, y)


class ToyLMModel(ComposerModel):
    """The tiny LM; its loss is the mean over the microbatch's loss-generating tokens."""

    def __init__(self):
        super().__init__()
        self.module = make_lm()
        self.forward_sizes: list[int] = []

    def forward(self, batch):
        self.forward_sizes.append(len(batch['input_ids']))
        return batch

    def loss(self, outputs, batch):
        return lm_token_losses(self.module, batch).mean()


class AsksForUnusedParameters(Algorithm):
    """An algorithm that needs DDP's ``find_unused_parameters`` (so Composer picks multi_auto_sync)."""

    @property
    def find_unused_parameters(self) -> bool:
        return True

    def match(self, event, state):
        return False

    def apply(self, event, state, logger):
        pass


class Recorder(Callback):
    """Per step on this rank: the learning rate, the parameters after the step, shadow or not."""

    def __init__(self):
        self.lrs: list[float] = []
        self.dataloader_lens: list[Optional[int]] = []  # as a callback reads it at each step's start
        self.params: list[torch.Tensor] = []
        self.shadow: list[bool] = []
        self.train_metric: list[int] = []

        self.eval_params: list[torch.Tensor] = []
        self.sample_ids: list[list[int]] = []  # per epoch, the ids of real samples trained on this rank

    def epoch_start(self, state, logger):
        self.sample_ids.append([])

    def before_forward(self, state, logger):
        if isinstance(state.batch, (tuple, list)) and len(state.batch) == 3 and not is_shadow_step(state):
            self.sample_ids[-1].extend(int(i) for i in state.batch[2])

    def eval_start(self, state, logger):
        self.eval_params.append(torch.cat([p.detach().flatten().cpu() for p in state.model.parameters()]))

    def batch_start(self, state, logger):
        self.lrs.append(state.optimizers[0].param_groups[0]['lr'])
        self.dataloader_lens.append(None if state.dataloader_len is None else int(state.dataloader_len))

    def batch_end(self, state, logger):
        self.params.append(torch.cat([p.detach().flatten().cpu() for p in state.model.parameters()]))
        self.shadow.append(is_shadow_step(state))
        metric = (state.train_metrics or {}).get('SamplesSeen')
        if metric is not None:
            self.train_metric.append(int(metric.n))  # local, after this step's updates


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def make_loader(cfg: dict, rank: int):
    if cfg.get('model') == 'lm':
        seqs = lm_shard(rank, cfg['shards'][rank])
        loader = DataLoader(seqs, batch_size=cfg['batch_size'], collate_fn=lm_batch)
        return DataSpec(_Streamed(loader), get_num_tokens_in_batch=lm_tokens)
    if cfg.get('dataset') == 'map':  # one dataset, sharded exactly by ExactDistributedSampler
        dataset = Indexed(*shard(7, cfg['map_size']))
        sampler = ExactDistributedSampler(dataset, shuffle=True, seed=3)
        return DataLoader(dataset, batch_size=cfg['batch_size'], sampler=sampler)
    x, y = shard(rank, cfg['shards'][rank])
    dataset = ShardNoLen(x, y) if cfg.get('dataset') == 'iterable_nolen' else ShardWithLen(x, y)
    if rank in cfg.get('claimed_len', {}) or rank in cfg.get('fail_at', {}):
        dataset = Misbehaving(x, y, cfg.get('claimed_len', {}).get(rank), cfg.get('fail_at', {}).get(rank))
    fmt = cfg.get('fmt', 'tuple')

    def collate(samples):
        return make_batch(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]), fmt)

    return DataLoader(dataset, batch_size=cfg['batch_size'], collate_fn=collate)


class _Streamed:
    """An iterable with a length that is not a map-style DataLoader (so Composer asks for no DistributedSampler)."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


class Indexed(Dataset):
    """A map-style dataset whose samples carry their index: ``(x, y, id)``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class IdShard(IterableDataset):
    """Rank ``rank``'s ``size`` samples ``(x, y, id)`` with ids ``1000 * rank + i``, streamed in order, no
    ``__len__``; raising at sample ``fail_at``."""

    def __init__(self, rank: int, size: int, fail_at: Optional[int] = None):
        self.x, self.y = shard(rank, size)
        self.ids = [rank * 1000 + i for i in range(size)]
        self.fail_at = fail_at

    def __iter__(self):
        for i, sample in enumerate(zip(self.x, self.y, self.ids)):
            if i == self.fail_at:
                raise RuntimeError(f'disk read error at sample {i}')
            yield sample


class SizedIdShard(IdShard):
    """:class:`IdShard` with ``__len__``."""

    def __len__(self) -> int:
        return len(self.ids)


def make_eval_loader(cfg: dict, rank: int) -> Optional[DataLoader]:
    """Per-rank eval shards (``eval_shards``), or one dataset of ``eval_map`` samples with a sampler."""
    batch_size = cfg.get('eval_batch_size', 4)
    if cfg.get('eval_shards') is not None:
        x, y = shard(50 + rank, cfg['eval_shards'][rank])
        return DataLoader(ShardWithLen(x, y), batch_size=batch_size)
    if cfg.get('eval_map') is not None:
        dataset = Indexed(*shard(99, cfg['eval_map']))
        sampler = (
            DistributedSampler(dataset, shuffle=False)
            if cfg.get('eval_sampler') == 'torch'
            else ExactDistributedSampler(dataset, shuffle=False)
        )
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return None


def make_evaluator(cfg: dict, rank: int) -> Optional[Evaluator]:
    loader = make_eval_loader(cfg, rank)
    if loader is None:
        return None
    return Evaluator(
        label='eval',
        dataloader=loader,
        metric_names=['MulticlassAccuracy', 'MeanLoss'],
        device_eval_microbatch_size=cfg.get('eval_microbatch'),
    )


make_optimizer = reference.optimizer_for


def eval_logged(memory: InMemoryLogger) -> dict[str, list[float]]:
    """Per eval metric (by its short name), the values logged at each evaluation."""
    return {
        k.split('/')[-1]: [float(v) for _, v in vals]
        for k, vals in memory.data.items()
        if k.startswith('metrics/eval/')
    }


def quiet_trainer(**kwargs) -> Trainer:
    """A ``Trainer`` as every scenario builds it: on the test device (``tests/devices.py``), seed 0, no console output."""
    return Trainer(device=devices.trainer_device(), progress_bar=False, log_to_console=False, seed=0, **kwargs)


def error_if_expected(cfg: dict, run: Callable[[], Any]) -> Optional[str]:
    """``run()``; if it raises :class:`UnevenInputsError` and ``cfg['expect_error']``, the error's message, else None."""
    try:
        run()
    except UnevenInputsError as e:
        if not cfg.get('expect_error'):
            raise
        return str(e)
    return None


def train(cfg: dict) -> dict[str, Any]:
    """One Composer ``fit`` on this rank's shard, as ``cfg`` describes; see ``reference.train``."""
    rank = dist.get_global_rank()
    model = (
        ToyLMModel() if cfg.get('model') == 'lm' else ToyModel(cfg.get('model', 'mlp'), cfg.get('train_metrics', False))
    )
    optimizer = make_optimizer(cfg, model.parameters())
    join = UnevenJoin(**cfg['join']) if cfg.get('join') is not None else None
    recorder, memory, lines, counter = Recorder(), InMemoryLogger(), LogLines(), CollectiveCounter()
    logging.getLogger('composer_join').addHandler(lines)
    logging.getLogger('composer_join').setLevel(logging.INFO)
    trainer = quiet_trainer(
        model=model,
        train_dataloader=make_loader(cfg, rank),
        max_duration=None if cfg.get('chunks') else cfg.get('max_duration', f'{cfg.get("epochs", 1)}ep'),
        optimizers=optimizer,
        schedulers=CosineAnnealingScheduler() if cfg.get('schedule') == 'cosine' else None,
        algorithms=([join] if join is not None else [])
        + ([AsksForUnusedParameters()] if cfg.get('find_unused') else []),
        callbacks=[recorder] + ([counter] if cfg.get('count_collectives') else []),
        loggers=[memory],
        device_train_microbatch_size=cfg.get('microbatch'),
        ddp_sync_strategy=cfg.get('sync'),
        accumulate_train_batch_on_tokens=cfg.get('tokens', False),
        eval_dataloader=make_evaluator(cfg, rank),
        eval_interval=cfg.get('eval_interval', 1),
    )
    try:
        # ``chunks``: fit(duration=...) once per piece (they add up to the epochs) instead of one fit()
        fits = [lambda d=d: trainer.fit(duration=d) for d in cfg.get('chunks', [])] or [trainer.fit]
        error = error_if_expected(cfg, lambda: ([f() for f in fits], cfg.get('eval_after') and trainer.eval()))
    finally:
        trainer.close()
        logging.getLogger('composer_join').removeHandler(lines)
    ts = trainer.state.timestamp
    module = model.module
    return {
        'error': error,
        'params': {k: v.detach().cpu().clone() for k, v in module.named_parameters()},
        'buffers': {k: v.detach().cpu().clone() for k, v in module.named_buffers()},
        'optimizer': _flat_optimizer_state(optimizer),
        'step_params': recorder.params,
        'lrs': recorder.lrs,
        'shadow': recorder.shadow,
        'train_metric': recorder.train_metric,
        'forward_sizes': model.forward_sizes,
        'timestamp': {'batch': int(ts.batch), 'sample': int(ts.sample), 'token': int(ts.token), 'epoch': int(ts.epoch)},
        # as callbacks read it during the fit (afterwards Composer's own, for this rank's loader, as without UnevenJoin)
        'dataloader_len': recorder.dataloader_lens[-1] if recorder.dataloader_lens else None,
        'reports': [vars(r).copy() for r in join.reports] if join is not None else [],
        'logged': {k: [v for _, v in vals] for k, vals in memory.data.items() if k.startswith('uneven_join/')},
        'log_lines': lines.lines,
        'collectives': counter.steps,
        'eval_params': recorder.eval_params,
        'eval': eval_logged(memory),
        'sample_ids': recorder.sample_ids,
    }


def _flat_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    state = optimizer.state_dict()['state']
    tensors = [v.flatten().float().cpu() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return torch.cat(tensors) if tensors else torch.zeros(0)


def torch_join(shards: list[int], batch_size: int, epochs: int, lr: float, divide: bool) -> dict[str, Any]:
    """A plain training loop with torch's own ``DistributedDataParallel.join``, one ``join()`` per epoch."""
    rank = dist.get_global_rank()
    module = make_module('mlp')
    on = devices.torch_device()
    module.to(on)
    ddp = DistributedDataParallel(module)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    x, y = (t.to(on) for t in shard(rank, shards[rank]))
    for _ in range(epochs):
        with ddp.join(divide_by_initial_world_size=divide):
            for i in range(0, len(y), batch_size):
                optimizer.zero_grad()
                F.cross_entropy(ddp(x[i : i + batch_size]), y[i : i + batch_size]).backward()
                optimizer.step()
    return {'params': {k: v.detach().cpu().clone() for k, v in module.named_parameters()}}
