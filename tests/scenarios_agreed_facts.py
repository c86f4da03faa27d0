"""Rank-side scenarios for tests/test_agreed_facts.py: facts one rank learned, that every rank decides from. Not a
test module.

* :func:`second_fit`: a model whose forward all-reduces (not marked ``shadow_forward``), a first ``fit()`` on even
  shards, then a second ``fit()`` on a new loader in which one rank has no sample at all (it shadows from step 0 and
  never runs a forward of this fit).
* :func:`resume`: ``toy.Branchy`` (``extra`` used by label-0 samples only, the short rank's) with
  ``find_unused_parameters`` and SGD with momentum; the uninterrupted run saves a checkpoint after every batch, the
  resumed one loads the checkpoint of a batch after the short rank's data ended.

``cfg['join']`` False: the same with stock Composer (no UnevenJoin), for the stock column.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import UnevenInputsError, UnevenJoin
from rank_scenarios import AsksForUnusedParameters, ToyModel, make_loader, quiet_trainer
from scenarios_inert import InertModel
from scenarios_resume import checkpoint
from scenarios_unused import Ids, StepIds


def _algorithms(cfg: dict, *more: Any) -> list[Any]:
    return ([UnevenJoin()] if cfg.get('join', True) else []) + list(more)


def second_fit(cfg: dict) -> dict[str, Any]:
    """``fit()`` on ``cfg['first']`` shards, then ``fit()`` again on a new loader of ``cfg['second']`` shards."""
    import composer_join

    rank = dist.get_global_rank()
    model = InertModel('sumbn_unmarked')
    trainer = quiet_trainer(
        model=model,
        train_dataloader=make_loader({'shards': cfg['first'], 'batch_size': 8}, rank),
        max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=_algorithms(cfg),
    )
    out: dict[str, Any] = {'module': composer_join.__file__, 'errors': [], 'steps': []}
    try:
        for i, shards in enumerate((cfg['first'], cfg['second'])):
            start = time.monotonic()
            try:
                if i == 0:
                    trainer.fit()
                else:
                    loader = make_loader({'shards': shards, 'batch_size': 8}, rank)
                    trainer.fit(train_dataloader=loader, duration='1ep', reset_time=True)
                out['errors'].append(None)
            except UnevenInputsError as e:
                out['errors'].append(str(e))
            except Exception as e:  # stock Composer, or the old code: the test shows it
                out['errors'].append(f'not UnevenInputsError: {type(e).__name__}: {e}')
                out['steps'].append((int(trainer.state.timestamp.batch), time.monotonic() - start))
                break
            out['steps'].append((int(trainer.state.timestamp.batch), time.monotonic() - start))
    finally:
        trainer.close()
    return out


def _branchy_fit(cfg: dict, **checkpointing: Any) -> dict[str, Any]:
    rank = dist.get_global_rank()
    dataset = Ids(rank, cfg['shards'][rank], uses_extra=rank == cfg['short'])
    model = ToyModel('branch')
    steps = StepIds()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=DataLoader(dataset, batch_size=4),
        max_duration='2ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        algorithms=_algorithms(cfg, AsksForUnusedParameters()),
        callbacks=[steps],
        **checkpointing,
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    return {
        'steps': steps.steps,
        'samples': int(trainer.state.timestamp.sample),
        'params': {k: v.detach().clone() for k, v in model.module.named_parameters()},
    }


def resume(cfg: dict, folder: str) -> dict[str, Any]:
    """The uninterrupted run (a checkpoint after every batch), and the run resumed from batch ``cfg['resume_at']``."""
    import composer_join

    full_dir = os.path.join(folder, 'full')
    full = _branchy_fit(cfg, save_folder=full_dir, save_interval='1ba', save_overwrite=True)
    dist.barrier()
    resumed = _branchy_fit(cfg, load_path=checkpoint(full_dir, cfg['resume_at']))
    return {'module': composer_join.__file__, 'full': full, 'resumed': resumed}


def stock(cfg: dict) -> dict[str, Any]:
    """The Branchy run with stock Composer (no UnevenJoin, no checkpoint)."""
    return _branchy_fit({**cfg, 'join': False})
