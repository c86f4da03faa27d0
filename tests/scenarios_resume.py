"""Rank-side scenarios for resumption: an uninterrupted run, then runs resumed from its checkpoints.

Every sample carries an id (``rank * 1000 + index`` for per-rank shards, the dataset index for a
map-style dataset), so the test can check that the resumed run trains exactly the samples the
uninterrupted run trained after the checkpoint, step by step. Not a test module.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

import torch
from composer import Callback, Trainer
from composer.utils import dist
from torch.utils.data import DataLoader, DistributedSampler

import devices
from composer_join import ExactDistributedSampler, SampleCountPosition, UnevenJoin, is_shadow_step, register_position
from rank_scenarios import (
    AsksForUnusedParameters,
    IdShard,
    Indexed,
    SizedIdShard,
    ToyModel,
    _flat_optimizer_state,
    make_optimizer,
)
from toy import shard


class SelfResuming(SizedIdShard):
    """Resumes itself through Composer's protocol, as StreamingDataset does: Composer does not spin it.

    ``state_dict(num_samples, from_beginning)`` records how many samples of the epoch were trained;
    the first iteration after ``load_state_dict`` starts after them.
    """

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self.skip = 0
        self.saved: list[int] = []  # every num_samples Composer handed us (through UnevenJoin)

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, int]:
        self.saved.append(num_samples)
        return {'sample_in_epoch': num_samples if from_beginning else self.skip + num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state['sample_in_epoch']

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return iter(list(zip(self.x, self.y, self.ids))[skip:])


register_position(SelfResuming, SampleCountPosition)  # Composer's protocol, each rank its own shard


class UnevenShuffled(DistributedSampler):
    """A ``DistributedSampler`` subclass that reshuffles every epoch and gives rank ``r`` ``perm[cuts[r]:cuts[r+1]]``."""

    def __init__(self, dataset, cuts: list[int], seed: int = 5):
        super().__init__(dataset, shuffle=True, seed=seed)
        self.cuts = cuts
        self.total_size = len(dataset)
        self.num_samples = cuts[self.rank + 1] - cuts[self.rank]

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(len(self.dataset), generator=g).tolist()
        return iter(perm[self.cuts[self.rank] : self.cuts[self.rank + 1]])

    def __len__(self) -> int:
        return self.num_samples


def make_loader(cfg: dict, rank: int):
    kind, b = cfg['data'], cfg['batch_sizes'][rank] if 'batch_sizes' in cfg else cfg['batch_size']
    if kind in ('shuffled_subclass', 'exact_sampler'):
        dataset = Indexed(*shard(7, cfg['map_size']))
        sampler = (
            UnevenShuffled(dataset, cfg['cuts'])
            if kind == 'shuffled_subclass'
            else ExactDistributedSampler(dataset, shuffle=True, seed=3)
        )
        return DataLoader(dataset, batch_size=b, sampler=sampler)
    dataset = {'sized': SizedIdShard, 'unsized': IdShard, 'self_resuming': SelfResuming}[kind](
        rank, cfg['shards'][rank]
    )
    return DataLoader(dataset, batch_size=b)


class Ids(Callback):
    """Per global step, the ids of the real samples this rank trained (over all microbatches)."""

    def __init__(self):
        self.ids: dict[int, list[int]] = {}

    def before_forward(self, state, logger):
        if not is_shadow_step(state):
            self.ids.setdefault(int(state.timestamp.batch), []).extend(int(i) for i in state.batch[2])


class Interrupted(Exception):
    pass


class InterruptAt(Callback):
    """Raises on every rank when step ``batch`` is about to start (its checkpoint is saved): a crash, for autoresume."""

    def __init__(self, batch: int):
        self.batch = batch

    def batch_start(self, state, logger):
        if int(state.timestamp.batch) == self.batch:
            raise Interrupted(f'interrupted before step {self.batch}')


def fit(cfg: dict, **kwargs) -> dict[str, Any]:
    rank = dist.get_global_rank()
    model = ToyModel('mlp')
    optimizer = make_optimizer(cfg, model.parameters())
    join, ids = UnevenJoin(**cfg.get('join', {})), Ids()
    if cfg.get('wrapper'):  # FSDP1/FSDP2 (tests/scenarios_fsdp.py): sharded checkpoints
        from scenarios_fsdp import cpu_fsdp_workarounds, parallelism

        cpu_fsdp_workarounds()
        kwargs['parallelism_config'] = parallelism(cfg['wrapper'], cfg)
    loader = make_loader(cfg, rank)
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        optimizers=optimizer,
        max_duration=cfg.get('max_duration', f'{cfg.get("epochs", 2)}ep'),
        algorithms=[join] + ([AsksForUnusedParameters()] if cfg.get('find_unused') else []),
        callbacks=[ids] + kwargs.pop('callbacks', []),
        device=devices.trainer_device(),
        progress_bar=False,
        log_to_console=False,
        seed=0,
        device_train_microbatch_size=cfg.get('microbatch'),
        ddp_sync_strategy=cfg.get('sync'),
        **kwargs,
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    ts = trainer.state.timestamp
    dataset = loader.dataset
    if cfg.get('wrapper'):
        from scenarios_fsdp import full_params

        params = full_params(trainer, 'mlp')
    else:
        params = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    return {
        'params': params,
        'optimizer': _flat_optimizer_state(optimizer) if not cfg.get('wrapper') else _local_optimizer_state(optimizer),
        'timestamp': {
            k: int(getattr(ts, k)) for k in ('epoch', 'batch', 'sample', 'token', 'batch_in_epoch', 'sample_in_epoch')
        },
        'ids': ids.ids,
        'reports': [vars(r).copy() for r in join.reports],
        'dataset_counts': getattr(dataset, 'saved', None),
    }


def _local_optimizer_state(optimizer) -> torch.Tensor:
    """This rank's shard of the optimizer state, flat (FSDP keeps DTensors)."""
    state = optimizer.state_dict()['state']
    tensors = [
        (v.to_local() if hasattr(v, 'to_local') else v).flatten().float().cpu()
        for s in state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    return torch.cat(tensors) if tensors else torch.zeros(0)


def checkpoint(folder: str, batch: int) -> str:
    found = glob.glob(os.path.join(folder, f'ep*-ba{batch}-rank0.pt')) or glob.glob(
        os.path.join(folder, f'ep*-ba{batch}')
    )  # a sharded checkpoint is a folder
    assert len(found) == 1, (folder, batch, found)
    return found[0]


def resume_cases(cfg: dict, folder: str) -> dict[str, Any]:
    """The uninterrupted run (checkpoint every batch), then one run resumed with ``load_path`` per
    ``cfg['resume_at']`` batch, one per checkpoint of ``cfg['saved_by_0_1_0']`` (``{batch: path}``, written
    by an earlier release), and one autoresume after a crash per ``cfg['autoresume_at']``."""
    full_dir = os.path.join(folder, 'full')
    out: dict[str, Any] = {'full': fit(cfg, save_folder=full_dir, save_interval='1ba')}
    for b in cfg.get('resume_at', []):
        out[f'load_path@{b}'] = fit(cfg, load_path=checkpoint(full_dir, b))
    for b, path in cfg.get('saved_by_0_1_0', {}).items():  # a checkpoint an earlier release wrote
        out[f'saved_by_0_1_0@{b}'] = fit(cfg, load_path=path)
    for b in cfg.get('autoresume_at', []):
        auto_dir = os.path.join(folder, f'auto{b}')
        common = dict(save_folder=auto_dir, save_interval='1ba', autoresume=True, run_name=f'auto{b}')
        error: Optional[str] = None
        try:
            fit(cfg, callbacks=[InterruptAt(b)], **common)
        except Interrupted as e:
            error = str(e)
        assert error is not None, 'the interrupted run was not interrupted'
        out[f'autoresume@{b}'] = fit(cfg, **common)
    return out
