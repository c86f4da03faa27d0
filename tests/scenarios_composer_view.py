"""Rank-side scenarios for tests/test_composer_view.py (issue 51): what Composer and a callback read. Not a test module.

Every scenario builds one Composer ``Trainer`` over the toy MLP (SGD, lr 0.1, momentum 0.9) and runs a sequence of
calls on it (``fit``, ``eval``, ``predict``, a fit in pieces, a raise then a retry), with UnevenJoin or without it
(``stock``). A :class:`View` callback records at every event what any callback can read: which dataloader
``state.dataloader`` is (the user's by name, or ``join:<name>`` for UnevenJoin's loader over it), ``dataloader_len``,
the timestamp, the learning rate, Composer's checkpointed attributes. A :class:`Clocks` callback all-gathers the
clocks at every batch end and records any difference between the ranks. Each rank's shard of loader ``name`` is
``toy.shard(rank + seed, n)`` (seed and sizes in the scenario), read in batches of :data:`BATCH` in order, so the
test's single-process reference rebuilds every batch without this module.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from composer import Algorithm, Callback, Event
from composer.callbacks import NaNMonitor
from composer.core import DataSpec
from composer.loggers import InMemoryLogger
from composer.optim import CosineAnnealingScheduler, StepScheduler
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import CollectiveCounter, UnevenJoin
from rank_scenarios import ShardWithLen, ToyLMModel, ToyModel, _Streamed, lm_tokens, quiet_trainer
from toy import lm_batch, lm_shard, shard

BATCH = 8
LR, MOMENTUM = 0.1, 0.9


def size(spec: dict, rank: int, rot: int = 0) -> int:
    """Rank ``rank``'s samples of ``spec`` (``sizes``: one per rank, rotated by ``rot`` so that each rank is short)."""
    sizes = spec['sizes']
    return sizes[(rank + rot) % len(sizes)]


def loader(spec: dict, rank: int, rot: int = 0) -> DataLoader:
    """This rank's loader of ``spec`` (its :func:`size`, ``seed``)."""
    x, y = shard(rank + spec['seed'], size(spec, rank, rot))
    return DataLoader(ShardWithLen(x, y), batch_size=BATCH, collate_fn=_collate)


def _collate(samples):
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


class View(Callback):
    """At every event, what a callback reads (see the module docstring); ``names``: ``id`` of each user's loader."""

    def __init__(self, names: dict[int, str]):
        self.names, self.records = names, []

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        self.records.append(
            {
                'event': event.value,
                'dataloader': self._name(state.dataloader),
                'label': state.dataloader_label,
                'dataloader_len': None if state.dataloader_len is None else int(state.dataloader_len),
                'timestamp': tuple(int(v) for v in _clock(state.timestamp)),
                'lr': [g['lr'] for o in state.optimizers for g in o.param_groups],
                'serialized': tuple(state.serialized_attributes),
            }
        )
        super().run_event(event, state, logger)

    def _name(self, dataloader: Any) -> Optional[str]:
        if dataloader is None:
            return None
        if id(dataloader) in self.names:
            return self.names[id(dataloader)]
        if any(c.__name__ == 'JoinLoader' for c in type(dataloader).__mro__):  # (by name: no composer_join internals)
            return 'join:' + self.names.get(id(dataloader.dataloader), '?')
        return type(dataloader).__name__


def _clock(ts: Any) -> tuple:
    return (ts.epoch, ts.batch, ts.batch_in_epoch, ts.sample, ts.sample_in_epoch, ts.token)


class Clocks(Callback):
    """At every batch end, every rank's clocks (timestamp, ``dataloader_len``, learning rate) gathered; any step where
    they differ between ranks is kept in ``differences``."""

    def __init__(self):
        self.differences: list[Any] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        mine = (
            _clock(state.timestamp),
            None if state.dataloader_len is None else int(state.dataloader_len),
            [g['lr'] for o in state.optimizers for g in o.param_groups],
        )
        every = dist.all_gather_object(mine)
        if any(v != every[0] for v in every):
            self.differences.append((int(state.timestamp.batch), every))


class Raises(Callback):
    """Raises once, at the first ``event`` it sees."""

    def __init__(self, event: str):
        self.event, self.done = event, False

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        if event.value == self.event and not self.done:
            self.done = True
            raise RuntimeError(f'raised at {event.value}')


class ChecksLoaderType(Algorithm):
    """Composer's RandAugment, AugMix and ColOut check ``isinstance(state.dataloader, DataLoader)`` in ``match`` at
    ``FIT_START`` (and raise otherwise); this one does the same and records what it saw."""

    def __init__(self):
        self.seen: list[str] = []

    def match(self, event: Event, state: Any) -> bool:
        if event == Event.FIT_START:
            if not isinstance(state.dataloader, DataLoader):
                raise TypeError(f'a PyTorch DataLoader is required, got {type(state.dataloader).__name__}')
            self.seen.append(type(state.dataloader.dataset).__name__)  # (RandAugment transforms the dataset)
        return False

    def apply(self, event: Event, state: Any, logger: Any) -> None:
        pass


def _schedule(name: Optional[str]) -> Any:
    if name == 'step':
        return StepScheduler(step_size='1ep', gamma=0.5)
    if name == 'cosine':
        return CosineAnnealingScheduler(t_max='1dur', alpha_f=0.1)
    return None


def sequence(cfg: dict) -> dict[str, Any]:
    """Run ``cfg['calls']`` on one trainer (see the module docstring) and return what each rank saw.

    ``cfg``: ``join`` (UnevenJoin's kwargs, or None for stock Composer), ``rot`` (the sizes' rotation), ``loaders``
    (name -> spec), ``trainer`` (the constructor's ``train`` and ``eval`` loader names, ``max_duration``,
    ``schedule``, ``spin``), ``counter`` (a :class:`~composer_join.CollectiveCounter` among the callbacks), ``calls``
    (``['fit', kwargs]``, ``['eval', name]``, ``['predict', name]``; a fit's
    ``train`` and ``schedule`` name a loader and a schedule), ``raise_at`` (an event at which a callback raises once;
    the call it raises in is run again), ``resume`` (``{'folder': ..., 'at': '2ba'}``: a first trainer built alike
    fits that long and saves a checkpoint there; the trainer the calls run on loads it: a mid-epoch resume).
    """
    rank, rot = dist.get_global_rank(), cfg.get('rot', 0)
    loaders = {name: loader(spec, rank, rot) for name, spec in cfg['loaders'].items()}
    names = {id(dl): name for name, dl in loaders.items()}
    view, clocks, checks = View(names), Clocks(), ChecksLoaderType()
    algorithms: list[Any] = [checks]
    if cfg.get('join') is not None:
        algorithms.append(UnevenJoin(**cfg['join']))
    callbacks: list[Any] = [view, clocks] + ([CollectiveCounter()] if cfg.get('counter') else [])
    if cfg.get('raise_at'):
        callbacks.append(Raises(cfg['raise_at']))
    ctor = cfg['trainer']

    def build(algorithms: list[Any], callbacks: list[Any], **extra: Any) -> tuple[Any, ToyModel]:
        torch.manual_seed(0)
        model = ToyModel('mlp')
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        trainer = quiet_trainer(
            model=model,
            optimizers=optimizer,
            train_dataloader=loaders[ctor['train']],
            eval_dataloader=loaders[ctor['eval']] if ctor.get('eval') else None,
            eval_interval=ctor.get('eval_interval', 1),
            max_duration=ctor.get('max_duration'),
            schedulers=_schedule(ctor.get('schedule')),
            spin_dataloaders=ctor.get('spin', True),
            algorithms=algorithms,
            callbacks=callbacks,
            **extra,
        )
        return trainer, model

    resume, extra = cfg.get('resume'), {}
    if resume is not None:  # a first trainer saves a checkpoint mid-epoch; the one the calls run on loads it
        first, _ = build(
            [UnevenJoin(**cfg['join'])] if cfg.get('join') is not None else [],
            [],
            save_folder=resume['folder'],
            save_interval=resume['at'],
            save_overwrite=True,
        )
        first.fit(duration=resume['at'])
        first.close()
        extra = {'load_path': f'{resume["folder"]}/ep0-ba{resume["at"][:-2]}-rank0.pt'}
    trainer, model = build(algorithms, callbacks, **extra)
    raised, results, lrs = [], [], []
    for kind, arg in cfg['calls']:
        for attempt in range(2):
            try:
                results.append(_call(trainer, loaders, kind, arg))
                break
            except RuntimeError as e:
                if 'raised at' not in str(e) or attempt:
                    raise
                raised.append(str(e))
    lrs = [r['lr'][0] for r in view.records if r['event'] == 'batch_start']
    return {
        'view': view.records,
        'differences': clocks.differences,
        'raised': raised,
        'loader_types': checks.seen,
        'lrs': lrs,
        'results': results,
        'params': {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()},
    }


def _call(trainer: Any, loaders: dict, kind: str, arg: Any) -> Any:
    if kind == 'fit':
        kwargs = dict(arg)
        if 'train' in kwargs:
            kwargs['train_dataloader'] = loaders[kwargs.pop('train')]
        if 'schedule' in kwargs:
            kwargs['schedulers'] = _schedule(kwargs.pop('schedule'))
        trainer.fit(**kwargs)
        return None
    if kind == 'eval':
        trainer.eval(eval_dataloader=loaders[arg])
        return {k: float(v.compute()) for k, v in trainer.state.eval_metrics['eval'].items()}
    if kind == 'predict':
        outputs = trainer.predict(loaders[arg], return_outputs=True)
        return [o.shape[0] for o in outputs]
    raise ValueError(kind)


# -- a stand-in whose loss is a mean over no token ------------------------------------------------------------------


def _prompt_only(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``lm_batch``, but its first two sequences carry no loss-generating token (prompt-only, as truncated SFT data
    has): the stand-in UnevenJoin makes from a batch's first samples then has none."""
    batch = lm_batch(seqs)
    batch['labels'][:2] = -100
    return batch


def nan_loss(cfg: dict) -> dict[str, Any]:
    """Rank ``cfg['empty']`` has no data; the other's batches start with two prompt-only sequences. With
    ``accumulate_train_batch_on_tokens=True`` and the loss a mean over loss-generating tokens, a stand-in's own loss
    is NaN: it must reach neither the logged loss nor a ``NaNMonitor``."""
    rank = dist.get_global_rank()
    n = 0 if rank == cfg['empty'] else cfg['samples']
    seqs = lm_shard(rank, n)
    train = DataLoader(seqs, batch_size=4, collate_fn=_prompt_only)
    spec = DataSpec(_Streamed(train), get_num_tokens_in_batch=lm_tokens)
    model = ToyLMModel()
    memory = InMemoryLogger()
    trainer = quiet_trainer(
        model=model,
        optimizers=torch.optim.SGD(model.parameters(), lr=LR),
        train_dataloader=spec,
        max_duration='1ep',
        accumulate_train_batch_on_tokens=True,
        device_train_microbatch_size=4,
        algorithms=[UnevenJoin()] if cfg.get('join', True) else [],
        callbacks=[NaNMonitor()],
        loggers=[memory],
    )
    trainer.fit()
    logged = [float(v) for _, v in memory.data.get('loss/train/total', [])]
    return {
        'logged': logged,
        'finite': all(math.isfinite(v) for v in logged),
        'params': {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()},
    }


def fit_after_refusal(cfg: dict) -> dict[str, Any]:
    """A fit that UnevenJoin refuses at ``FIT_START`` (GhostBatchNorm beside it), then, that algorithm removed, a fit
    on the same trainer; and the same fit on a stock trainer. What ``state.dataloader`` was after the refusal."""
    from composer.algorithms import GhostBatchNorm

    from composer_join import UnevenInputsError

    rank = dist.get_global_rank()
    out: dict[str, Any] = {}
    for joined in (True, False):
        torch.manual_seed(0)
        model = ToyModel('mlp')
        ghost = GhostBatchNorm(ghost_batch_size=4)
        train = loader(cfg['loaders']['A'], rank)
        trainer = quiet_trainer(
            model=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
            train_dataloader=train,
            max_duration='1ep',
            algorithms=[ghost, UnevenJoin()] if joined else [],
        )
        if joined:
            try:
                trainer.fit()
            except UnevenInputsError as e:
                out['refused'] = str(e)
            out['left'] = 'user' if trainer.state.dataloader is train else type(trainer.state.dataloader).__name__
            trainer.state.algorithms.remove(ghost)
        trainer.fit()
        out['joined' if joined else 'stock'] = {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()}
    return out
