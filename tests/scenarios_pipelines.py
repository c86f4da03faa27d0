"""Rank-side scenarios for the data-pipeline matrix (``tests/test_pipelines.py``). Not a test module.

Every sample is an id into one fixed pool (``toy.shard(7, ...)``): a batch is ``(x, y, ids)`` whatever
the pipeline (map-style with a sampler, ``IterableDataset`` sharded over DataLoader workers, Hugging Face
``datasets``, a local ``StreamingDataset``, webdataset tar shards, litdata, torchdata's ``StatefulDataLoader``),
so the test can replay every rank's recorded steps in one process and check that every id was trained exactly
once per epoch. Data written on the spot (tar shards, litdata chunks) goes into the launch's folder, once per
launch, by rank 0. :func:`run_case` fits 2 epochs with an evaluation after each, predicts, and (``resume_at``)
resumes from each checkpoint named (:func:`resume_positions`); :func:`run_stock`
runs stock Composer (no algorithm) on the same pipeline for one epoch and the evaluation after it.
"""

from __future__ import annotations

import functools
import glob
import multiprocessing
import os
import pickle
import traceback
from typing import Any, Optional

import torch
from composer import Callback
from composer.core import Evaluator, Event
from composer.loggers import InMemoryLogger
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import ExactDistributedSampler, TrailPosition, UnevenJoin, is_shadow_step, register_position
from pipeline_data import (
    EVAL_IDS,
    ComposerProtocol,
    IdMap,
    PlainState,
    SizedWorkerShards,
    WorkerShards,
    collate_ids,
    generate_ids,
    id_row,
    keep_row,
    wds_id,
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
    if kind == 'own_sampler':  # this rank's ids, shuffled by a DistributedSampler of its own (one replica)
        ids = _split(sizes, first)[rank]
        dataset = IdMap(ids[0] if ids else first, len(ids))
        return dataset, ExactDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    if kind in ('exact_sampler', 'uneven_sampler'):
        dataset = IdMap(first, sum(sizes))
        if kind == 'exact_sampler':
            return dataset, ExactDistributedSampler(dataset, shuffle=True, seed=3)
        cuts = [sum(sizes[:r]) for r in range(world + 1)]
        return dataset, UnevenShuffled(dataset, cuts)
    if kind in ('iterable_nolen', 'iterable_exact', 'iterable_under', 'plain_state', 'composer_protocol'):
        ids = _split(sizes, first)[rank]
        if kind == 'iterable_nolen':
            return WorkerShards(ids), None
        claimed = len(ids) if kind == 'iterable_under' else _batches(ids, b, workers) * b
        cls = {'plain_state': PlainState, 'composer_protocol': ComposerProtocol}.get(kind, SizedWorkerShards)
        return cls(ids, claimed), None
    if kind == 'hf_filter':
        return _hf_filtered(sizes, first, cfg), None
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
        dataset = split_dataset_by_node(full, rank=rank, world_size=world)
        if cfg.get('shuffle_buffer'):  # a shuffle buffer (seeded): its state_dict() does not hold the buffer
            dataset = dataset.shuffle(seed=1, buffer_size=cfg['shuffle_buffer'])
        return dataset, None
    if kind == 'streaming':
        from streaming import MDSWriter, StreamingDataset

        local = os.path.join(folder, f'mds{first}')
        if rank == 0 and not os.path.exists(os.path.join(local, 'index.json')):
            with MDSWriter(out=local, columns={'id': 'int'}, size_limit=1 << 10) as out:
                for i in range(first, first + sum(sizes)):
                    out.write({'id': i})
        dist.barrier()
        return StreamingDataset(local=local, batch_size=b, shuffle=False), None
    if kind in ('wds', 'wds_len_high'):
        import webdataset as wds

        urls = _wds_shards(sizes, first, folder)
        # each rank reads the shards urls[rank::world] (split_by_node: the RANK the launcher sets, else
        # torch.distributed's), each DataLoader worker urls[worker::workers] of those
        dataset = wds.WebDataset(
            urls, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker, shardshuffle=False
        ).map(wds_id)
        if kind == 'wds_len_high':  # the whole dataset's length on every rank: more than any rank yields
            dataset = dataset.with_length(sum(sizes), silent=True)
        return dataset, None
    if kind == 'litdata':
        import litdata

        local = _data_folder(folder, f'litdata-{first}-{sum(sizes)}')
        if rank == 0 and not os.path.exists(os.path.join(local, 'index.json')):
            litdata.optimize(
                fn=id_row,
                inputs=list(range(first, first + sum(sizes))),
                output_dir=local,
                chunk_size=2,
                num_workers=1,
                start_method='fork',
                verbose=False,
            )
        dist.barrier()
        # litdata splits the samples over the ranks itself; drop_last=False (its default is True in a distributed
        # run: every rank gets as many samples, the others are dropped) leaves every sample to some rank
        return litdata.StreamingDataset(input_dir=local, shuffle=False, drop_last=False), None
    raise ValueError(kind)


def _data_folder(folder: str, name: str) -> str:
    """A folder for data written once per launch: beside the runs' folders (every run of a launch is in one)."""
    return os.path.join(os.path.dirname(folder), 'data', name)


def _wds_shards(sizes: list[int], first: int, folder: str) -> list[str]:
    """Tar shards of ``sizes`` ids (one record per id, from ``first``), written by rank 0 once per launch."""
    import webdataset as wds

    local = _data_folder(folder, f'wds-{first}-' + '-'.join(map(str, sizes)))
    urls = [os.path.join(local, f'shard-{k:02d}.tar') for k in range(len(sizes))]
    if dist.get_global_rank() == 0 and not os.path.exists(os.path.join(local, 'done')):
        os.makedirs(local, exist_ok=True)
        for url, ids in zip(urls, _split(sizes, first)):
            with wds.TarWriter(url) as sink:
                for i in ids:
                    sink.write({'__key__': f'{i:06d}', 'cls': i})
        open(os.path.join(local, 'done'), 'w').close()
    dist.barrier()
    return urls


def _hf_filtered(sizes: list[int], first: int, cfg: dict) -> Any:
    """Hugging Face: ``split_dataset_by_node``, then a data-dependent ``.filter()`` (the ranks end up uneven) and a
    shuffle buffer; ``read_before``: the script reads it before ``fit()`` (``'next'``: one row; ``'count'``: all)."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    table = datasets.Dataset.from_dict({'id': list(range(first, first + sum(sizes)))})
    shards = split_dataset_by_node(
        table.to_iterable_dataset(num_shards=4), dist.get_global_rank(), dist.get_world_size()
    )
    dataset = shards.filter(keep_row).shuffle(seed=cfg['seed'], buffer_size=4)
    if cfg.get('read_before') == 'next':
        next(iter(dataset))
    elif cfg.get('read_before') == 'count':
        sum(1 for _ in dataset)
    return dataset


def _context(start: str) -> Any:
    """The workers' start method; forkserver's server imports this data module and ``datasets`` once, for all of them."""
    context = multiprocessing.get_context(start)
    if start == 'forkserver':
        context.set_forkserver_preload(['pipeline_data', 'datasets'])
    return context


def make_loader(kind: str, sizes: list[int], first: int, cfg: dict, folder: str) -> Any:
    """The row's dataloader: torch's ``DataLoader``, or (``loader``) torchdata's ``StatefulDataLoader``
    (``'stateful'``), litdata's ``StreamingDataLoader`` (``'litdata'``), or a webdataset ``WebLoader`` over the
    dataset batched by webdataset (``'webloader'``: not a ``DataLoader``; one inside it)."""
    dataset, sampler = make_dataset(kind, sizes, first, cfg, folder)
    workers, b = cfg.get('workers', 0), cfg['batch_size']
    extra: dict[str, Any] = {}
    if workers:
        extra = dict(persistent_workers=cfg.get('persistent', False), prefetch_factor=cfg.get('prefetch', 2))
        extra['multiprocessing_context'] = _context(cfg.get('start', 'fork'))
    loader = cfg.get('loader', 'torch')
    if loader == 'webloader':
        import webdataset as wds

        batched = dataset.batched(b, collation_fn=collate_ids, partial=True)
        return wds.WebLoader(batched, batch_size=None, num_workers=workers, **extra)
    if loader == 'litdata':
        from litdata import StreamingDataLoader

        return StreamingDataLoader(dataset, batch_size=b, num_workers=workers, collate_fn=collate_ids, **extra)
    cls: Any = DataLoader
    if loader == 'stateful':
        from torchdata.stateful_dataloader import StatefulDataLoader as cls
    return cls(dataset, batch_size=b, sampler=sampler, num_workers=workers, collate_fn=collate_ids, **extra)


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


class NoEmptyEpochs(Callback):
    """Raises at the end of an epoch that started (``EPOCH_START``) and trained no batch on any rank: with
    ``max_duration`` in batches, Composer would start empty epochs until the launch's timeout (a dataset resumed at
    its end yields nothing in every later epoch). An epoch resumed at its end (no ``EPOCH_START``) may be empty."""

    def __init__(self):
        self.started: Optional[int] = None

    def epoch_start(self, state, logger):
        self.started = int(state.timestamp.batch)

    def epoch_end(self, state, logger):
        if self.started == int(state.timestamp.batch):
            raise RuntimeError(f'epoch {int(state.timestamp.epoch) - 1} trained no batch: no rank yielded any')
        self.started = None


# attributes torch itself keeps on a DataLoader it iterates
_TORCH_OWN = {'_iterator', '_IterableDataset_len_called'}


def _inner(loader: Any) -> DataLoader:
    """The ``DataLoader`` of ``loader``: itself, or the one a webdataset ``WebLoader`` holds."""
    if isinstance(loader, DataLoader):
        return loader
    return next(stage for stage in loader.pipeline if isinstance(stage, DataLoader))


def _parts(loader: Any) -> tuple[tuple[str, Any], ...]:
    inner = _inner(loader)
    return (('dataloader', loader), ('dataset', inner.dataset), ('sampler', inner.sampler))


def user_objects(loader: Any) -> dict[str, Any]:
    """What UnevenJoin must leave as it is, of the dataloader, its dataset and sampler: no method replaced by an
    attribute; the attribute names (of torch's and these tests' classes: others add some as they are read); the
    pickled bytes of a dataset of these tests' own without a state of its own."""
    out: dict[str, Any] = {}
    for name, obj in _parts(loader):
        # an instance attribute over a method of its class: a replaced method
        out[f'{name}_replaced'] = sorted(k for k in vars(obj) if callable(getattr(type(obj), k, None)))
        if type(obj).__module__ == 'pipeline_data' or type(obj).__module__.startswith('torch.'):
            out[name] = sorted(set(vars(obj)) - _TORCH_OWN)  # others (streaming) add attributes as they are read
        if name == 'dataset' and type(obj).__module__ == 'pipeline_data' and not hasattr(obj, 'state_dict'):
            out['dataset_bytes'] = pickle.dumps(obj)  # a dataset without state of its own: the same bytes
    return out


def pickles(loader: Any) -> dict[str, Any]:
    """Whether the dataset and the sampler pickle (what spawn and forkserver workers need)."""
    out: dict[str, Any] = {}
    for name, obj in _parts(loader)[1:]:
        try:
            pickle.dumps(obj)
            out[name] = True
        except Exception as e:
            out[name] = f'{type(e).__name__}: {e}'
    return out


def fit(cfg: dict, folder: str, algorithms: tuple = (), callbacks: tuple = (), **kwargs) -> dict[str, Any]:
    """One 2-epoch fit (an evaluation after each epoch), then ``predict()`` over the eval dataloader; ``algorithms``
    and ``callbacks``: more of them, after UnevenJoin and the recording callbacks."""
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
        algorithms=join + list(algorithms),
        callbacks=[trail, NoEmptyEpochs(), *callbacks],
        loggers=[memory],
        **_microbatch(train),
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
        'pickles': (pickled, pickles(train)),
        'position': position_of(join),
    }


def position_of(join: list) -> Optional[str]:
    """The adapter UnevenJoin chose for the train data (its class name), None where it left the data to Composer."""
    loader = join[0].train_loader if join else None
    positions = loader.positions if loader is not None else None
    return type(positions.position).__name__ if positions is not None else None


def _microbatch(train: Any) -> dict[str, Any]:
    """Composer takes the microbatch size from the train dataloader's ``batch_size``; a ``WebLoader`` has none."""
    return {} if hasattr(train, 'batch_size') else {'device_train_microbatch_size': 4}


def stop_workers(*loaders: Optional[DataLoader]) -> None:
    """Ends the persistent workers of the test's own ``loaders`` now, as torch does when their iterator is deleted.

    Left to the garbage collector (the trainer and the dataloaders are in reference cycles), the iterator's queues
    can be finalized before the iterator: the queue's feeder thread then stops before it sends the workers their
    ``None``, and torch waits 5 s for each worker before it kills it (measured: 10 s per such dataloader, the predict
    one, stock Composer's as well; with the iterator dropped by its last reference, 0.05 s)."""
    for loader in loaders:
        iterator = getattr(_inner(loader), '_iterator', None) if loader is not None else None
        if iterator is not None and hasattr(iterator, '_shutdown_workers'):
            iterator._shutdown_workers()


def evaluator(loader: Any, metrics: list[str]) -> Evaluator:
    """The evaluation after each epoch, of every batch (Composer refuses an eval loader without len() unless given
    a number of batches: 1000, more than any case has; and one without ``batch_size``, a webdataset ``WebLoader``,
    unless given a microbatch size: 4, the batch size of every case)."""
    return Evaluator(
        label='eval',
        dataloader=loader,
        metric_names=metrics,
        subset_num_batches=-1 if _sized(loader) else 1000,
        device_eval_microbatch_size=None if hasattr(loader, 'batch_size') else 4,
    )


def _sized(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def checkpoint(folder: str, epoch: int, batch: int) -> str:
    found = glob.glob(os.path.join(folder, f'ep{epoch}-ba{batch}-rank0.pt'))
    assert len(found) == 1, (folder, epoch, batch, found)
    return found[0]


def resume_positions(cfg: dict) -> list[Any]:
    """Where the row resumes (``resume_at``: one position or a tuple of them). A position is a batch ``k`` of epoch 0
    (the checkpoint after it, ``ep0-ba{k}``), ``'epoch_end'`` (the checkpoint after epoch 0's last batch, still in
    epoch 0: ``ep0-ba{N}``) or ``'ep1'`` (the epoch checkpoint after epoch 0 ends: ``ep1-ba{N}``)."""
    at = cfg.get('resume_at')
    return [] if at is None else list(at) if isinstance(at, tuple) else [at]


def saves_at(positions: list[Any], state: Any, event: Event) -> bool:
    """The ``save_interval`` (with ``functools.partial``) of a run that resumes from ``positions``: the checkpoint
    of every batch, except that with ``'ep1'`` only those of the batches resumed from, so that the last batch of
    epoch 0 leaves its batch to the epoch checkpoint (Composer saves one checkpoint per batch); and the epoch
    checkpoint after epoch 0 for ``'ep1'``."""
    if event == Event.EPOCH_CHECKPOINT:
        return 'ep1' in positions and int(state.timestamp.epoch) == 1
    if event != Event.BATCH_CHECKPOINT:
        return False
    return 'ep1' not in positions or (int(state.timestamp.epoch) == 0 and int(state.timestamp.batch) in positions)


def run_case(name: str, cfg: dict, folder: str, **extra: Any) -> dict[str, Any]:
    """``{'full': fit}``; with ``resume_at``, checkpoints and, per position, ``'resumed@<position>'``: a fit resumed
    from it (its ``'resumed_from'``: the batch it starts after). ``extra``: :func:`fit`'s ``algorithms`` and
    ``callbacks``, in every fit."""
    folder = os.path.join(folder, name)
    positions = resume_positions(cfg)
    if not positions:
        return {'full': fit(cfg, folder, **extra)}
    assert not {'ep1', 'epoch_end'} <= set(positions), 'both are after the same batch: Composer saves one of them'
    full = os.path.join(folder, 'full')
    out = {'full': fit(cfg, folder, save_folder=full, save_interval=functools.partial(saves_at, positions), **extra)}
    first_epoch = 1 + max(step for step, (epoch, _) in out['full']['steps'].items() if epoch == 0)
    for at in positions:
        k = at if isinstance(at, int) else first_epoch
        resumed = fit(cfg, folder, load_path=checkpoint(full, 1 if at == 'ep1' else 0, k), **extra)
        out[f'resumed@{at}'] = dict(resumed, resumed_from=k)
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
    positions = resume_positions(cfg)
    if positions:  # after the first batch the row resumes from, or at the epoch's end
        batch = min((at for at in positions if isinstance(at, int)), default=None)
        saving = dict(
            save_folder=os.path.join(folder, 'checkpoints'), save_interval='1ep' if batch is None else f'{batch}ba'
        )
    trainer = quiet_trainer(
        model=model,
        train_dataloader=train,
        eval_dataloader=evaluator(evaluation, ['MulticlassAccuracy']),
        eval_interval='1ep',
        max_duration=cfg.get('max_duration', '1ep'),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[trail, FirstEpochOnly()],
        **_microbatch(train),
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
