"""Real torch DataLoaders with worker processes (``num_workers=2``, ``persistent_workers=True``,
``prefetch_factor=4``) through Composer's Trainer on two real ranks: persistent workers, a ``len()``
that undercounts (each worker ends with its own partial batch), and a ``len()`` that is wrong in
``mode='rebalance'``.

The reference is independent of composer_join: :func:`worker_batches` plays how torch's DataLoader
hands out an ``IterableDataset`` split among its workers (round robin over the workers, skipping a
worker once it has ended) from the shard sizes alone, which gives every rank's batches in order;
in ``mode='shadow'`` rank ``r`` trains its ``t``-th batch at step ``t`` and an epoch lasts as many
steps as the longest rank yields batches. The test checks that the ranks trained exactly that
(every sample once per epoch), that the replicas never differ, that the weights equal a
single-process replay with the gradient semantics of "What it computes", and that every
evaluation equals one process over all eval samples. Every trained scenario also runs with its
ranks swapped; a wrong ``len()`` in ``mode='rebalance'`` on the other rank is a decision tested in one
process (tests/test_protocol.py). One launch.
"""

from __future__ import annotations

import math

import pytest
import torch

import reference
from harness import RankError, launch
from toy import make_module, per_sample_loss, shard

TOL = 1e-5
RB = {'mode': 'rebalance'}


def _swapped(cfg: dict) -> dict:
    out = dict(cfg, shards=cfg['shards'][::-1])
    if 'eval_shards' in cfg:
        out['eval_shards'] = cfg['eval_shards'][::-1]
    if 'claimed' in cfg:
        out['claimed'] = {1 - r: n for r, n in cfg['claimed'].items()}
    return out


BASE: dict[str, dict] = {
    # item 1: the same iterator every epoch; exact len()s (3 = 2 + 1 batches of 1 over two workers)
    'persistent': dict(shards=[3, 2], batch_size=1, epochs=2, eval_shards=[5, 3]),
    'persistent_one_worker': dict(shards=[2, 1], batch_size=1, epochs=2, workers=1, eval_shards=[3, 1]),
    'persistent_unsized': dict(shards=[3, 2], batch_size=1, max_duration='6ba', sized=False),
    'persistent_rebalance_eval': dict(shards=[3, 2], batch_size=1, epochs=2, eval_shards=[5, 3], join=RB),
    # item 3: 40 samples at batch 8 over two workers: 6 batches (8, 8, 4 each), len() 5
    # its evaluation too: 10 and 3 samples at batch 4 give 4 and 2 batches, len() 3 and 1
    'undercount': dict(shards=[40, 12], batch_size=8, epochs=2, eval_shards=[10, 3], eval_batch_size=4),
    'undercount_both': dict(shards=[40, 24], batch_size=8, epochs=2),
}
TRAINED = {**BASE, **{f'{n}_swapped': _swapped(c) for n, c in BASE.items()}}
FAILING_BASE: dict[str, dict] = {
    # item 2: rank 1's len() says 1 batch, it yields 2; it learns so at step 0, a step nobody agrees on,
    # and it receives a batch of rank 0 at step 1
    'rebalance_len_under': dict(shards=[3, 2], batch_size=1, claimed={1: 1}, workers=0, join=RB, expect_error=True),
    # rank 1's len() says 2, it yields 1: it learns so at step 1, and it receives a batch at step 2
    'rebalance_len_over': dict(shards=[5, 1], batch_size=1, claimed={1: 2}, workers=0, join=RB, expect_error=True),
}
FAILING = FAILING_BASE  # swapped: tests/test_protocol.py (rebalance_len_*_swapped), in one process


@pytest.fixture(scope='module')
def runs() -> dict:
    calls = [(name, 'scenarios_hints:train', {'cfg': cfg}) for name, cfg in {**TRAINED, **FAILING}.items()]
    return launch(2, calls, timeout=400)


def ok(runs: dict, name: str) -> list:
    errors = [f'rank {r}: {e}' for r, e in enumerate(runs[name]) if isinstance(e, RankError)]
    assert not errors, f'{name} failed: ' + '; '.join(errors)
    assert all(res['error'] is None for res in runs[name]), [res['error'] for res in runs[name]]
    return runs[name]


# -- the reference -----------------------------------------------------------------------------------


def worker_batches(size: int, batch_size: int, workers: int) -> list[list[int]]:
    """The sample indices of each batch a DataLoader yields, in order, for a dataset split among ``workers``."""
    if workers == 0:
        workers = 1
    per_worker = [list(range(w, size, workers)) for w in range(workers)]
    chunks = [[p[i : i + batch_size] for i in range(0, len(p), batch_size)] for p in per_worker]
    out = []
    for i in range(max(len(c) for c in chunks)):  # round robin; an ended worker is skipped
        out += [c[i] for c in chunks if i < len(c)]
    return out


def expected_steps(cfg: dict) -> list[list[list[int]]]:
    """Per step of an epoch, per rank, the sample ids it trains (``[]``: it shadows), in ``mode='shadow'``."""
    own = [
        [[1000 * r + i for i in b] for b in worker_batches(n, cfg['batch_size'], cfg.get('workers', 2))]
        for r, n in enumerate(cfg['shards'])
    ]
    return [[o[t] if t < len(o) else [] for o in own] for t in range(max(len(o) for o in own))]


def epochs_of(cfg: dict) -> int:
    if 'max_duration' in cfg:
        return int(cfg['max_duration'][:-2]) // len(expected_steps(cfg))
    return cfg['epochs']


def observed(per_rank: list[dict]) -> list[list[list[int]]]:
    """Per step of the fit, per rank, the sample ids it trained."""
    assert len({len(res['steps']) for res in per_rank}) == 1, 'ranks ran different numbers of steps'
    return [[res['steps'][t]['ids'] for res in per_rank] for t in range(len(per_rank[0]['steps']))]


def replay(cfg: dict, steps: list[list[list[int]]]) -> dict:
    """One process trains the steps: the mean of the per-sample loss gradients over a step's samples, times A_t / W."""
    module = make_module('mlp')
    optimizer = reference.optimizer_for(cfg, module.parameters())
    world = len(cfg['shards'])
    for row in steps:
        ids = [i for ids in row for i in ids]
        x = torch.stack([shard(i // 1000, cfg['shards'][i // 1000])[0][i % 1000] for i in ids])
        y = torch.stack([shard(i // 1000, cfg['shards'][i // 1000])[1][i % 1000] for i in ids])
        active = sum(1 for ids in row if ids)
        optimizer.zero_grad()
        (per_sample_loss(module, x, y).sum() / len(ids) * active / world).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', list(TRAINED))
def test_every_epoch_trains_every_sample_once_as_the_dataloaders_yield_them(runs, name):
    cfg = TRAINED[name]
    expected = expected_steps(cfg)
    seen = observed(ok(runs, name))
    assert seen == expected * epochs_of(cfg), name
    every = sorted(1000 * r + i for r, n in enumerate(cfg['shards']) for i in range(n))
    for e in range(epochs_of(cfg)):
        epoch = seen[e * len(expected) : (e + 1) * len(expected)]
        assert sorted(i for row in epoch for ids in row for i in ids) == every


@pytest.mark.parametrize('name', list(TRAINED))
def test_weights_equal_the_single_process_replay_and_replicas_stay_identical(runs, name):
    cfg = TRAINED[name]
    reference.assert_like_reference(name, ok(runs, name), replay(cfg, expected_steps(cfg) * epochs_of(cfg)), TOL)


@pytest.mark.parametrize('name', [n for n, c in TRAINED.items() if c.get('eval_shards')])
def test_every_evaluation_equals_one_process_over_all_eval_samples(runs, name):
    cfg = TRAINED[name]
    per_rank = ok(runs, name)
    for res in per_rank:
        assert len(res['eval']['MulticlassAccuracy']) == epochs_of(cfg)  # one evaluation per epoch, every one ran
    reference.assert_evaluation_like_reference(per_rank, cfg)


@pytest.mark.parametrize('name', ['undercount', 'undercount_swapped', 'undercount_both', 'undercount_both_swapped'])
def test_a_len_that_undercounts_is_a_hint_and_says_so_once(runs, name):
    cfg = TRAINED[name]
    per_rank = ok(runs, name)
    lens = [math.ceil(n / cfg['batch_size']) for n in cfg['shards']]
    yielded = [len(worker_batches(n, cfg['batch_size'], 2)) for n in cfg['shards']]
    under = [r for r in range(2) if yielded[r] > lens[r]]
    warned = [w for w in per_rank[0]['warnings'] if 'the train dataloader' in w]
    assert len(warned) == 1, warned  # once per fit, not once per epoch
    for r in under:
        assert f'rank {r} yielded {yielded[r]} batches' in warned[0] and f'its len() is {lens[r]}' in warned[0]
    assert f'{max(lens)} batches per epoch' in warned[0] and 'schedule' in warned[0]
    assert per_rank[1]['warnings'] == []  # rank 0 warns for all
    if cfg.get('eval_shards'):  # and once for the evaluator, of its two evaluations
        (evaluated,) = [w for w in per_rank[0]['warnings'] if 'the eval dataloader' in w]
        big = cfg['eval_shards'].index(10)
        assert f'rank {big} yielded 4 batches, its len() is 3' in evaluated, evaluated
        assert f'rank {1 - big} yielded 2 batches, its len() is 1' in evaluated, evaluated
    for res in per_rank:
        assert res['timestamp']['batch'] == max(yielded) * cfg['epochs']


@pytest.mark.parametrize('name', list(FAILING))
def test_a_wrong_len_in_rebalance_mode_raises_on_every_rank_and_names_it(runs, name):
    cfg = FAILING[name]
    rank = next(iter(cfg['claimed']))
    claimed, size = cfg['claimed'][rank], cfg['shards'][rank]
    for res in runs[name]:
        assert not isinstance(res, RankError), res
        message = res['error']
        assert message is not None and f'rank {rank}' in message, message
        assert f'len() {claimed}' in message or f'len() promised {claimed}' in message, message
        if size > claimed:  # shadow mode treats a len() that undercounts as a hint: the way out
            assert f'yielded more than the {claimed}' in message, message
            assert "mode='shadow'" in message, message
        else:  # ... but not one that overcounts (its steps planned from the lengths would be wrong)
            assert f'yielded {size} batches' in message, message
            assert "mode='shadow'" not in message and 'remove __len__' in message, message
