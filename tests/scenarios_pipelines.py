"""Rank-side scenarios for the data-pipeline matrix (``tests/test_pipelines.py``). Not a test module.

Every sample is an id into one fixed pool (``toy.shard(7, ...)``): a batch is ``(x, y, ids)`` whatever
the pipeline (map-style with a sampler, ``IterableDataset`` sharded over DataLoader workers, Hugging Face
``datasets``, a local ``StreamingDataset``), so the test can replay every rank's recorded steps in one
process and check that every id was trained exactly once per epoch. :func:`run_case` fits 2 epochs with
an evaluation after each, predicts, and (``resume_at``) resumes from a mid-epoch checkpoint; :func:`run_stock`
runs stock Composer (no algorithm) on the same pipeline for one epoch and the evaluation after it.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import pickle
import traceback
from typing import Any, Optional

import torch
from composer import Callback
from composer.core import Evaluator
from composer.loggers import InMemoryLogger
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import ExactDistributedSampler, TrailPosition, UnevenJoin, is_shadow_step, register_position
from pipeline_data import (
    EVAL_IDS,
    IdMap,
    PlainState,
    SizedWorkerShards,
    WorkerShards,
    collate_ids,
    generate_ids,
)
from rank_scenarios import ToyModel, eval_logged, quiet_trainer
from scenarios_resume import UnevenShuffled


class PlainStatePosition(TrailPosition):
    """A user's adapter for :class:`PlainState` (composer_join's public protocol): like Hugging Face's, its
    ``state_dict()`` says where the last read stopped, so it is read after every batch."""

    def read(self, samples: int) -> dict[str, int]:
        return self.target.state_dict()

    def fresh(self) -> None:  # its loaded position applies to its next iteration that reads: start that one fresh
        self.target.load_state_dict({'position': 0})


register_position(PlainState, PlainStatePosition)


def _split(sizes: list[int], first: int) -> list[list[int]]:
    """Consecutive id ranges of ``sizes``, from ``first``."""
    out, start = [], first
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def _batches(ids: list[int], batch: int, workers: int) -> int:
    """Batches a DataLoader yields over ``ids`` split by :class:`WorkerShards` (each worker its own last batch)."""
    parts = [ids[w::workers] for w in range(workers)] if workers else [ids]
    return sum(-(-len(p) // batch) for p in parts)


def make_dataset(kind: str, sizes: list[int], first: int, cfg: dict, folder: str) -> tuple[Any, Any]:
    """``(dataset, sampler or None)`` of this rank for ``kind`` over ``sizes`` (per rank, from id ``first``)."""
    rank, world = dist.get_global_rank(), dist.get_world_size()
    b, workers = cfg['batch_size'], cfg.get('workers', 0)
    if kind in ('exact_sampler', 'uneven_sampler'):
        dataset = IdMap(first, sum(sizes))
        if kind == 'exact_sampler':
            return dataset, ExactDistributedSampler(dataset, shuffle=True, seed=3)
        cuts = [sum(sizes[:r]) for r in range(world + 1)]
        return dataset, UnevenShuffled(dataset, cuts)
    if kind in ('iterable_nolen', 'iterable_exact', 'iterable_under', 'plain_state'):
        ids = _split(sizes, first)[rank]
        if kind == 'iterable_nolen':
            return WorkerShards(ids), None
        claimed = len(ids) if kind == 'iterable_under' else _batches(ids, b, workers) * b
        return (PlainState if kind == 'plain_state' else SizedWorkerShards)(ids, claimed), None
    if kind.startswith('hf_'):
        import datasets
        from datasets.distributed import split_dataset_by_node

        files = _split(sizes, first)  # one uneven 'file' per entry (its shards), split over the ranks
        if kind == 'hf_map':  # Composer wants a DistributedSampler for map-style data
            table = datasets.Dataset.from_dict({'id': [i for f in files for i in f]})
            return table, ExactDistributedSampler(table, shuffle=True, seed=3)
        if kind == 'hf_generator':
            full = datasets.IterableDataset.from_generator(generate_ids, gen_kwargs={'files': files})
        else:
            table = datasets.Dataset.from_dict({'id': [i for f in files for i in f]})
            full = table.to_iterable_dataset(num_shards=len(files))
        return split_dataset_by_node(full, rank=rank, world_size=world), None
    if kind == 'streaming':
        from streaming import MDSWriter, StreamingDataset

        local = os.path.join(folder, f'mds{first}')
        if rank == 0 and not os.path.exists(os.path.join(local, 'index.json')):
            with MDSWriter(out=local, columns={'id': 'int'}, size_limit=1 << 10) as out:
                for i in range(first, first + sum(sizes)):
                    out.write({'id': i})
        dist.barrier()
        return StreamingDataset(local=local, batch_size=b, shuffle=False), None
    raise ValueError(kind)


def _context(start: str) -> Any:
    """The workers' start method; forkserver's server imports this data module and ``datasets`` once, for all of them."""
    context = multiprocessing.get_context(start)
    if start == 'forkserver':
        context.set_forkserver_preload(['pipeline_data', 'datasets'])
    return context


def make_loader(kind: str, sizes: list[int], first: int, cfg: dict, folder: str) -> DataLoader:
    dataset, sampler = make_dataset(kind, sizes, first, cfg, folder)
    workers = cfg.get('workers', 0)
    extra: dict[str, Any] = {}
    if workers:
        extra = dict(persistent_workers=cfg.get('persistent', False), prefetch_factor=cfg.get('prefetch', 2))
        extra['multiprocessing_context'] = _context(cfg.get('start', 'fork'))
    return DataLoader(
        dataset, batch_size=cfg['batch_size'], sampler=sampler, num_workers=workers, collate_fn=collate_ids, **extra
    )


class Trail(Callback):
    """Per step: its epoch and the ids this rank trained; the weights at each evaluation; the ids evaluated and
    predicted."""

    def __init__(self):
        self.steps: dict[int, tuple[int, list[int]]] = {}
        self.eval_params: list[torch.Tensor] = []
        self.evaluated: list[int] = []
        self.predicted: list[int] = []
        self.predict_batches = 0  # this rank's own (not shadow)

    def before_forward(self, state, logger):
        step = int(state.timestamp.batch)
        _, ids = self.steps.setdefault(step, (int(state.timestamp.epoch), []))
        if not is_shadow_step(state):
            ids.extend(int(i) for i in state.batch[2])

    def eval_start(self, state, logger):
        self.eval_params.append(torch.cat([p.detach().flatten().cpu() for p in state.model.parameters()]))

    def eval_before_forward(self, state, logger):
        if not is_shadow_step(state):
            self.evaluated.extend(int(i) for i in state.batch[2])

    def predict_before_forward(self, state, logger):
        if not is_shadow_step(state):
            self.predict_batches += 1
            self.predicted.extend(int(i) for i in state.batch[2])


# attributes torch itself keeps on a DataLoader it iterates
_TORCH_OWN = {'_iterator', '_IterableDataset_len_called'}


def user_objects(loader: DataLoader) -> dict[str, Any]:
    """What UnevenJoin must leave as it is, of the dataloader, its dataset and sampler: no method replaced by an
    attribute; the attribute names (of torch's and these tests' classes: others add some as they are read); the
    pickled bytes of a dataset of these tests' own without a state of its own."""
    out: dict[str, Any] = {}
    for name, obj in (('dataloader', loader), ('dataset', loader.dataset), ('sampler', loader.sampler)):
        # an instance attribute over a method of its class: a replaced method
        out[f'{name}_replaced'] = sorted(k for k in vars(obj) if callable(getattr(type(obj), k, None)))
        if type(obj).__module__ == 'pipeline_data' or type(obj).__module__.startswith('torch.'):
            out[name] = sorted(set(vars(obj)) - _TORCH_OWN)  # others (streaming) add attributes as they are read
        if name == 'dataset' and type(obj).__module__ == 'pipeline_data' and not hasattr(obj, 'state_dict'):
            out['dataset_bytes'] = pickle.dumps(obj)  # a dataset without state of its own: the same bytes
    return out


def pickles(loader: DataLoader) -> dict[str, Any]:
    """Whether the dataset and the sampler pickle (what spawn and forkserver workers need)."""
    out: dict[str, Any] = {}
    for name, obj in (('dataset', loader.dataset), ('sampler', loader.sampler)):
        try:
            pickle.dumps(obj)
            out[name] = True
        except Exception as e:
            out[name] = f'{type(e).__name__}: {e}'
    return out


def fit(cfg: dict, folder: str, **kwargs) -> dict[str, Any]:
    """One 2-epoch fit (an evaluation after each epoch), then ``predict()`` over the eval dataloader."""
    model = ToyModel('mlp')
    train = make_loader(cfg['data'], cfg['sizes'], 0, cfg, folder)
    evaluation = make_loader(cfg['data'], cfg['eval_sizes'], EVAL_IDS, cfg, folder)
    before, pickled = user_objects(train), pickles(train)
    join = [UnevenJoin(mode=cfg.get('mode', 'shadow'))] if cfg.get('join', True) else []
    trail, memory = Trail(), InMemoryLogger()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=train,
        eval_dataloader=evaluator(evaluation, ['MulticlassAccuracy', 'MeanLoss']),
        eval_interval='1ep',
        max_duration=cfg.get('max_duration', '2ep'),  # in batches without len(): Composer refuses epochs
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        algorithms=join,
        callbacks=[trail],
        loggers=[memory],
        **kwargs,
    )
    predicting = None
    try:
        trainer.fit()
        # a fresh dataloader: Composer refuses one whose persistent workers' iterator is still alive
        predicting = make_loader(cfg['data'], cfg['eval_sizes'], EVAL_IDS, cfg, folder + '-predict')
        outputs = trainer.predict(predicting, return_outputs=True)
    finally:
        trainer.close()
        stop_workers(train, evaluation, predicting)
    return {
        'params': {k: v.detach().clone() for k, v in model.module.named_parameters()},
        'steps': trail.steps,
        'eval_params': trail.eval_params,
        'eval': eval_logged(memory),
        'predicted': trail.predicted,
        'predicted_rows': sum(len(o) for o in outputs),
        'predict_batches': trail.predict_batches,
        'predict_len': len(predicting) if _sized(predicting) else None,
        'user_objects': (before, user_objects(train)),
        'pickles': pickled,
    }


def stop_workers(*loaders: Optional[DataLoader]) -> None:
    """Ends the persistent workers of the test's own ``loaders`` now, as torch does when their iterator is deleted.

    Left to the garbage collector (the trainer and the dataloaders are in reference cycles), the iterator's queues
    can be finalized before the iterator: the queue's feeder thread then stops before it sends the workers their
    ``None``, and torch waits 5 s for each worker before it kills it (measured: 10 s per such dataloader, the predict
    one, stock Composer's as well; with the iterator dropped by its last reference, 0.05 s)."""
    for loader in loaders:
        iterator = getattr(loader, '_iterator', None) if loader is not None else None
        if iterator is not None and hasattr(iterator, '_shutdown_workers'):
            iterator._shutdown_workers()


def evaluator(loader: DataLoader, metrics: list[str]) -> Evaluator:
    """The evaluation after each epoch, of every batch (Composer refuses an eval loader without len() unless given
    a number of batches: 1000, more than any case has)."""
    return Evaluator(
        label='eval', dataloader=loader, metric_names=metrics, subset_num_batches=-1 if _sized(loader) else 1000
    )


def _sized(loader: DataLoader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def checkpoint(folder: str, batch: int) -> str:
    found = glob.glob(os.path.join(folder, f'ep*-ba{batch}-rank0.pt'))
    assert len(found) == 1, (folder, batch, found)
    return found[0]


def run_case(name: str, cfg: dict, folder: str) -> dict[str, Any]:
    """``{'full': fit}``; with ``resume_at``, checkpoints every batch and ``'resumed'``: a fit from batch ``resume_at``."""
    folder = os.path.join(folder, name)
    resume: Optional[int] = cfg.get('resume_at')
    if resume is None:
        return {'full': fit(cfg, folder)}
    full = os.path.join(folder, 'full')
    out = {'full': fit(cfg, folder, save_folder=full, save_interval='1ba')}
    out['resumed'] = fit(cfg, folder, load_path=checkpoint(full, resume))
    return out


class FirstEpochOnly(Callback):
    """Ends training with the first epoch, the evaluation after it included, also without ``len()`` (where
    ``max_duration`` is in batches): ``max_duration`` becomes ``1ep`` (``stop_training()`` would make it the batches
    trained, 0 on an empty rank, and Composer divides by it)."""

    def epoch_end(self, state, logger):
        state.max_duration = '1ep'


def run_stock(name: str, cfg: dict, folder: str) -> dict[str, Any]:
    """Stock Composer on the case's pipeline: no algorithm, the first epoch and the evaluation after it (with
    ``resume_at``, a checkpoint after that batch). What this rank trained and evaluated, and what it raised."""
    folder = os.path.join(folder, 'stock-' + name)
    model = ToyModel('mlp')
    train = make_loader(cfg['data'], cfg['sizes'], 0, cfg, folder)
    evaluation = make_loader(cfg['data'], cfg['eval_sizes'], EVAL_IDS, cfg, folder)
    trail = Trail()
    saving = {}
    if cfg.get('resume_at') is not None:
        saving = dict(save_folder=os.path.join(folder, 'checkpoints'), save_interval=f'{cfg["resume_at"]}ba')
    trainer = quiet_trainer(
        model=model,
        train_dataloader=train,
        eval_dataloader=evaluator(evaluation, ['MulticlassAccuracy']),
        eval_interval='1ep',
        max_duration=cfg.get('max_duration', '1ep'),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[trail, FirstEpochOnly()],
        **saving,
    )
    error = None
    try:
        trainer.fit()
    except Exception as e:  # recorded: stock Composer's outcome
        traceback.print_exc()
        error = (type(e).__name__, str(e))
    finally:
        trainer.close()
        stop_workers(train, evaluation)
    return {'steps': trail.steps, 'evaluated': trail.evaluated, 'error': error}
