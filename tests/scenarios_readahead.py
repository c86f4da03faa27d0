"""What the ranks of tests/test_rebalance_unsized.py run: ``mode='rebalance'`` fits where some or all
ranks' dataloaders have no ``len()``. Not a test module.

Every sample carries an id (``rank * 1000 + index``), so the test can tell which rank's batch a
rank trained at every step. Composer refuses ``max_duration`` in epochs when a dataloader has no
``len()``, so the fits run for the epochs' samples (``'<n>sp'``).
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any, Optional

import torch
from composer import Callback, Trainer
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import SampleCountPosition, UnevenJoin, is_shadow_step, register_position
from rank_scenarios import IdShard, LogLines, SizedIdShard, ToyModel, make_optimizer, quiet_trainer
from scenarios_rebalance import fitted


class ResumingIdShard(IdShard):
    """An unsized shard that resumes itself through Composer's protocol (registered with ``SampleCountPosition``):
    after ``load_state_dict`` its next iteration skips the samples the state says were used."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict:
        return {'sample_in_epoch': num_samples}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state['sample_in_epoch']

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for i, sample in enumerate(super().__iter__()):
            if i >= skip:
                yield sample


register_position(ResumingIdShard, SampleCountPosition)


def make_loader(cfg: dict, rank: int) -> DataLoader:
    unsized = cfg.get('unsized', 'all')
    cls = IdShard if unsized == 'all' or rank in unsized else SizedIdShard
    cls = ResumingIdShard if cfg.get('resumes_itself') else cls
    dataset = cls(rank, cfg['shards'][rank], cfg.get('fail_at', {}).get(rank))
    if cfg.get('fmt') == 'local_dict':  # batches that pickle refuses (a class it cannot import), deepcopy does not

        class LocalDict(dict):
            pass

        def collate(samples):
            return LocalDict(
                x=torch.stack([s[0] for s in samples]),
                y=torch.stack([s[1] for s in samples]),
                ids=torch.tensor([s[2] for s in samples]),
            )

        return DataLoader(dataset, batch_size=cfg['batch_size'], collate_fn=collate)
    return DataLoader(dataset, batch_size=cfg['batch_size'])


class Trained(Callback):
    """Per step on this rank: the ids it trains (None on a shadow step), the parameters after it, the lr."""

    def __init__(self, join: Optional[UnevenJoin] = None):
        self.steps: list[dict[str, Any]] = []
        self.params: list[torch.Tensor] = []
        self.join = join

    def batch_start(self, state, logger):
        shadow = is_shadow_step(state)
        plan = self.join.plan if self.join is not None else None
        self.steps.append(
            {
                'epoch': int(state.timestamp.epoch),
                'batch': int(state.timestamp.batch),
                'agreed': None if plan is None else plan.agreed,  # whether the ranks exchanged rows at this step
                'ids': None
                if shadow
                else [int(i) for i in (state.batch['ids'] if isinstance(state.batch, dict) else state.batch[2])],
            }
        )

    def batch_end(self, state, logger):
        self.params.append(torch.cat([p.detach().cpu().flatten().clone() for p in state.model.parameters()]))


def fit(cfg: dict, **kwargs) -> dict[str, Any]:
    """One fit on this rank's shard with ``UnevenJoin(mode='rebalance')``; see tests/test_rebalance_unsized.py."""
    rank = dist.get_global_rank()
    model = ToyModel('mlp')
    optimizer = make_optimizer(cfg, model.parameters())
    join = UnevenJoin(**{'mode': 'rebalance', **cfg.get('join', {})})
    trained, lines = Trained(join), LogLines()
    logging.getLogger('composer_join').addHandler(lines)
    logging.getLogger('composer_join').setLevel(logging.INFO)
    loader = make_loader(cfg, rank)
    trainer = quiet_trainer(
        model=model,
        train_dataloader=loader,
        optimizers=optimizer,
        max_duration=cfg.get('max_duration', f'{sum(cfg["shards"]) * cfg.get("epochs", 1)}sp'),
        algorithms=[join],
        callbacks=[trained] + kwargs.pop('callbacks', []),
        device_train_microbatch_size=cfg.get('microbatch'),
        ddp_sync_strategy=cfg.get('sync'),
        **kwargs,
    )
    return {
        **fitted(cfg, trainer, model, join, trained, lines),
        'peak_held': getattr(join.train_loader.source, 'peak_held', None),
        'loader': type(join.train_loader.source).__name__,
    }


def train(cfg: dict) -> dict[str, Any]:
    return fit(cfg)


def resume(cfg: dict, folder: str) -> dict[str, Any]:
    """The uninterrupted run (a checkpoint every batch), then one run resumed from each ``cfg['resume_at']`` batch."""
    full_dir = os.path.join(folder, 'full')
    out = {'full': fit(cfg, save_folder=full_dir, save_interval='1ba')}
    for b in cfg['resume_at']:
        [path] = glob.glob(os.path.join(full_dir, f'ep*-ba{b}-rank0.pt'))
        out[f'resumed@{b}'] = fit(cfg, load_path=path)
    return out


class _Recorded:
    """This rank's own dataloader without ``len()``, keeping every batch it yields (for the test's replay)."""

    def __init__(self, loader):
        self.loader, self.yielded = loader, []

    def __iter__(self):
        for batch in self.loader:
            self.yielded.append(tuple(t.clone() for t in batch))
            yield batch


class TrainedText(Callback):
    """Per step: this rank's batch (None if shadow) and the learning rate it steps with."""

    def __init__(self):
        self.steps: list[dict[str, Any]] = []

    def batch_start(self, state, logger):
        self.steps.append(
            {
                'batch': None if is_shadow_step(state) else tuple(t.clone() for t in state.batch),
                'lr': state.optimizers[0].param_groups[0]['lr'],
            }
        )


def text_token_budget(overrides: list[str]) -> dict[str, Any]:
    """configs/text_token_budget.yaml with ``overrides``, its train shard without ``len()``, for one epoch of samples."""
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    from composer_join.config.config import build_one, load_config, trainer_kwargs

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / 'examples'))
    from data import DATASETS
    from models import MODELS

    cfg = OmegaConf.to_container(load_config(root / 'configs' / 'text_token_budget.yaml', overrides))
    # Without len(), max_duration is in samples, and Composer wants the warmup in the same unit.
    cfg['schedulers'] = [{'linear_with_warmup_scheduler': {'t_warmup': '100sp'}}]
    torch.manual_seed(0)
    model = build_one(MODELS, cfg.get('model'), 'model')
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    kwargs = trainer_kwargs(cfg, model.parameters(), sections=('data', 'model'))
    loaders = build_one(DATASETS, cfg.get('data'), 'data')
    own = _Recorded(loaders.train)
    samples = torch.tensor([sum(len(b[0]) for b in loaders.train.dataset.batches)])
    dist.all_reduce(samples)  # the epoch's samples over all ranks: Composer wants no epochs without len()
    kwargs.update(max_duration=f'{int(samples)}sp', eval_interval=1)
    recorder = TrainedText()
    kwargs.update(progress_bar=False, log_to_console=False)
    trainer = Trainer(model=model, train_dataloader=own, callbacks=[recorder], **kwargs)
    try:
        trainer.fit()
    finally:
        trainer.close()
    join = next(a for a in kwargs['algorithms'] if isinstance(a, UnevenJoin))
    return {
        'init': init,
        'own': own.yielded,
        'steps': recorder.steps,
        'mode': join.mode,
        'params': {k: v.detach().clone() for k, v in model.named_parameters()},
        'loader': type(join.train_loader.source).__name__,
    }
