"""Rank-side scenarios for tests/test_stock_parity.py: what Composer's own tests found UnevenJoin doing otherwise.

* :func:`batch_sampler_orders`: a ``DistributedSampler`` subclass passed as ``batch_sampler=`` (Composer's
  ``test_set_dataloaders_to_cur_epoch``), the ids each rank trains per epoch;
* :func:`shadow_warnings`: uneven shards with a train metric and an evaluator, every warning recorded (and,
  with ``error=True``, every warning an error, as in Composer's test configuration);
* :func:`save_for_resize` / :func:`resume_resized`: a checkpoint saved by some ranks, resumed by more;
* :func:`user_data_specs`: the user's own ``DataSpec`` for train and eval data (uneven), as it was after
  ``fit()``, ``eval()`` and ``predict()``, and still split right by a second ``fit()``.

Not a test module.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
from composer import Callback, Evaluator, Event, Trainer
from composer.core import DataSpec
from composer.utils import dist
from torch.utils.data import DataLoader, DistributedSampler

import devices
from composer_join import ExactDistributedSampler, UnevenInputsError, UnevenJoin, is_shadow_step
from rank_scenarios import Indexed, SizedIdShard, ToyModel
from scenarios_fsdp import cpu_fsdp_workarounds, parallelism
from toy import shard


class BatchDistributedSampler(DistributedSampler):
    """Composer's ``_DistributedBatchSampler`` (tests/trainer/test_checkpoint.py): a sampler that yields batches."""

    def __init__(self, dataset, batch_size: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self._batch_size = batch_size

    def __iter__(self):
        indices = list(super().__iter__())
        for i in range(len(self)):
            yield indices[i * self._batch_size : (i + 1) * self._batch_size]

    def __len__(self) -> int:
        return self.num_samples // self._batch_size


class EpochIds(Callback):
    """Per epoch, the ids of the real samples this rank trained, in order."""

    def __init__(self):
        self.ids: dict[int, list[int]] = {}

    def before_forward(self, state, logger):
        if not is_shadow_step(state):
            self.ids.setdefault(int(state.timestamp.epoch), []).extend(int(i) for i in state.batch[2])


def _trainer(loader, callbacks=(), **kwargs) -> Trainer:
    model = kwargs.pop('model', None) or ToyModel('mlp')
    return Trainer(
        model=model,
        train_dataloader=loader,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),  # Composer warns when it picks a default
        max_duration=kwargs.pop('max_duration', '2ep'),
        algorithms=[UnevenJoin()],
        callbacks=list(callbacks),
        device=devices.trainer_device(),
        progress_bar=False,
        log_to_console=False,
        seed=0,
        **kwargs,
    )


def batch_sampler_orders(size: int, batch_size: int, epochs: int) -> dict[str, Any]:
    """Train ``epochs`` epochs of a ``size``-sample dataset sharded by a batch-yielding ``DistributedSampler``."""
    dataset = Indexed(*shard(7, size))
    sampler = BatchDistributedSampler(dataset, batch_size, shuffle=True, drop_last=True)
    ids = EpochIds()
    loader = DataLoader(dataset, batch_sampler=sampler)  # no batch_size: Composer needs the microbatch size given
    trainer = _trainer(loader, [ids], max_duration=f'{epochs}ep', device_train_microbatch_size=batch_size)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return {'ids': ids.ids, 'sampler_epoch': sampler.epoch}


def shadow_warnings(shards: list[int], error: bool) -> dict[str, Any]:
    """Uneven per-rank datasets (``shards[rank]`` samples, each split by a ``DistributedSampler``, as in Composer's
    ``test_rank_dependent_dataloader_lengths``), a train metric and an eval set; every warning recorded.

    With ``error``, warnings are errors, as under Composer's ``filterwarnings = ['error', ...]``.
    """
    rank = dist.get_global_rank()
    train, evaluation = Indexed(*shard(rank, shards[rank])), Indexed(*shard(10 + rank, shards[rank]))
    loaders = [DataLoader(d, batch_size=4, sampler=DistributedSampler(d, shuffle=False)) for d in (train, evaluation)]
    ids = EpochIds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('error' if error else 'always')
        # what the harness's ranks and Composer's own test configuration leave out
        warnings.filterwarnings('ignore', category=DeprecationWarning)
        warnings.filterwarnings('ignore', message='.*(Deterministic mode|SubsetNumBatches|torch.cuda)')
        trainer = _trainer(
            loaders[0], [ids], model=ToyModel('mlp', train_metrics=True), eval_dataloader=loaders[1], max_duration='1ep'
        )
        try:
            trainer.fit()
        finally:
            trainer.close()
    return {
        'warnings': [f'{w.category.__name__}: {w.message}' for w in caught],
        'samples': int(trainer.state.timestamp.sample),
        'trained': sorted(ids.ids.get(0, [])),
    }


def resize_loader(size: int, batch_size: int) -> DataLoader:
    """A ``size``-sample map-style dataset sharded by ``ExactDistributedSampler`` for the current world size."""
    dataset = Indexed(*shard(7, size))
    return DataLoader(dataset, batch_size=batch_size, sampler=ExactDistributedSampler(dataset, shuffle=True, seed=3))


def save_for_resize(folder: str, size: int, batch_size: int) -> dict[str, Any]:
    """One epoch on this world size, checkpoints in ``folder`` after batch 2 (``ep0-ba2-rank0.pt``) and at the
    epoch's end (``ep1-ba<n>-rank0.pt``, an epoch boundary)."""
    ids = EpochIds()
    trainer = _trainer(
        resize_loader(size, batch_size),
        [ids],
        max_duration='1ep',
        save_folder=folder,
        save_interval=lambda state, event: event == Event.EPOCH_CHECKPOINT or int(state.timestamp.batch) == 2,
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    return {'ids': ids.ids, 'checkpoints': sorted(os.listdir(folder))}


def resume_resized(folder: str, checkpoint: str, size: int, batch_size: int) -> dict[str, Any]:
    """Resume ``folder/checkpoint`` on this world size for one more epoch; the error (type, message) if it raises."""
    ids = EpochIds()
    trainer = _trainer(
        resize_loader(size, batch_size), [ids], max_duration='2ep', load_path=os.path.join(folder, checkpoint)
    )
    error: Optional[tuple[str, str]] = None
    try:
        trainer.fit()
    except UnevenInputsError as e:
        error = (type(e).__name__, str(e))
    finally:
        trainer.close()
    join = trainer.state.algorithms[0]
    assert isinstance(join, UnevenJoin)
    ts = trainer.state.timestamp
    return {
        'error': error,
        'ids': ids.ids,
        'epoch': int(ts.epoch),
        'batch': int(ts.batch),
        'report_worlds': [r.world_size for r in join.reports],
        'params': torch.cat([p.detach().flatten() for p in trainer.state.model.parameters()]),
    }


class Seen(Callback):
    """The ids of the real samples this rank trained per epoch, and evaluated per evaluation."""

    def __init__(self):
        self.trained: dict[int, list[int]] = {}
        self.evaluated: list[list[int]] = []

    def before_forward(self, state, logger):
        if not is_shadow_step(state):
            self.trained.setdefault(int(state.timestamp.epoch), []).extend(int(i) for i in state.batch[2])

    def eval_start(self, state, logger):
        self.evaluated.append([])

    def eval_before_forward(self, state, logger):
        if not is_shadow_step(state):
            self.evaluated[-1].extend(int(i) for i in state.batch[2])


def split_in_pairs(batch, microbatch_size):
    """The user's own ``split_batch``: microbatches of two samples, whatever the microbatch size."""
    x, y, ids = batch
    return [(x[i : i + 2], y[i : i + 2], ids[i : i + 2]) for i in range(0, len(y), 2)]


def user_data_specs(shards: list[int], eval_shards: list[int], wrapper: str) -> dict[str, Any]:
    """``DataSpec``s of the user's own for this rank's train shard (a custom ``split_batch``) and eval shard
    (Composer's default), under ``wrapper`` (``ddp`` or ``fsdp1``, whose microbatch padding also wraps the split):
    ``fit()`` 1 epoch with an evaluation, ``eval()``, ``predict()``, then ``fit()`` 1 more epoch; which
    ``split_batch`` each ``DataSpec`` holds after each of them. Sample ids: ``1000 * rank + i`` (train),
    ``1000 * (10 + rank) + i`` (eval)."""
    cpu_fsdp_workarounds()
    rank = dist.get_global_rank()
    # streamed shards with len() (Composer's predict() refuses a map-style dataset without a DistributedSampler)
    train, evaluation = SizedIdShard(rank, shards[rank]), SizedIdShard(10 + rank, eval_shards[rank])
    train_spec = DataSpec(DataLoader(train, batch_size=4), split_batch=split_in_pairs)
    eval_spec = DataSpec(DataLoader(evaluation, batch_size=4))
    before = {'train': train_spec.split_batch, 'eval': eval_spec.split_batch}
    seen = Seen()

    def held(when: str) -> dict[str, Any]:
        return {
            f'{when}/{name}': spec.split_batch is before[name] or repr(spec.split_batch)
            for name, spec in (('train', train_spec), ('eval', eval_spec))
        }

    kept: dict[str, Any] = {}
    trainer = _trainer(
        train_spec,
        [seen],
        max_duration='1ep',
        eval_dataloader=Evaluator(label='eval', dataloader=eval_spec, metric_names=['MulticlassAccuracy']),
        eval_interval='1ep',
        device_train_microbatch_size=2,
        parallelism_config=parallelism(wrapper, {}),
    )
    try:
        trainer.fit()
        kept.update(held('fit'))
        trainer.eval()
        kept.update(held('eval'))
        trainer.predict(DataLoader(evaluation, batch_size=4))
        kept.update(held('predict'))
        trainer.fit(duration='1ep')  # one more epoch
        kept.update(held('second_fit'))
    finally:
        trainer.close()
    return {'kept': kept, 'trained': seen.trained, 'evaluated': seen.evaluated}
