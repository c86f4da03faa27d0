"""Rank-side scenarios for tests/test_elastic.py: save mid-epoch on one world size, resume on another. Not a test module.

Every sample is an id into ``pipeline_data``'s pool (a map-style ``IdMap`` of ``size`` ids, batches ``(x, y, ids)``),
sharded by ``ExactDistributedSampler`` or torch's ``DistributedSampler`` (as ``sampler=``, or in a ``BatchSampler``
given as ``batch_sampler=``). :func:`save` fits 2 epochs with a checkpoint after every batch; :func:`resume` fits
from one of them, to the same 2 epochs; both record, per step, its epoch, the world size and the ids this rank
trained. :func:`stock_save` and :func:`stock_resume` do the same with stock Composer (no algorithm).
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Any

import torch
from composer import Callback
from composer.utils import dist
from torch.utils.data import DataLoader, DistributedSampler

from composer_join import ExactDistributedSampler, UnevenJoin, is_shadow_step
from pipeline_data import IdMap, collate_ids
from rank_scenarios import ToyModel, quiet_trainer
from scenarios_pipelines import stop_workers


class BatchesOf(DistributedSampler):
    """A ``DistributedSampler`` that yields its shard in batches (the last one partial), for ``batch_sampler=``
    (Composer looks at ``batch_sampler`` first: its own tests use one that drops the last partial batch)."""

    def __init__(self, dataset, batch_size: int, drop_tail: bool = False, **kwargs):
        super().__init__(dataset, **kwargs)
        self.batch_size, self.drop_tail = batch_size, drop_tail

    def __iter__(self):
        indices = list(super().__iter__())
        end = len(indices) - len(indices) % self.batch_size if self.drop_tail else len(indices)
        for i in range(0, end, self.batch_size):
            yield indices[i : i + self.batch_size]

    def __len__(self) -> int:
        n = self.num_samples
        return n // self.batch_size if self.drop_tail else -(-n // self.batch_size)


def make_loader(cfg: dict) -> DataLoader:
    """This rank's loader over the ``size`` ids, sharded by ``cfg['sampler']`` for the current world size."""
    if cfg['sampler'] == 'streaming':  # mosaicml-streaming: one global sample space, split by the dataset itself
        from scenarios_pipelines import make_loader as pipeline_loader

        return pipeline_loader('streaming', [cfg['size']], 0, dict(cfg, batch_size=cfg['batch_size']), cfg['data'])
    dataset = IdMap(0, cfg['size'])
    shuffle, seed = cfg.get('shuffle', True), 3
    if cfg['sampler'] == 'exact':
        sampler = ExactDistributedSampler(dataset, shuffle=shuffle, seed=seed)
    else:
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed)
    workers = dict(num_workers=2, persistent_workers=False) if cfg.get('workers') else {}
    if cfg.get('batched'):  # a batch-yielding DistributedSampler, given as batch_sampler=
        batches = BatchesOf(
            dataset, cfg['batch_size'], drop_tail=cfg['batched'] == 'drop_tail', shuffle=shuffle, seed=seed
        )
        return DataLoader(dataset, batch_sampler=batches, collate_fn=collate_ids, **workers)
    return DataLoader(dataset, batch_size=cfg['batch_size'], sampler=sampler, collate_fn=collate_ids, **workers)


class Steps(Callback):
    """Per global step: ``(epoch, world size, ids this rank trained)`` (none on a shadow step)."""

    def __init__(self):
        self.steps: dict[int, tuple[int, int, list[int]]] = {}

    def before_forward(self, state, logger):
        step = int(state.timestamp.batch)
        _, _, ids = self.steps.setdefault(step, (int(state.timestamp.epoch), dist.get_world_size(), []))
        if not is_shadow_step(state):
            ids.extend(int(i) for i in state.batch[2])


def _fit(cfg: dict, join: bool, **kwargs) -> dict[str, Any]:
    model = ToyModel('mlp')
    loader = make_loader(cfg)
    steps = Steps()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=loader,
        max_duration='2ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        algorithms=[UnevenJoin(mode=cfg.get('mode', 'shadow'))] if join else [],
        callbacks=[steps],
        # a batch_sampler= DataLoader has no batch_size for Composer to take the microbatch size from
        **({'device_train_microbatch_size': cfg['batch_size']} if cfg.get('batched') else {}),
        **({'train_subset_num_batches': cfg['subset']} if cfg.get('subset') else {}),
        **kwargs,
    )
    error = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            if cfg.get('pieces') and 'load_path' in kwargs:  # resumed one batch per fit(): each takes up the last
                while int(trainer.state.timestamp.epoch) < 2:
                    trainer.fit(duration='1ba')
            else:
                trainer.fit()
    except Exception as e:  # stock Composer's outcome, or a refusal the test checks
        if join and not cfg.get('expect_error'):
            raise
        error = (type(e).__name__, str(e))
    finally:
        trainer.close()
        stop_workers(loader)
    return {
        'steps': steps.steps,
        'params': {k: v.detach().clone() for k, v in model.module.named_parameters()},
        'error': error,
        'warnings': [str(w.message) for w in caught if 'UnevenJoin' in str(w.message)],
    }


def save(cfg: dict, folder: str, join: bool = True) -> dict[str, Any]:
    """2 epochs on this world size, a checkpoint after every batch into ``folder``."""
    return _fit(cfg, join, save_folder=folder, save_interval='1ba')


def resume(cfg: dict, folder: str, batch: int, join: bool = True, save_folder: str = '') -> dict[str, Any]:
    """2 epochs from the checkpoint after global batch ``batch`` in ``folder`` (saved by another world size);
    with ``save_folder``, a checkpoint after every batch there too."""
    [path] = glob.glob(os.path.join(folder, f'ep*-ba{batch}-rank0.pt'))
    saving = dict(save_folder=save_folder, save_interval='1ba') if save_folder else {}
    return _fit(cfg, join, load_path=path, **saving)
