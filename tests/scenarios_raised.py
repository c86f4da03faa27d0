"""Rank-side scenarios for tests/test_raised.py: a run that raises at some event, then the same trainer again.

:func:`raise_then_retry` builds one trainer with UnevenJoin (and :class:`Touch`, an algorithm at
``AFTER_DATALOADER``, so that UnevenJoin puts its stand-in in place for it on shadow steps) and, for each raise
point ``(kind, event)`` of the scenario, runs one fit, evaluation or ``predict()`` in which a callback (``kind``
``'callback'``) or an algorithm (``'algorithm'``) raises on every rank at ``event`` of a step or batch where the
short rank shadows. It records what the raise left (the train and eval metric dicts, whether a shadow step still
seems to run, what UnevenJoin left on the user's objects, see :func:`scenarios_undo.others_objects`), puts the
weights and optimizer state back to where every run starts (as a user reloads a checkpoint) and Composer's own
leftovers of a raised ``eval()`` (its evaluator stays registered, stock too), then runs :func:`program` on the
same trainer. :func:`fresh` runs :func:`program` on a new trainer built the same way: the two must be equal.

:func:`guard_after_raise` is the stand-in's buffer guard: a model with BatchNorm, :class:`Touch` running a forward
on the batch it is given (as SelectiveBackprop does), and an algorithm raising after it at a shadow step's
``AFTER_DATALOADER``: the shadowing rank's buffers must be as they were before the stand-in's forward.
Not a test module.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from composer import Callback, Trainer
from composer.core import Algorithm, DataSpec, Event
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import UnevenJoin, is_shadow_step
from composer_join.join.algorithm import MICROBATCH_EVENTS, ROUTES
from rank_scenarios import ShardWithLen, ToyModel, quiet_trainer
from scenarios_undo import left_behind, others_objects
from toy import shard, unpack

BATCH = 4
# (the long rank's samples, the short rank's), and the seed of the shard: the short rank shadows step (batch) 1
DATA = {'train': ((12, 4), 0), 'eval': ((9, 3), 50), 'predict': ((6, 1), 80)}
# events that fire once per fit, evaluation or predict(); the others once per step (or batch): raised at the second
ONCE = {
    Event.FIT_START,
    Event.EPOCH_START,
    Event.EPOCH_END,
    Event.EPOCH_CHECKPOINT,
    Event.FIT_END,
    Event.EVAL_START,
    Event.EVAL_END,
    Event.PREDICT_START,
    Event.PREDICT_END,
}
UNFIRED = {Event.ITERATION_CHECKPOINT}  # only with iterations (Composer's _iteration_length), not here


def phase(event: Event) -> str:
    """Which call an event belongs to: ``'eval'``, ``'predict'`` or ``'fit'``."""
    return 'eval' if event.name.startswith('EVAL_') else 'predict' if event.name.startswith('PREDICT_') else 'fit'


def raise_points() -> list[tuple[str, str]]:
    """Every event UnevenJoin routes (and the per-microbatch ones), raised from a callback; from an algorithm too
    where other algorithms run on a shadow microbatch (not at the per-microbatch events, where only UnevenJoin runs:
    an algorithm there would raise on the ranks with data only)."""
    events = sorted((set(ROUTES) | MICROBATCH_EVENTS) - UNFIRED, key=lambda e: list(Event).index(e))
    points = [('callback', e.value) for e in events]
    points += [('algorithm', e.value) for e in events if e not in MICROBATCH_EVENTS]
    return points


class Raiser:
    """Raises at the ``occurrence``-th ``event`` since it was made (0: the first)."""

    def __init__(self, event: str):
        self.event = Event(event)
        self.occurrence = 0 if self.event in ONCE else 1
        self.seen = 0

    def maybe_raise(self, event: Event) -> None:
        if event == self.event:
            self.seen += 1
            if self.seen == self.occurrence + 1:
                raise RuntimeError(f'raised at {event.value}')


class RaisingCallback(Callback):
    def __init__(self, event: str):
        self.raiser = Raiser(event)

    def run_event(self, event, state, logger):
        self.raiser.maybe_raise(event)


class RaisingAlgorithm(Algorithm):
    def __init__(self, event: str):
        self.raiser = Raiser(event)

    def match(self, event, state):
        return event == self.raiser.event

    def apply(self, event, state, logger):
        self.raiser.maybe_raise(event)


class Touch(Algorithm):
    """Another algorithm at ``AFTER_DATALOADER``: records the samples it is given; with ``forward``, runs the model on
    them without gradients, as SelectiveBackprop does (updating BatchNorm statistics in training mode)."""

    def __init__(self, forward: bool = False):
        self.forward = forward
        self.seen: list[int] = []

    def match(self, event, state):
        return event == Event.AFTER_DATALOADER

    def apply(self, event, state, logger):
        self.seen.append(len(unpack(state.batch)[1]))
        if self.forward:
            with torch.no_grad():
                state.model(state.batch)


class AtFitStart(Callback):
    """Calls ``look()`` at ``FIT_START`` (after the algorithms: UnevenJoin's start has run), keeps what it gives."""

    def __init__(self, look):
        self.look, self.seen = look, None

    def fit_start(self, state, logger):
        self.seen = self.look()


class Sizes(Callback):
    """Per step, the samples in the batch Composer trains (after ``AFTER_DATALOADER``); the buffers before it."""

    def __init__(self):
        self.sizes: list[int] = []
        self.buffers: list[dict[str, torch.Tensor]] = []

    def before_dataloader(self, state, logger):
        self.buffers.append({k: v.detach().clone() for k, v in state.model.named_buffers()})

    def batch_start(self, state, logger):
        self.sizes.append(len(unpack(state.batch)[1]))


def _loader(kind: str, rank: int, short: int) -> DataLoader:
    (long_n, short_n), seed = DATA[kind]
    x, y = shard(seed + rank, short_n if rank == short else long_n)
    return DataLoader(ShardWithLen(x, y), batch_size=BATCH)


def _trainer(model: ToyModel, optimizer: torch.optim.Optimizer, touch: Touch, sizes: Sizes) -> Trainer:
    return quiet_trainer(
        model=model,
        optimizers=optimizer,
        algorithms=[UnevenJoin(), touch],
        callbacks=[sizes],
        device_train_microbatch_size=BATCH,
    )


def _state_fields(state, call: str) -> dict[str, Any]:
    """The parts of Composer's ``State`` that ``call`` (``'fit'``, ``'eval'``, ``'predict'``) sets, which a retry must
    leave as a fresh trainer does (what earlier calls left there is the trainer's history, stock Composer's)."""
    ts = state.timestamp
    fields: dict[str, Any] = {
        'timestamp': [int(ts.epoch), int(ts.batch), int(ts.sample), int(ts.token), int(ts.batch_in_epoch)],
        'dataloader_len': None if state.dataloader_len is None else int(state.dataloader_len),
        'dataloader_label': state.dataloader_label,
        'device_train_microbatch_size': state.device_train_microbatch_size,
        'train_metrics': sorted(state.train_metrics),
        'train_metric_values': {k: float(v) for k, v in state.train_metric_values.items()},
        'total_loss_dict': dict(state.total_loss_dict),
        'evaluators': [e.label for e in state.evaluators],
    }
    if call in ('eval', 'predict'):
        fields['eval_timestamp'] = [int(state.eval_timestamp.batch), int(state.eval_timestamp.sample)]
        fields['eval_metrics'] = sorted(state.eval_metrics.get('eval', {}))
        fields['eval_metric_values'] = {k: float(v) for k, v in state.eval_metric_values.items()}
    if call == 'predict':
        fields['predict_timestamp'] = [int(state.predict_timestamp.batch), int(state.predict_timestamp.sample)]
    return fields


def program(trainer: Trainer, model: ToyModel, touch: Touch, sizes: Sizes, loaders: dict[str, Any]) -> dict:
    """One fit, one evaluation, one ``predict()``: what each gives on this rank."""
    sizes.sizes, touch.seen, model.forward_sizes = [], [], []
    trainer.fit(train_dataloader=loaders['train'], duration='1ep', reset_time=True)
    params = {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()}
    optimizer = copy.deepcopy(trainer.state.optimizers[0].state_dict()['state'])
    after_fit = _state_fields(trainer.state, 'fit')
    trainer.eval(eval_dataloader=loaders['eval'])
    after_eval = _state_fields(trainer.state, 'eval')
    outputs = trainer.predict(loaders['predict'], return_outputs=True)
    return {
        'params': params,
        'optimizer': optimizer,
        'sizes': list(sizes.sizes),
        'seen_by_others': list(touch.seen),
        'forward_sizes': list(model.forward_sizes),
        'after_fit': after_fit,
        'after_eval': after_eval,
        'after_predict': _state_fields(trainer.state, 'predict'),
        'predictions': torch.cat([o.cpu() for o in outputs]),
    }


def _setup(short: int) -> tuple[Trainer, ToyModel, Touch, Sizes, dict[str, Any]]:
    rank = dist.get_global_rank()
    model = ToyModel('mlp', train_metrics=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    touch, sizes = Touch(), Sizes()
    loaders = {kind: _loader(kind, rank, short) for kind in DATA}
    loaders['train'] = DataSpec(loaders['train'])  # the user's own DataSpec: UnevenJoin wraps its split, per iteration
    return _trainer(model, optimizer, touch, sizes), model, touch, sizes, loaders


def fresh(cfg: dict) -> dict[str, Any]:
    """:func:`program` on a new trainer."""
    trainer, model, touch, sizes, loaders = _setup(cfg['short'])
    try:
        return program(trainer, model, touch, sizes, loaders)
    finally:
        trainer.close()


def _call(trainer: Trainer, kind: str, loaders: dict[str, Any]) -> None:
    if kind == 'fit':
        trainer.fit(train_dataloader=loaders['train'], duration='1ep', reset_time=True)
    elif kind == 'eval':
        trainer.eval(eval_dataloader=loaders['eval'])
    else:
        trainer.predict(loaders['predict'])


def raise_then_retry(cfg: dict) -> dict[str, Any]:
    """For each raise point of ``cfg['points']``: the raised call, what it left, then :func:`program` again."""
    trainer, model, touch, sizes, loaders = _setup(cfg['short'])
    start = (copy.deepcopy(model.state_dict()), copy.deepcopy(trainer.state.optimizers[0].state_dict()))
    state, kept = trainer.state, []  # every raised error, kept as a notebook keeps the last one (its traceback)
    cycles = []
    try:
        for kind, event in cfg['points']:
            raiser: Any = RaisingCallback(event) if kind == 'callback' else RaisingAlgorithm(event)
            hosts = state.callbacks if kind == 'callback' else state.algorithms
            hosts.append(raiser)
            evaluators = list(state.evaluators)
            before = others_objects(loaders['train'], model, state.optimizers[0])
            error: Optional[str] = None
            try:
                _call(trainer, phase(Event(event)), loaders)
            except Exception as e:  # expected: the test checks it is the raiser's
                error = f'{type(e).__name__}: {e}'
                kept.append(e)
            hosts.remove(raiser)
            left = {
                'objects': left_behind(before, others_objects(loaders['train'], model, state.optimizers[0])),
                'train_metrics': sorted(state.train_metrics),
                'eval_metrics': {label: sorted(metrics) for label, metrics in state.eval_metrics.items()},
                'shadow_step': is_shadow_step(state),
            }
            state.evaluators[:] = evaluators  # Composer's own leftover of a raised eval() (stock too)
            model.load_state_dict(start[0])
            state.optimizers[0].load_state_dict(start[1])
            # at the next fit's start nothing of the raised run is left, even where the kept error holds it
            at_start = AtFitStart(
                lambda before=before: left_behind(before, others_objects(loaders['train'], model, state.optimizers[0]))
            )
            state.callbacks.append(at_start)
            retry: Any
            try:
                retry = program(trainer, model, touch, sizes, loaders)
            except Exception as e:  # reported by the test
                retry = f'{type(e).__name__}: {e}'
            state.callbacks.remove(at_start)
            left['at_next_start'] = at_start.seen
            cycles.append({'point': (kind, event), 'error': error, 'left': left, 'retry': retry})
    finally:
        trainer.close()
    return {'cycles': cycles}


def guard_after_raise(cfg: dict) -> dict[str, Any]:
    """BatchNorm model; an algorithm raises after :class:`Touch`'s forward at a shadow step's ``AFTER_DATALOADER``:
    each rank's buffers before that step's dataloader and after the raise."""
    rank = dist.get_global_rank()
    model = ToyModel('bn')
    touch, sizes = Touch(forward=True), Sizes()
    trainer = _trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), touch, sizes)
    # before Touch in the list: Composer runs the algorithms in reverse at AFTER_* events, so it raises after Touch
    trainer.state.algorithms.insert(1, RaisingAlgorithm(Event.AFTER_DATALOADER.value))
    error = None
    try:
        trainer.fit(train_dataloader=_loader('train', rank, cfg['short']), duration='1ep')
    except RuntimeError as e:
        error = str(e)
    after = {k: v.detach().clone() for k, v in trainer.state.model.named_buffers()}
    trainer.close()
    return {'error': error, 'before': sizes.buffers[-1], 'after': after, 'steps': len(sizes.buffers)}
