"""Rank-side scenarios for tests/test_undo.py: a ``fit()`` with UnevenJoin that raises half-way, then stock Composer
on the same ``DataSpec``, model and optimizer. Not a test module.

:func:`fail_then_stock` builds the user's objects (a ``DataSpec`` of their own with a custom ``split_batch``, a
``ComposerModel``, an optimizer, SAM's where asked), fits with UnevenJoin until the run raises (a rank's dataset
fails once, or every rank raises from a callback in the middle of a step, while some rank shadows), and reports
what UnevenJoin left on those objects (:func:`left_behind`). Then one epoch of stock Composer (no algorithm)
on the same objects, and one on fresh copies of them (the same weights and optimizer state, a new
``DataSpec`` and dataset): the two must end with the same weights.
"""

from __future__ import annotations

import copy
import gc
import warnings
from typing import Any, Optional

import torch
from composer import Callback, Trainer
from composer.algorithms.sam.sam import SAMOptimizer
from composer.core import DataSpec
from composer.utils import dist
from torch.utils.data import DataLoader

import devices
from composer_join import UnevenJoin
from rank_scenarios import SizedIdShard, ToyModel
from scenarios_fsdp import cpu_fsdp_workarounds, parallelism
from scenarios_stock_parity import split_in_pairs

_COLLECTIVES = ('all_reduce', 'all_gather', 'broadcast', 'reduce_scatter', 'barrier')


class FailsOnce(SizedIdShard):
    """:class:`SizedIdShard` whose iteration raises at sample ``fail_at`` the first time only (a transient read error)."""

    def __iter__(self):
        for i, sample in enumerate(zip(self.x, self.y, self.ids)):
            if i == self.fail_at:
                self.fail_at = None
                raise RuntimeError(f'disk read error at sample {i}')
            yield sample


class RaiseAt(Callback):
    """Raises on every rank at ``event`` of training step ``step`` (its first microbatch): the run stops there."""

    def __init__(self, step: int, event: str):
        self.step, self.event = step, event

    def run_event(self, event, state, logger):
        if event.value == self.event and int(state.timestamp.batch) == self.step:
            raise RuntimeError(f'raised at {self.event} of step {self.step}')


def _ours(value: Any) -> bool:
    """Whether ``value`` (a hook, an attribute) is UnevenJoin's: defined in composer_join, or bound to its object."""
    owner = getattr(value, '__self__', None)
    where = [getattr(value, '__module__', None), type(owner).__module__ if owner is not None else None]
    return any(isinstance(m, str) and m.startswith('composer_join') for m in where)


def others_objects(spec: DataSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What UnevenJoin may change on objects it does not own, as comparable data."""
    modules = list(model.modules())
    hooks = [h for m in modules for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    return {
        'spec': {k: id(v) for k, v in vars(spec).items()},  # split_batch among them: the very same object
        # an instance attribute over a method of the class: a stand-in left on the object
        'model': sorted(
            f'{type(m).__name__}.{k}' for m in modules for k in vars(m) if callable(getattr(type(m), k, None))
        ),
        'hooks': sorted(repr(h) for h in hooks if _ours(h)),
        'optimizer': sorted(k for k in vars(optimizer) if callable(getattr(type(optimizer), k, None))),
        'collectives': {n: id(getattr(torch.distributed, n)) for n in _COLLECTIVES},
        'warning_filters': [repr(f) for f in warnings.filters],
    }


def left_behind(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The entries of :func:`others_objects` that differ (empty: nothing left behind)."""
    return {k: (before[k], after[k]) for k in before if before[k] != after[k]}


def _objects(cfg: dict, rank: int, fail_at: Optional[int]) -> tuple[DataSpec, ToyModel, torch.optim.Optimizer]:
    dataset = FailsOnce(rank, cfg['shards'][rank], fail_at)
    spec = DataSpec(DataLoader(dataset, batch_size=4), split_batch=split_in_pairs)
    model = ToyModel('mlp')
    optimizer = _optimizer(cfg, model)
    return spec, model, optimizer


def _optimizer(cfg: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return SAMOptimizer(sgd, rho=0.05) if cfg.get('sam') else sgd


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds the state: SAM's base optimizer, or the optimizer itself."""
    return getattr(optimizer, 'base_optimizer', optimizer)


def _trainer(cfg: dict, spec: DataSpec, model, optimizer, algorithms=(), callbacks=(), duration='1ep') -> Trainer:
    return Trainer(
        model=model,
        train_dataloader=spec,
        optimizers=optimizer,
        max_duration=duration,
        algorithms=list(algorithms),
        callbacks=list(callbacks),
        device_train_microbatch_size=2,
        parallelism_config=parallelism(cfg.get('wrapper', 'ddp'), {}),
        device=devices.trainer_device(),
        progress_bar=False,
        log_to_console=False,
        seed=0,
    )


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])


def fail_then_stock(cfg: dict) -> dict[str, Any]:
    """A fit with UnevenJoin that raises, what it left behind, then stock Composer on the same and on fresh objects."""
    cpu_fsdp_workarounds()
    rank = dist.get_global_rank()
    spec, model, optimizer = _objects(cfg, rank, cfg.get('fail_at', {}).get(rank))
    callbacks = [RaiseAt(*cfg['raise_at'])] if cfg.get('raise_at') else []
    failing = _trainer(cfg, spec, model, optimizer, [UnevenJoin()], callbacks, duration='2ep')
    before = others_objects(spec, model, optimizer)
    error = None
    try:
        failing.fit()
    except Exception as e:  # what the run raised: the test checks it is the expected one
        error = (type(e).__name__, str(e))
    left = left_behind(before, others_objects(spec, model, optimizer))
    failing.close()
    del failing  # its DDP wrapper's gradient hooks leave the parameters with it (stock Composer's as well)
    gc.collect()
    if cfg.get('wrapper', 'ddp') != 'ddp':  # FSDP wraps the model in place: no second Trainer on it
        return {'error': error, 'left': left}
    weights = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(_inner(optimizer).state_dict())  # SAM's own state_dict leaves out momentum
    # stock Composer on the same objects (the dataset fails no more), and on fresh ones in the same state
    reused = _trainer(cfg, spec, model, optimizer)
    reused.fit()
    fresh_spec, fresh_model, fresh_optimizer = _objects(cfg, rank, None)
    fresh_model.load_state_dict(weights)
    _inner(fresh_optimizer).load_state_dict(optimizer_state)
    fresh = _trainer(cfg, fresh_spec, fresh_model, fresh_optimizer)
    fresh.fit()
    for trainer in (reused, fresh):
        trainer.close()
    return {
        'error': error,
        'left': left,
        'reused': _weights(model),
        'fresh': _weights(fresh_model),
        'stock_steps': int(reused.state.timestamp.batch),
    }
