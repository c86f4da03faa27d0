"""Nothing of a raised run survives it: the same trainer then fits, evaluates and predicts as a fresh one (issue 40).

A user retries a ``fit()`` (or ``eval()``, ``predict()``) that raised, in a notebook, on the same trainer. For every
event UnevenJoin routes (``composer_join.join.algorithm.ROUTES``, and the per-microbatch events at which the algorithm
pass isolates it), a callback, and where other algorithms run on a shadow microbatch an algorithm too, raises on
every rank at that event of a step (an evaluation batch, a ``predict()`` batch) where one rank shadows, with the
other algorithm :class:`scenarios_raised.Touch` at ``AFTER_DATALOADER`` (so UnevenJoin's stand-in is in place for
it on shadow steps). Then, right after the raise: the train and eval metric dicts hold every metric (stock leaves
them intact), no shadow step seems to run, and UnevenJoin left nothing on the user's ``DataSpec``, model and
optimizer (where the raise was inside Composer's own iterator over the dataloader, whose frames the kept error
holds: at the latest at the next fit's start). And with the weights and optimizer state put back to where every run starts, one fit, one evaluation and
one ``predict()`` on the same trainer equal those of a fresh trainer exactly: weights (difference 0), optimizer
state, batch sizes after ``AFTER_DATALOADER``, what the other algorithm was given, the samples of every forward,
metrics, predictions and the ``State`` fields stock Composer keeps (timestamps, ``dataloader_len``, metric dicts, the
loss). The errors are kept alive meanwhile, as a notebook keeps the last one's traceback.

Measured on the code before (issue 40): an algorithm raising at ``AFTER_DATALOADER`` after the stand-in was put in
place left it held, and every later fit trained the stand-in's two samples in place of each shadow step's zero
(weights 7.1e-3 and 1.9e-2 from a fresh trainer's); a raise between a stand-in keeping the metrics out and putting
them back left a shadowing rank's metric dict empty; a raise at ``BEFORE_DATALOADER`` left the ``DataSpec``'s split
wrapped and hooks on the model into the next fit; the BatchNorm statistics kept the stand-in's update.

Also the stand-in's buffer guard: with BatchNorm, the other algorithm running a forward on the stand-in (as
SelectiveBackprop does) and another raising after it, the shadowing rank's buffers are as before the forward.

Every scenario runs with the short rank first and last; all in one launch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from composer.core import Event

from harness import launch
from scenarios_raised import phase, raise_points
from test_join_core import ok

POINTS = raise_points()
ORDERS = (0, 1)  # the short rank
METRICS = {'train': ['SamplesSeen'], 'eval': ['MeanLoss', 'MulticlassAccuracy']}
# raised inside Composer's own iterator over the dataloader (``Trainer._iter_dataloader``): the kept error's frames
# hold the join's iterator suspended, so its changes are undone at the next start, not as the exception unwinds
INSIDE_COMPOSERS_ITERATOR = {'before_dataloader'}


@pytest.fixture(scope='module')
def runs() -> dict:
    calls = []
    for short in ORDERS:
        cfg = {'short': short, 'points': POINTS}
        calls += [
            (f'fresh@{short}', 'scenarios_raised:fresh', {'cfg': cfg}),
            (f'retry@{short}', 'scenarios_raised:raise_then_retry', {'cfg': cfg}),
            (f'guard@{short}', 'scenarios_raised:guard_after_raise', {'cfg': cfg}),
        ]
    return launch(2, calls, timeout=300)


def differences(a: Any, b: Any, where: str = '') -> list[str]:
    """Where ``a`` and ``b`` differ (tensors exactly, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        same = same and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f'{where}: {a} != {b}']
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f'{where}: keys {sorted(a)} != {sorted(b)}']
        return [d for k in a for d in differences(a[k], b[k], f'{where}.{k}')]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f'{where}: {a} != {b}']
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f'{where}[{i}]')]
    return [] if a == b else [f'{where}: {a!r} != {b!r}']


def _cycles(runs, short: int) -> list[list[dict]]:
    per_rank = ok(runs, f'retry@{short}')
    return [res['cycles'] for res in per_rank]


@pytest.mark.parametrize('short', ORDERS)
def test_every_raise_point_raised_on_every_rank(runs, short):
    for rank, cycles in enumerate(_cycles(runs, short)):
        assert [c['point'] for c in cycles] == [tuple(p) for p in POINTS]
        for c in cycles:
            kind, event = c['point']
            assert c['error'] == f'RuntimeError: raised at {event}', f'rank {rank}, {kind} at {event}: {c["error"]}'


@pytest.mark.parametrize('short', ORDERS)
def test_a_raise_leaves_metrics_and_objects_as_stock_does(runs, short):
    failures = []
    for rank, cycles in enumerate(_cycles(runs, short)):
        for c in cycles:
            kind, event = c['point']
            where = f'rank {rank}, {kind} raising at {event}'
            left = c['left']
            if left['objects'] and event not in INSIDE_COMPOSERS_ITERATOR:
                failures.append(f'{where}: left on the user objects {left["objects"]}')
            if left['at_next_start'] != {}:
                failures.append(f"{where}: at the next fit's start, left on the user objects {left['at_next_start']}")
            if left['train_metrics'] != METRICS['train']:
                failures.append(f'{where}: state.train_metrics holds {left["train_metrics"]}')
            for label, names in left['eval_metrics'].items():
                if names != METRICS['eval']:
                    failures.append(f'{where}: state.eval_metrics[{label!r}] holds {names}')
            if left['shadow_step']:
                failures.append(f'{where}: is_shadow_step(state) is still True')
    assert not failures, '\n'.join(failures)


@pytest.mark.parametrize('short', ORDERS)
def test_the_same_trainer_then_runs_as_a_fresh_one(runs, short):
    fresh = ok(runs, f'fresh@{short}')
    failures = []
    for rank, cycles in enumerate(_cycles(runs, short)):
        for c in cycles:
            kind, event = c['point']
            where = f'rank {rank}, after a {kind} raising at {event} ({phase(Event(event))})'
            if isinstance(c['retry'], str):
                failures.append(f'{where}: the retry raised {c["retry"]}')
                continue
            failures += differences(c['retry'], fresh[rank], where)
    assert not failures, '\n'.join(failures[:40]) + f'\n({len(failures)} differences)'


@pytest.mark.parametrize('short', ORDERS)
def test_a_stand_in_forward_for_another_algorithm_leaves_the_buffers_when_the_run_raises(runs, short):
    per_rank = ok(runs, f'guard@{short}')
    for res in per_rank:
        assert res['error'] == 'raised at after_dataloader'
        assert res['steps'] == 2  # raised at step 1, where the short rank shadows
    res, other = per_rank[short], per_rank[1 - short]
    assert res['before'].keys() == res['after'].keys() and res['before']
    for name in res['before']:
        assert torch.equal(res['before'][name], res['after'][name]), name
    # the forward did run, before the raise: it updated the other rank's statistics
    assert not torch.equal(
        other['before']['module.module.1.running_mean'], other['after']['module.module.1.running_mean']
    )
