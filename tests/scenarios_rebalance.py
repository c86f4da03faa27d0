"""What the ranks of tests/test_rebalance.py run: fits with ``UnevenJoin(mode='rebalance')``. Not a test module."""

from __future__ import annotations

import logging
from typing import Any

import torch
from composer import Callback
from composer.loggers import InMemoryLogger
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import ExactDistributedSampler, UnevenJoin, is_shadow_step
from rank_scenarios import (
    AsksForUnusedParameters,
    Indexed,
    LogLines,
    ShardWithLen,
    ToyModel,
    error_if_expected,
    make_loader,
    make_optimizer,
    quiet_trainer,
)
from toy import shard, unpack


class SkewedSampler(ExactDistributedSampler):
    """An uneven map-style sampler: rank ``r`` takes the ``r``-th of consecutive pieces of ``sizes`` samples
    of the epoch's permutation (shuffled as ExactDistributedSampler shuffles it)."""

    def __init__(self, dataset, sizes: list[int], seed: int = 3):
        super().__init__(dataset, shuffle=True, seed=seed)
        self.sizes = sizes
        self.num_samples = sizes[self.rank]

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        start = sum(self.sizes[: self.rank])
        return iter(torch.randperm(len(self.dataset), generator=g)[start : start + self.sizes[self.rank]].tolist())

    def __len__(self) -> int:
        return self.sizes[self.rank]


class Trained(Callback):
    """Per step on this rank: what ``state.batch`` holds at ``BATCH_START`` (the batch this rank trains), and more."""

    def __init__(self):
        self.steps: list[dict[str, Any]] = []  # one per step of every epoch
        self.params: list[torch.Tensor] = []

    def batch_start(self, state, logger):
        batch = state.batch
        x, y = unpack(batch)
        self.steps.append(
            {
                'epoch': int(state.timestamp.epoch),
                'shadow': is_shadow_step(state),
                'size': len(y),
                'first_x': x[0].cpu().clone() if len(y) else None,
                'ids': [int(i) for i in batch[2]] if isinstance(batch, (tuple, list)) and len(batch) == 3 else None,
                'text': list(batch['text']) if isinstance(batch, dict) and 'text' in batch else None,
                'dataloader_len': None if state.dataloader_len is None else int(state.dataloader_len),
            }
        )

    def batch_end(self, state, logger):
        self.params.append(torch.cat([p.detach().cpu().flatten().clone() for p in state.model.parameters()]))


def _loader(cfg: dict, rank: int):
    if cfg.get('fmt') == 'lambdas':  # dict batches that also hold something pickle refuses (deepcopy does not)

        def collate(samples):
            return {
                'x': torch.stack([s[0] for s in samples]),
                'y': torch.stack([s[1] for s in samples]),
                'hooks': [lambda: None for _ in samples],
            }

        dataset = ShardWithLen(*shard(rank, cfg['shards'][rank]))
        return DataLoader(dataset, batch_size=cfg['batch_size'], collate_fn=collate)
    if cfg.get('dataset') == 'skewed':
        dataset = Indexed(*shard(7, sum(cfg['shards'])))
        return DataLoader(dataset, batch_size=cfg['batch_size'], sampler=SkewedSampler(dataset, cfg['shards']))
    return make_loader(cfg, rank)


def train(cfg: dict) -> dict[str, Any]:
    """One Composer fit on this rank's shard with ``UnevenJoin(**cfg['join'])``; see tests/test_rebalance.py."""
    rank = dist.get_global_rank()
    model = ToyModel(cfg.get('model', 'mlp'))
    optimizer = make_optimizer(cfg, model.parameters())
    join = UnevenJoin(**cfg['join'])
    trained, memory, lines = Trained(), InMemoryLogger(), LogLines()
    logging.getLogger('composer_join').addHandler(lines)
    logging.getLogger('composer_join').setLevel(logging.INFO)
    trainer = quiet_trainer(
        model=model,
        train_dataloader=_loader(cfg, rank),
        max_duration=cfg.get('max_duration', f'{cfg.get("epochs", 1)}ep'),
        optimizers=optimizer,
        algorithms=[join] + ([AsksForUnusedParameters()] if cfg.get('find_unused') else []),
        callbacks=[trained],
        loggers=[memory],
        device_train_microbatch_size=cfg.get('microbatch'),
        ddp_sync_strategy=cfg.get('sync'),
    )
    try:  # with second_fit: fit() again on the same trainer, one more epoch
        error = error_if_expected(cfg, lambda: (trainer.fit(), cfg.get('second_fit') and trainer.fit(duration='1ep')))
    finally:
        trainer.close()
        logging.getLogger('composer_join').removeHandler(lines)
    return {
        **fit_result(error, model, trainer, join, trained, lines),
        # as callbacks read it during the fit (afterwards Composer's own, for this rank's loader, as without UnevenJoin)
        'dataloader_len': trained.steps[-1]['dataloader_len'] if trained.steps else None,
        'logged': {k: [v for _, v in vals] for k, vals in memory.data.items() if k.startswith('uneven_join/')},
    }


def fitted(cfg: dict, trainer: Any, model: Any, join: Any, trained: Any, lines: Any) -> dict[str, Any]:
    """``trainer.fit()`` (an expected ``UnevenInputsError`` kept, see ``error_if_expected``), then close the
    trainer, detach ``lines`` from composer_join's logger and return :func:`fit_result`."""
    try:
        error = error_if_expected(cfg, trainer.fit)
    finally:
        trainer.close()
        logging.getLogger('composer_join').removeHandler(lines)
    return fit_result(error, model, trainer, join, trained, lines)


def fit_result(error: Any, model: Any, trainer: Any, join: Any, trained: Any, lines: Any) -> dict[str, Any]:
    """What every rebalancing scenario returns: error, weights, per-step records, timestamp, reports, log lines."""
    ts = trainer.state.timestamp
    return {
        'error': error,
        'params': {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()},
        'steps': trained.steps,
        'step_params': trained.params,
        'timestamp': {'batch': int(ts.batch), 'sample': int(ts.sample), 'epoch': int(ts.epoch)},
        'reports': [vars(r).copy() for r in join.reports],
        'log_lines': lines.lines,
    }
