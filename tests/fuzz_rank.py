"""The scenario fuzzer's rank side: one drawn scenario (``tests/scenario_fuzz.py``) as a real Composer run.

:func:`run` builds the data, model and Trainer the scenario describes from ``tests/fuzz_reference.py``'s pools and
models, with ``UnevenJoin`` (or, ``stock``, without), runs its life (evaluations before the first fit, fit, a second fit, evaluations, predict) and
returns plain data for the checker: the ids of the real samples each step trained on this rank, the final state,
the timestamp, the evaluations' metrics, the predictions, or the error it raised. Many scenarios run one after
another in one launch (one process group). A scenario resumed on another world size (``resume_world``) takes two
launches: :func:`save_first_fit` on ``world`` ranks, then :func:`run` on ``resume_world`` ranks, resuming from the
first's checkpoint in the folder both are given; a chained one (``chain_world``) three: :func:`save_first_fit`,
:func:`save_resumed_fit` on ``resume_world`` ranks (loading the first's checkpoint, saving its own), then :func:`run`
on ``chain_world`` ranks from the second's checkpoint after ``chain_at``. Not a test module.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import tempfile
import time
import traceback
import zlib
from typing import Any, Optional

import torch
import torch.nn.functional as F
from composer import Callback, Trainer
from composer.algorithms import GradientClipping
from composer.core import Algorithm, DataSpec, Evaluator
from composer.models import ComposerModel
from composer.utils import dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy

import devices
import fuzz_reference as ref
from rank_scenarios import AsksForUnusedParameters


class Stream(IterableDataset):
    """Samples ``(x float64, y, id)`` of ``ids`` in order; with DataLoader workers, worker ``w`` of ``n`` yields the
    batches ``k`` with ``k % n == w`` (so the loader yields the same batches in the same order as without)."""

    def __init__(self, ids: list[int], batch: int):
        self.ids, self.batch = ids, batch

    def __iter__(self):
        info = get_worker_info()
        for pos, i in enumerate(self.ids):
            if info is None or (pos // self.batch) % info.num_workers == info.id:
                x, y = ref.sample(i)
                yield x, y, i


class SizedStream(Stream):
    """:class:`Stream` with a ``len()`` that says ``claimed`` samples."""

    def __init__(self, ids: list[int], batch: int, claimed: int):
        super().__init__(ids, batch)
        self.claimed = claimed

    def __len__(self) -> int:
        return self.claimed


class MapData(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = ref.sample(7000 + i)
        return x, y, 7000 + i


class Collate:
    """Stacks samples into the scenario's format: ``(x, y, id)`` or ``{'x', 'y', 'id'}``; features stay float64
    when a batch transform is there to change the dtype."""

    def __init__(self, fmt: str, keep64: bool):
        self.fmt, self.keep64 = fmt, keep64

    def __call__(self, samples):
        x = torch.stack([s[0] for s in samples])
        x = x if self.keep64 else x.float()
        y, ids = torch.stack([s[1] for s in samples]), torch.tensor([s[2] for s in samples])
        return {'x': x, 'y': y, 'id': ids} if self.fmt == 'dict' else (x, y, ids)


def parts(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (batch['x'], batch['y'], batch['id']) if isinstance(batch, dict) else (batch[0], batch[1], batch[2])


def rebuild(batch, x, y, ids):
    return {'x': x, 'y': y, 'id': ids} if isinstance(batch, dict) else (x, y, ids)


def to_float(batch):
    x, y, ids = parts(batch)
    return rebuild(batch, x.float(), y, ids)


def drop_last(batch):
    x, y, ids = parts(batch)
    x = x.float()
    return rebuild(batch, x[:-1], y[:-1], ids[:-1]) if len(y) >= 2 else rebuild(batch, x, y, ids)


def two_views(batch):
    x, y, ids = parts(batch)
    x = x.float()
    return rebuild(batch, torch.cat([x, x.flip(-1)]), torch.cat([y, y]), torch.cat([ids, ids]))


def halve(batch):
    x, y, ids = parts(batch)
    return rebuild(batch, x * 0.5, y, ids)


TRANSFORMS = {'float': to_float, 'drop': drop_last, 'views': two_views}


def train_spec(sc: dict, rank: int) -> DataSpec:
    source, b = sc['source'], sc['batch']
    collate = Collate(sc.get('fmt', 'tuple'), sc.get('transform') is not None)
    kwargs: dict[str, Any] = dict(batch_size=b, collate_fn=collate, num_workers=sc.get('workers', 0))
    if sc.get(
        'workers'
    ):  # forked (the rank's default, forkserver, starts a server importing torch: 10-100 s a scenario)
        kwargs['multiprocessing_context'] = 'fork'
    if source in ('exact', 'torch'):
        data = MapData(sc['map_size'])
        shuffle = sc.get('shuffle', False)
        if source == 'exact':
            from composer_join import ExactDistributedSampler

            sampler: DistributedSampler = ExactDistributedSampler(data, shuffle=shuffle, seed=ref.SAMPLER_SEED)
        else:
            sampler = DistributedSampler(data, shuffle=shuffle, seed=ref.SAMPLER_SEED)
        loader = DataLoader(data, sampler=sampler, **kwargs)
    else:
        ids = ref.rank_ids(sc, rank, 0)
        n = len(ids)
        claimed = {'len': n, 'over': n + b, 'under': max(0, n - b)}.get(source)
        stream = Stream(ids, b) if claimed is None else SizedStream(ids, b, claimed)
        loader = DataLoader(stream, **kwargs)
    return DataSpec(
        loader,
        batch_transforms=TRANSFORMS[sc['transform']] if sc.get('transform') else None,
        microbatch_transforms=halve if sc.get('mb_transform') else None,
        get_num_tokens_in_batch=tokens_in,
    )


def tokens_in(batch) -> int:
    """The batch's tokens (``fuzz_reference.tokens_of`` its ids): what ``max_duration`` in tokens counts."""
    return ref.tokens_of(parts(batch)[2].tolist())


def eval_spec(sc: dict, rank: int, group: int, sizes: list[int], batch: int) -> DataSpec:
    ids = [1000 * (group + rank) + i for i in range(sizes[rank])]
    collate = Collate(sc.get('fmt', 'tuple'), sc.get('transform') is not None)
    loader = DataLoader(SizedStream(ids, batch, len(ids)), batch_size=batch, collate_fn=collate)
    return DataSpec(loader, batch_transforms=to_float if sc.get('transform') else None)


class ListIds(Metric):
    """A list-state metric: the ids it saw, concatenated over ranks on compute (kept in ``last``)."""

    def __init__(self):
        super().__init__()
        self.add_state('ids', default=[], dist_reduce_fx='cat')
        self.last: list[int] = []

    def update(self, ids: torch.Tensor) -> None:
        self.ids.append(ids)

    def compute(self) -> torch.Tensor:
        ids = self.ids if isinstance(self.ids, torch.Tensor) else (torch.cat(self.ids) if self.ids else None)
        self.last = sorted(int(i) for i in ids) if ids is not None else []
        return torch.tensor(float(len(self.last)))


class Model(ComposerModel):
    def __init__(self, sc: dict):
        super().__init__()
        self.module = ref.make_model(sc, distributed=True)

    def forward(self, batch):
        x, y, _ = parts(batch)
        return self.module(x, y)

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, parts(batch)[1])

    def get_metrics(self, is_train: bool = False):
        if is_train:
            return {}
        return {
            'MulticlassAccuracy': MulticlassAccuracy(num_classes=ref.CLASSES, average='micro'),
            'MeanLoss': MeanMetric(),
            'ListIds': ListIds(),
        }

    def update_metric(self, batch, outputs, metric):
        _, y, ids = parts(batch)
        if isinstance(metric, ListIds):
            metric.update(ids)
        elif isinstance(metric, MeanMetric):
            metric.update(F.cross_entropy(outputs, y, reduction='none'))
        else:
            metric.update(outputs, y)


def make_evaluator(sc: dict, rank: int, label: str) -> Evaluator:
    """An evaluator over this rank's eval shard (the Trainer's own, or one passed to ``eval()``)."""
    return Evaluator(
        label=label,
        dataloader=eval_spec(sc, rank, 50, sc['eval_shards'], sc['eval_batch']),
        metric_names=['MulticlassAccuracy', 'MeanLoss', 'ListIds'],
        device_eval_microbatch_size=sc.get('eval_microbatch'),
    )


class StepIds(Callback):
    """Per global step, the ids of the real samples this rank trained (in the step's last attempt: automatic
    microbatching retries a step after an out-of-memory error)."""

    def __init__(self, stock: bool):
        self.stock = stock
        self.steps: dict[int, list[int]] = {}

    def before_train_batch(self, state, logger):  # again at each attempt automatic microbatching retries
        self.steps[int(state.timestamp.batch)] = []

    def before_forward(self, state, logger):
        ids = self.steps.setdefault(int(state.timestamp.batch), [])
        if self.stock:
            real = True
        else:
            from composer_join import is_shadow_step

            real = not is_shadow_step(state)
        if real:
            ids.extend(int(i) for i in parts(state.batch)[2])


RAISED = 'fuzz: raised at'
STEP_EVENTS = ('epoch_start', 'batch_start', 'after_dataloader', 'before_forward')


class Raiser(Callback):
    """Raises once, on every rank, at ``event`` (at the first of ``STEP_EVENTS`` at or after global step ``step``);
    the scenario then retries the call that raised, as a notebook does (docs/reliability.md, "A run that raises")."""

    def __init__(self, event: str, step: int):
        self.event, self.step, self.fired = event, step, False

    def run_event(self, event, state, logger):
        if self.fired or event.value != self.event:
            return
        if self.event in STEP_EVENTS and int(state.timestamp.batch) < self.step:
            return
        self.fired = True
        raise RuntimeError(f'{RAISED} {self.event}, step {int(state.timestamp.batch)}')


def retried(call):
    """``call()``; once more if it raised the scenario's :class:`Raiser` error."""
    try:
        return call()
    except RuntimeError as e:
        if RAISED not in str(e):
            raise
        return call()


def metrics_of(trainer: Trainer, label: str) -> dict[str, Any]:
    metrics = trainer.state.eval_metrics[label]
    return {
        'accuracy': float(metrics['MulticlassAccuracy'].compute()),
        'loss': float(metrics['MeanLoss'].compute()),
        'ids': metrics['ListIds'].last,
    }


def parallelism(sc: dict) -> Optional[dict]:
    """FSDP1 or FSDP2 as ``tests/scenarios_fsdp.py`` runs them on CPU (its gloo workarounds applied), or DDP."""
    if sc.get('wrapper') is None:
        return None
    from composer.utils import FSDP2Config

    from scenarios_fsdp import cpu_fsdp_workarounds

    cpu_fsdp_workarounds()
    # sharded checkpoints, as tests/test_fsdp.py resumes them (FSDP1's full ones crash a rank on CPU, stock too)
    if sc['wrapper'] == 'fsdp2':
        return {'fsdp': FSDP2Config(state_dict_type='sharded')}
    return {'fsdp': {'sharding_strategy': 'FULL_SHARD', 'state_dict_type': 'sharded'}}


def full_state(trainer: Trainer, model: Model, sc: dict) -> dict[str, torch.Tensor]:
    """The module's whole state (under FSDP gathered: a collective on every rank)."""
    if sc.get('wrapper') is None:
        return {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(trainer.state.model, options=StateDictOptions(full_state_dict=True))
    return {k[len('module.') :]: v.detach().cpu().clone() for k, v in state.items() if k.startswith('module.')}


def build(
    sc: dict, rank: int, join: Optional[Algorithm] = None, faults: bool = True, **checkpoint: Any
) -> tuple[Trainer, Model, StepIds]:
    """The scenario's Trainer; ``join``: the ``UnevenJoin`` to use (another Trainer's: ``twin``), else a new one;
    ``faults``: with the scenario's raise (``raise_at``) and out-of-memory error (``oom``: automatic microbatching on,
    as ``tests/scenarios_oom.py`` simulates it on CPU)."""
    model, steps = Model(sc), StepIds(bool(sc.get('stock')))
    algorithms: list[Algorithm] = []
    if not sc.get('stock'):
        from composer_join import UnevenJoin

        algorithms.append(
            join or UnevenJoin(mode=sc.get('mode', 'shadow'), divide_by_initial_world_size=sc.get('divide', True))
        )
    if sc.get('clip'):
        algorithms.append(GradientClipping(clipping_type='norm', clipping_threshold=ref.CLIP))
    if sc.get('find_unused'):
        algorithms.append(AsksForUnusedParameters())
    evaluator: Optional[Evaluator] = None
    if sc.get('eval') in ('own', 'both') or (sc.get('eval_first') or [0, None])[1] in ('own', 'both'):
        evaluator = make_evaluator(sc, rank, 'eval')
    value, unit = sc['duration']
    trainer = Trainer(
        model=model,
        train_dataloader=train_spec(sc, rank),
        eval_dataloader=evaluator,
        eval_interval='1ep',
        max_duration=f'{value}{unit}',
        optimizers=ref.make_optimizer(sc, model.parameters()),
        algorithms=algorithms,
        callbacks=([Raiser(*sc['raise_at'])] if sc.get('raise_at') and faults else [])
        + [steps],  # a raise first: nothing recorded
        device=devices.trainer_device(),
        device_train_microbatch_size=sc.get('microbatch'),
        ddp_sync_strategy=sc.get('sync'),
        parallelism_config=parallelism(sc),
        progress_bar=False,
        log_to_console=False,
        seed=0,
        **checkpoint,
    )
    if sc.get('static_graph') and dist.get_world_size() > 1:  # (one rank, resumed: no DDP to switch)
        trainer.state.model._set_static_graph()  # torch's own switch; Composer has no option for it
    if sc.get('oom') and faults:  # automatic microbatching, an out-of-memory error at one rank's step (CPU: simulated)
        from scenarios_oom import OOMInjector, enable_auto_microbatching

        enable_auto_microbatching(trainer)
        rank_, step, point = sc['oom']
        limit = (sc.get('microbatch') or sc['batch']) // 2
        OOMInjector(trainer, [dict(ranks=[rank_], steps=[step], point=point, limit=limit)]).install(model)
    return trainer, model, steps


def folder_for(sc: dict) -> str:
    """A checkpoint folder the same on every rank of this launch, its own per scenario."""
    return os.path.join(tempfile.gettempdir(), f'fuzz47-{os.environ["MASTER_PORT"]}-{zlib.crc32(repr(sc).encode())}')


def evaluations_first(trainer: Trainer, sc: dict, rank: int) -> list[dict[str, Any]]:
    """The ``eval()`` calls made before the trainer's first ``fit()`` (``eval_first``: ``[calls, kind]``, kind 'own':
    the Trainer's own loader, 'passed': one passed to ``eval()``, 'both': one call of each); per call, the metrics
    by kind. None drawn: no call, an empty list."""
    if not sc.get('eval_first'):
        return []
    calls, kind = sc['eval_first']
    out = []
    for _ in range(calls):
        got: dict[str, Any] = {}
        if kind in ('own', 'both'):
            retried(trainer.eval)
            got['own'] = metrics_of(trainer, 'eval')
        if kind in ('passed', 'both'):
            retried(functools.partial(trainer.eval, eval_dataloader=make_evaluator(sc, rank, 'passed')))
            got['passed'] = metrics_of(trainer, 'passed')
        out.append(got)
    return out


def saving_fit(sc: dict, rank: int, folder: str, early: Optional[dict] = None) -> dict[int, list[int]]:
    """The first ``fit()`` on ``world`` ranks with a checkpoint after every batch in ``folder``; its steps. Before
    it, the evaluations ``eval_first`` asks for (their metrics into ``early['eval_first']``)."""
    save = dict(save_folder=folder, save_interval='1ba', save_overwrite=True, save_num_checkpoints_to_keep=-1)
    trainer, _, before = build(sc, rank, **save)
    got = evaluations_first(trainer, sc, rank)
    if early is not None:
        early['eval_first'] = got
    retried(trainer.fit)
    trainer.close()
    return before.steps


def checkpoint(sc: dict, folder: str, at: Optional[int] = None) -> str:
    """The checkpoint after batch ``at`` (default: ``resume_at``) in ``folder``."""
    at = sc['resume_at'] if at is None else at
    pattern = f'ep*-ba{at}' + ('' if sc.get('wrapper') else '-rank0.pt')  # FSDP: a sharded folder
    (path,) = glob.glob(os.path.join(folder, pattern))
    return path


def first_fit(
    sc: dict, rank: int, folder: Optional[str] = None, early: Optional[dict] = None
) -> tuple[Trainer, Model, dict[int, list[int]]]:
    """The first ``fit()``; with ``resume_at`` k: a fit saving after every batch, then a fresh trainer loaded from
    the checkpoint after batch k fits to the end (the steps before k are the first run's). Resumed on another world
    size (``resume_world``): the saving fit was the first launch's (:func:`save_first_fit`, into ``folder``); this
    launch only loads and fits on (its steps from k on). ``eval_first``: evaluations before the first trainer's
    first ``fit()`` (their metrics into ``early['eval_first']``); resumed on another world size, this launch's
    trainer evaluates first, just loaded (its state then into ``early['eval_first_state']``)."""
    early = {} if early is None else early
    if sc.get('resume_at') is None:
        trainer, model, steps = build(sc, rank)
        early['eval_first'] = evaluations_first(trainer, sc, rank)
        retried(trainer.fit)
        return trainer, model, steps.steps
    if sc.get('resume_world'):
        assert folder is not None, "a scenario resumed on another world size needs the first launch's folder"
        before: dict[int, list[int]] = {}
    else:
        folder = folder_for(sc)
        before = saving_fit(sc, rank, folder, early)
    trainer, model, steps = build(sc, rank, load_path=checkpoint(sc, folder, sc.get('chain_at')))
    if sc.get('resume_world') and sc.get('eval_first'):  # the resumed launch's first call (chained: the third's)
        early['eval_first_state'] = full_state(trainer, model, sc)
        early['eval_first'] = evaluations_first(trainer, sc, rank)
    retried(trainer.fit)
    merged = {t: ids for t, ids in before.items() if t < sc['resume_at']}
    merged.update(steps.steps)
    steps.steps = merged  # the later fits of this trainer add to it
    return trainer, model, steps.steps


def save_first_fit(sc: dict, folder: str) -> dict[str, Any]:
    """The first launch of a scenario resumed on another world size, on ``world`` ranks: its first ``fit()`` saving
    after every batch into ``folder`` (which outlives the launch); ``{'error', 'steps'}`` for the checker."""
    assert dist.get_world_size() == sc['world'], (dist.get_world_size(), sc['world'])
    early: dict[str, Any] = {}
    try:
        return {'error': None, 'steps': saving_fit(sc, dist.get_global_rank(), folder, early), **early}
    except Exception as e:  # the checker fails the scenario with it
        return {'error': (type(e).__name__, str(e)[:2000]), 'steps': {}}


def save_resumed_fit(sc: dict, folder: str, save_folder: str) -> dict[str, Any]:
    """The second launch of a chained scenario (``chain_world``), on ``resume_world`` ranks: the first launch's
    checkpoint after ``resume_at`` (in ``folder``) loaded, the first ``fit()`` on to its end saving after every batch
    into ``save_folder`` (which outlives the launch); ``{'error', 'steps'}`` for the checker."""
    assert dist.get_world_size() == sc['resume_world'], (dist.get_world_size(), sc['resume_world'])
    try:
        save = dict(save_folder=save_folder, save_interval='1ba', save_overwrite=True, save_num_checkpoints_to_keep=-1)
        trainer, _, steps = build(sc, dist.get_global_rank(), load_path=checkpoint(sc, folder), **save)
        retried(trainer.fit)
        trainer.close()
        return {'error': None, 'steps': steps.steps}
    except Exception as e:  # the checker fails the scenario with it
        return {'error': (type(e).__name__, str(e)[:2000]), 'steps': {}, 'traceback': traceback.format_exc()[-3000:]}


def run(sc: dict, folder: Optional[str] = None) -> dict[str, Any]:
    """The scenario's life on this rank; see the module docstring. Resumed on another world size: the life after
    the first launch (:func:`save_first_fit`, into ``folder``), on ``resume_world`` ranks."""
    rank = dist.get_global_rank()
    world = sc.get('chain_world') or sc.get('resume_world') or sc['world']
    assert dist.get_world_size() == world, (dist.get_world_size(), world)
    out: dict[str, Any] = {'error': None}
    started = time.monotonic()
    trainer: Optional[Trainer] = None
    try:
        trainer, model, steps = first_fit(sc, rank, folder, out)
        if sc.get('twin'):  # a second Trainer with the same UnevenJoin trains the first fit again, from scratch
            joins = [a for a in trainer.state.algorithms if type(a).__name__ == 'UnevenJoin']
            twin, twin_model, _ = build(sc, rank, join=joins[0] if joins else None, faults=False)
            twin.fit()
            out['twin'] = {k: v.clone() for k, v in full_state(twin, twin_model, sc).items()}
            out['twin_time'] = [int(twin.state.timestamp.batch), int(twin.state.timestamp.sample)]
            twin.close()
        if sc.get('refit'):
            trainer.fit(duration='1ep')
        if sc.get('eval') in ('own', 'both'):
            retried(trainer.eval)
            out['eval_own'] = metrics_of(trainer, 'eval')
        if sc.get('eval') in ('passed', 'both'):
            passed = make_evaluator(sc, rank, 'passed')
            retried(lambda: trainer.eval(eval_dataloader=passed))
            out['eval_passed'] = metrics_of(trainer, 'passed')
        if sc.get('predict_shards') is not None:
            spec = eval_spec(sc, rank, 70, sc['predict_shards'], sc['batch'])
            predicted = retried(lambda: trainer.predict(spec, return_outputs=True))
            out['predictions'] = torch.cat([o.cpu() for o in predicted]) if predicted else torch.zeros(0, ref.CLASSES)
        ts = trainer.state.timestamp
        out.update(state=full_state(trainer, model, sc), steps=steps, batch=int(ts.batch), sample=int(ts.sample))
        out['token'] = int(ts.token)
        trainer.close()
    except Exception as e:  # the checker decides whether the scenario predicted it (a rank that raised is not
        out['error'] = (type(e).__name__, str(e)[:2000])  # closed: its barrier would hide the error)
        out['traceback'] = traceback.format_exc()[-3000:]
    if sc.get('resume_at') is not None and not sc.get('resume_world') and out['error'] is None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder_for(sc), ignore_errors=True)
    out['seconds'] = time.monotonic() - started
    return out
