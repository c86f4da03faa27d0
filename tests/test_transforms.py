"""A ``DataSpec``'s ``batch_transforms``: stand-ins made as Composer makes a microbatch, counts of what it trains.

Issue 46, cases 1 and 3, on 2 real ranks (the short or empty rank first and last), each against a single-process
reference that applies the same transform and does not import composer_join (:func:`reference`):

1. ``uint8`` data with a float ``batch_transforms`` (``x / 255``, the shape of Composer's image recipes). A rank with
   no real microbatch of a loader (an empty train shard, an empty eval or predict shard, a rank whose data ended
   before the checkpoint a run resumed from) ran its stand-in forward on the template as the dataloader yielded it:
   measured before the fix, 40/0 train, 12/0 eval and a resume at batch 3 of 40/16 all crashed (``mat1 and mat2
   must have the same dtype, but got Byte and Float`` on the shadowing rank, ``Connection closed by peer`` on the
   other). The stand-in now goes through the ``DataSpec``'s ``batch_transforms``, ``batch_to_device``, Composer's
   split and ``microbatch_transforms`` (:meth:`composer_join.join.microbatches.Microbatches.template`).
3. A transform that yields two views per sample (a batch of 8 trains 16), shards 40/24: the counts that decide
   DDP's "last microbatch" (the gradient-presence all-reduce, the unused-parameter take-back, ``multi_auto_sync``'s
   switch) were the loader's, before the transform: measured before the fix, a gloo abort
   (``op.preamble.length <= op.nbytes``) under ``single_auto_sync`` (with microbatches of 8 and of 16),
   ``multi_auto_sync`` and ``forced_sync``. They are now counted again at ``AFTER_DATALOADER``, after the transform,
   on every rank where some rank's ``DataSpec`` has one (an agreed fact).

A 12/0 ``predict()`` timed out in a collective on both ranks before the fix (``predict()``'s own ``DataSpec`` was not
found: Composer's default stood in). Stock Composer on the same data, measured with ``join=None``: 40/0 trains 0 of 40
samples, 12/0 evaluates 0 of 12 (``MeanLoss`` NaN) and predicts 0 of 12, 40/16 has no batch 3 to resume from (its
epoch stops after 2 steps), 40/24 with two views trains 3 of 5 steps (48 of 64 loaded samples, 7.6e-2 from one
process).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import launch
from scenarios_transforms import BATCH, LR, MOMENTUM, TRANSFORMS, shard
from test_join_core import ok
from toy import make_module

TOL = 1e-6
JOIN: dict = {}

BASE = {
    # case 1: a stand-in the model can take
    'train_empty': dict(shards=[40, 0], transform='float'),
    'train_uneven': dict(shards=[40, 21], transform='float'),  # exact before the fix too
    'eval_empty': dict(shards=[16, 16], eval_shards=[12, 0], transform='float'),
    'predict_empty': dict(shards=[16, 16], predict_shards=[12, 0], transform='float'),
    'resume_ended': dict(shards=[40, 16], transform='float', resume_at=3),
    # case 3: counts after the transform
    'views_single': dict(shards=[40, 24], transform='views'),
    'views_single_mb16': dict(shards=[40, 24], transform='views', microbatch=16),
    'views_multi': dict(shards=[40, 24], transform='views', sync='multi_auto_sync'),
    'views_forced': dict(shards=[40, 24], transform='views', sync='forced_sync'),
    'views_multi_mb4_eval': dict(
        shards=[40, 24], eval_shards=[12, 0], transform='views', sync='multi_auto_sync', microbatch=4, epochs=2
    ),
}


def _rotated(cfg: dict, short: int) -> dict:
    """``cfg`` with the short (or empty) rank ``short``: the shard lists as given put it last."""
    out = dict(cfg, join=JOIN)
    for key in ('shards', 'eval_shards', 'predict_shards'):
        if key in cfg and short == 0:
            out[key] = list(reversed(cfg[key]))
    return out


SCENARIOS = {f'{name}@short{short}': _rotated(cfg, short) for name, cfg in BASE.items() for short in (0, 1)}


def reference(cfg: dict) -> dict:
    """One process, no composer_join: the transformed batches of every rank at step ``t`` (those that have one),
    the mean of the per-sample losses over them times ``A_t / W``; SGD with momentum. Then the evaluation (every
    rank's samples at once) and each rank's predictions."""
    transform = TRANSFORMS[cfg['transform']]
    world = len(cfg['shards'])
    module = make_module('mlp')
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)

    def batches(seed: int, n: int) -> list:
        x, y = shard(seed, n)
        return [transform((x[i : i + BATCH], y[i : i + BATCH])) for i in range(0, n, BATCH)]

    per_rank = [batches(10 + r, n) for r, n in enumerate(cfg['shards'])]
    steps = max(len(b) for b in per_rank)
    step_params = []
    for _ in range(cfg.get('epochs', 1)):
        for t in range(steps):
            active = [r for r in range(world) if t < len(per_rank[r])]
            samples = sum(len(per_rank[r][t][1]) for r in active)
            loss = sum(F.cross_entropy(module(per_rank[r][t][0]), per_rank[r][t][1], reduction='sum') for r in active)
            optimizer.zero_grad()
            (loss / samples * len(active) / world).backward()
            optimizer.step()
            step_params.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
    out: dict = {'params': {n: p.detach().clone() for n, p in module.named_parameters()}, 'step_params': step_params}
    with torch.no_grad():
        if cfg.get('eval_shards') is not None:
            everything = [b for r, n in enumerate(cfg['eval_shards']) for b in batches(50 + r, n)]
            losses = torch.cat([F.cross_entropy(module(x), y, reduction='none') for x, y in everything])
            out['eval'] = {
                'LossSum': float(losses.sum()),
                'Count': float(len(losses)),
                'MeanLoss': float(losses.mean()),
            }
        if cfg.get('predict_shards') is not None:
            out['predictions'] = [
                torch.cat([module(x) for x, _ in batches(70 + r, n)]) if n else torch.zeros(0, 3)
                for r, n in enumerate(cfg['predict_shards'])
            ]
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp('transforms'))
    calls = []
    for name, cfg in SCENARIOS.items():
        cfg = dict(cfg, folder=f'{folder}/{name}') if 'resume_at' in cfg else cfg
        calls.append((name, 'scenarios_transforms:run', {'cfg': cfg}))
    return launch(2, calls, timeout=420)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


@pytest.mark.parametrize('name', list(SCENARIOS))
def test_equals_one_process_applying_the_same_transform(runs, name):
    cfg = SCENARIOS[name]
    want = reference(cfg)
    per_rank = ok(runs, name)
    for rank, got in enumerate(per_rank):
        diff = _max_diff(got['params'], want['params'])
        assert diff < TOL, f'{name}: rank {rank} is {diff:.2e} from the reference'
        steps = want['step_params'][cfg.get('resume_at', 0) :]  # a resumed fit: the steps after its checkpoint
        assert len(got['step_params']) == len(steps), name
        for step, (a, b) in enumerate(zip(got['step_params'], steps)):
            assert float((a.double() - b.double()).abs().max()) < TOL, f'{name}: rank {rank}, step {step}'
        if 'eval' in want:
            assert got['eval']['Count'] == want['eval']['Count'], name
            for key in ('LossSum', 'MeanLoss'):
                assert got['eval'][key] == pytest.approx(want['eval'][key], abs=1e-5), (name, key)
        if 'predictions' in want:
            mine = want['predictions'][rank]
            assert got['predictions'].shape == mine.shape, name
            if mine.numel():
                assert float((got['predictions'] - mine).abs().max()) < TOL, name
