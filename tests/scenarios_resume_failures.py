"""Rank-side scenarios for tests/test_resume_failures.py (issue 33): resumptions UnevenJoin gets wrong. Not a test module.

Every sample is an id into the fixed pool of ``tests/pipeline_data.py`` and every batch is ``(x, y, ids)``
(:func:`pipeline_data.collate_ids`), whatever the pipeline, so the test can check that every id is trained once
per epoch and replay every recorded step in one process. Each run returns, per rank, the steps it trained
(``{global step: (epoch, ids)}``, shadow steps with no ids), its final weights and timestamp, and the
:class:`~composer_join.UnevenInputsError` (or :class:`NeverEnds`) it stopped with, if any (other exceptions reach
the harness):

* :func:`litdata_case`: a litdata ``StreamingDataset`` (written by the test) read by litdata's
  ``StreamingDataLoader`` or by a torch ``DataLoader``, trained uninterrupted, then resumed mid-epoch;
* :func:`hf_read_before_fit`: a Hugging Face ``IterableDataset`` read before ``fit()`` (one example peeked, or
  every row counted), trained uninterrupted with a checkpoint after every batch, then resumed from the one of
  epoch 0's last batch (with ``save_interval='1ba'`` Composer writes no other at an epoch's end: its
  ``EPOCH_CHECKPOINT`` save is skipped for a batch already saved);
* :func:`save_for_resize` / :func:`resume_resized`: a map-style dataset split unevenly for each world size, one
  epoch with a checkpoint after every batch, resumed from one of them on another number of ranks.

Ranks are rotated by ``cfg['rotate']`` (``k``): rank ``r`` reads what rank ``(r + k) % W`` would read (litdata's
and Hugging Face's own split), or the part of rank ``(r - k) % W`` (:func:`part`, as ``tests/rank_orders.py``).
"""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

import torch
from composer import Callback
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import ExactDistributedSampler, UnevenInputsError, UnevenJoin
from pipeline_data import IdMap, collate_ids
from rank_scenarios import ToyModel, quiet_trainer
from scenarios_pipelines import Trail
from scenarios_resume import UnevenShuffled


class NeverEnds(Exception):
    """A run that started more epochs than it has (its ``max_duration`` is never reached)."""


class EpochLimit(Callback):
    """The hard bound of a run of ``epochs`` epochs whose duration is in samples or batches: raises when a second
    epoch more than it has starts (one more may be a symptom the test reports better from the ids trained)."""

    def __init__(self, epochs: int):
        self.epochs = epochs

    def epoch_start(self, state, logger):
        ts = state.timestamp
        if int(ts.epoch) > self.epochs:
            raise NeverEnds(
                f'epoch {int(ts.epoch)} started (the run has {self.epochs}): max_duration {state.max_duration} not '
                f'reached after {int(ts.sample)} samples and {int(ts.batch)} batches'
            )


def fit(loader: Any, max_duration: str, mode: str = 'shadow', epochs: Optional[int] = None, **kwargs) -> dict[str, Any]:
    """One ``fit()`` with UnevenJoin (SGD, momentum 0.9, as ``test_pipelines.replay``); what it trained."""
    model = ToyModel('mlp')
    trail = Trail()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=loader,
        max_duration=max_duration,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        algorithms=[UnevenJoin(mode=mode)],
        callbacks=[trail] + ([EpochLimit(epochs)] if epochs is not None else []),
        **kwargs,
    )
    error: Optional[str] = None
    try:
        trainer.fit()
    except (UnevenInputsError, NeverEnds) as e:  # the test reports it
        error = f'{type(e).__name__}: {e}'
    finally:
        trainer.close()
    ts = trainer.state.timestamp
    return {
        'steps': trail.steps,
        'params': {k: v.detach().clone() for k, v in model.module.named_parameters()},
        'timestamp': {k: int(getattr(ts, k)) for k in ('epoch', 'batch', 'sample', 'batch_in_epoch')},
        'error': error,
    }


def checkpoint(folder: str, name: str) -> str:
    """The rank-0 file of checkpoint ``name`` (``ep<e>-ba<b>``) in ``folder``."""
    found = glob.glob(os.path.join(folder, f'{name}-rank0.pt'))
    assert len(found) == 1, (folder, name, sorted(os.listdir(folder)))
    return found[0]


def ids_of(loader: DataLoader) -> list[int]:
    """The ids one epoch of ``loader`` yields (a loader of its own: the run's is not touched)."""
    return [int(i) for batch in loader for i in batch[2]]


# -- 1. litdata -----------------------------------------------------------------------------------------------


def litdata_loader(cfg: dict, data: str) -> DataLoader:
    """The litdata dataset at ``data`` in ``cfg['loader']`` (``'litdata'``: ``StreamingDataLoader``; ``'torch'``).

    ``drop_last=False``: litdata keeps every sample, and its split across ranks may be uneven.
    """
    import litdata
    from litdata.utilities.env import _DistributedEnv

    dataset = litdata.StreamingDataset(input_dir=data, drop_last=False)
    if cfg['rotate']:  # rank r reads the part litdata gives rank (r + k) % W
        env = dataset.distributed_env
        dataset.distributed_env = _DistributedEnv(
            env.world_size, (env.global_rank + cfg['rotate']) % env.world_size, env.num_nodes
        )
    kind = litdata.StreamingDataLoader if cfg['loader'] == 'litdata' else DataLoader
    return kind(dataset, batch_size=cfg['batch_size'], collate_fn=collate_ids)


def litdata_case(cfg: dict, folder: str, data: str) -> dict[str, Any]:
    """This rank's part of the data (read once on its own), the uninterrupted run with a checkpoint after every
    batch, and the run resumed from checkpoint ``cfg['resume_at']``."""
    out: dict[str, Any] = {'part': ids_of(litdata_loader(cfg, data))}
    full = os.path.join(folder, 'full')
    duration = f'{cfg["epochs"]}ep'
    out['full'] = fit(litdata_loader(cfg, data), duration, cfg['mode'], save_folder=full, save_interval='1ba')
    out['resumed'] = fit(litdata_loader(cfg, data), duration, cfg['mode'], load_path=checkpoint(full, cfg['resume_at']))
    return out


# -- 2. Hugging Face IterableDataset read before fit() -----------------------------------------------------------


def hf_dataset(cfg: dict) -> Any:
    """``cfg['size']`` ids in ``cfg['num_shards']`` shards, split over the ranks by ``split_dataset_by_node``."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    rank, world = dist.get_global_rank(), dist.get_world_size()
    table = datasets.Dataset.from_dict({'id': list(range(cfg['size']))})
    full = table.to_iterable_dataset(num_shards=cfg['num_shards'])
    return split_dataset_by_node(full, rank=(rank + cfg['rotate']) % world, world_size=world)


def hf_loader(cfg: dict) -> DataLoader:
    """This rank's dataset, read before ``fit()`` as ``cfg['read']`` says: ``'peek'`` (one example), ``'count'``
    (every row)."""
    dataset = hf_dataset(cfg)
    if cfg['read'] == 'peek':
        next(iter(dataset))
    else:
        sum(1 for _ in dataset)
    return DataLoader(dataset, batch_size=cfg['batch_size'], collate_fn=collate_ids)


def hf_read_before_fit(cfg: dict, folder: str) -> dict[str, Any]:
    """This rank's part (read on its own), the uninterrupted run, and one resumed run per ``cfg['resume_from']``."""
    out: dict[str, Any] = {'part': ids_of(DataLoader(hf_dataset(cfg), batch_size=1, collate_fn=collate_ids))}
    full = os.path.join(folder, 'full')
    epochs = cfg['epochs']
    out['full'] = fit(hf_loader(cfg), cfg['max_duration'], epochs=epochs, save_folder=full, save_interval='1ba')
    for name in cfg['resume_from']:
        out[name] = fit(hf_loader(cfg), cfg['max_duration'], epochs=epochs, load_path=checkpoint(full, name))
    return out


# -- 3, 4. checkpoints resumed on another world size -------------------------------------------------------------


def part(cfg: dict, world: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s part of the permutation, ``cfg['parts'][world]`` rotated by ``rotate``."""
    sizes = cfg['parts'][world]
    moved = [sizes[(i - cfg['rotate']) % world] for i in range(world)]
    return sum(moved[:rank]), sum(moved[: rank + 1])


def resize_loader(cfg: dict) -> DataLoader:
    """``cfg['size']`` ids, reshuffled every epoch; ``sampler='exact'``: ``ExactDistributedSampler`` (seed 3),
    ``'uneven'``: :class:`UnevenShuffled` (seed 5) with this world size's parts (:func:`part`)."""
    world = dist.get_world_size()
    dataset = IdMap(0, cfg['size'])
    if cfg['sampler'] == 'exact':
        sampler: Any = ExactDistributedSampler(dataset, shuffle=True, seed=3)
    else:
        sampler = UnevenShuffled(dataset, [0] + [part(cfg, world, r)[1] for r in range(world)])
    return DataLoader(dataset, batch_size=cfg['batch_size'], sampler=sampler, collate_fn=collate_ids)


def save_for_resize(cfg: dict, folder: str) -> dict[str, Any]:
    """One epoch on this world size, a checkpoint after every batch (``ep0-ba<b>``, the last one before
    ``EPOCH_END``)."""
    out = fit(resize_loader(cfg), '1ep', save_folder=folder, save_interval='1ba')
    out['checkpoints'] = sorted(os.listdir(folder))
    return out


def resume_resized(cfg: dict, folder: str, name: str) -> dict[str, Any]:
    """Checkpoint ``name`` of ``folder`` resumed on this world size, to the end of epoch 1."""
    return fit(resize_loader(cfg), '2ep', load_path=checkpoint(folder, name))
