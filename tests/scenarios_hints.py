"""What the ranks of tests/test_len_hints.py run: fits on real torch DataLoaders with worker processes. Not a test module.

Every sample is ``(x, y, id)`` with ``id = 1000 * owner + index``; a rank's shard is an ``IterableDataset``
split among the DataLoader's workers the usual way (worker ``w`` of ``n`` reads samples ``w, w + n, ...``),
with ``__len__`` the number of samples (so with two workers each ends with its own partial batch and
the loader yields more batches than its ``len()``), or without ``__len__``, or claiming ``claimed[rank]``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

from composer import Callback
from composer.core import Evaluator
from composer.loggers import InMemoryLogger
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from composer_join import UnevenJoin
from rank_scenarios import LogLines, ToyModel, make_optimizer, quiet_trainer
from scenarios_rebalance import Trained, fitted
from toy import shard

EVAL_SEED = 50  # eval shards are toy.shard(50 + rank, n), as reference.evaluate reads them


class Stream(IterableDataset):
    """``size`` samples of ``toy.shard(seed, size)``, ids ``1000 * owner + i``, split among the loader's workers."""

    def __init__(self, seed: int, owner: int, size: int):
        self.seed, self.owner, self.size = seed, owner, size

    def __iter__(self):
        x, y = shard(self.seed, self.size)
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(first, self.size, step):
            yield x[i], y[i], 1000 * self.owner + i


class SizedStream(Stream):
    """A :class:`Stream` with ``__len__``: its samples (``claimed``, if given)."""

    def __init__(self, seed: int, owner: int, size: int, claimed: Optional[int] = None):
        super().__init__(seed, owner, size)
        self.claimed = claimed

    def __len__(self) -> int:
        return self.size if self.claimed is None else self.claimed


class EpochGuard(Callback):
    """Stops a fit that runs more epochs than ``most`` (the endless loop of empty epochs the old code ran)."""

    def __init__(self, most: int):
        self.most = most

    def epoch_end(self, state, logger):
        if int(state.timestamp.epoch) > self.most:
            raise RuntimeError(f'{int(state.timestamp.epoch)} epochs run, more than the {self.most} asked for')


def loader(cfg: dict, dataset: IterableDataset, batch_size: int) -> DataLoader:
    workers = cfg.get('workers', 2)
    extra: dict[str, Any] = {}
    if workers:
        extra = dict(persistent_workers=cfg.get('persistent', True), prefetch_factor=4, multiprocessing_context='fork')
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers, **extra)


def train(cfg: dict) -> dict[str, Any]:
    """One fit on this rank's shard with ``UnevenJoin(**cfg.get('join', {}))``, evaluating after every epoch."""
    rank = dist.get_global_rank()
    claimed = cfg.get('claimed', {}).get(rank)
    sized = cfg.get('sized', True)
    dataset = (
        SizedStream(rank, rank, cfg['shards'][rank], claimed) if sized else Stream(rank, rank, cfg['shards'][rank])
    )
    evaluator = None
    if cfg.get('eval_shards'):
        eval_set = SizedStream(EVAL_SEED + rank, rank, cfg['eval_shards'][rank])
        evaluator = Evaluator(
            label='eval',
            dataloader=loader(cfg, eval_set, cfg.get('eval_batch_size', 2)),
            metric_names=['MulticlassAccuracy', 'MeanLoss'],
        )
    model = ToyModel('mlp')
    join = UnevenJoin(**cfg.get('join', {}))
    trained, memory, lines = Trained(), InMemoryLogger(), LogLines()
    logging.getLogger('composer_join').addHandler(lines)
    trainer = quiet_trainer(
        model=model,
        train_dataloader=loader(cfg, dataset, cfg['batch_size']),
        max_duration=cfg.get('max_duration', f'{cfg.get("epochs", 1)}ep'),
        optimizers=make_optimizer(cfg, model.parameters()),
        algorithms=[join],
        callbacks=[trained, EpochGuard(cfg.get('most_epochs', 4))],
        loggers=[memory],
        eval_dataloader=evaluator,
        eval_interval='1ep',
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        result = fitted(cfg, trainer, model, join, trained, lines)
    return {
        **result,
        'eval': {
            k.split('/')[-1]: [float(v) for _, v in vals]
            for k, vals in memory.data.items()
            if k.startswith('metrics/eval/')
        },
        'warnings': [str(w.message) for w in caught if 'len()' in str(w.message)],
    }
