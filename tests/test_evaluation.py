"""Exact distributed evaluation on uneven shards, and training with ExactDistributedSampler.

Metrics of a distributed evaluation must equal those of one process evaluating all the data with
the same weights: accuracy exactly, losses within 1e-6.

Which rank runs short must not matter: the scenarios with per-rank eval shards run again with their
ranks rotated (tests/rank_orders.py: train and eval shards together), so that the rank with the least
data is first, in the middle and last, in the launch of their world size. Between them the rank without
eval data is rank 0, a middle rank and the last rank (``empty_and_microbatched_3`` and ``four_ranks``),
and the rank with the shortest eval shard is first and last. The ``eval_map`` scenarios share one eval
dataset (only their train shards would move) and ``stock_iterable_3`` shows stock Composer's failure
once; they are not rotated. (A rank without train data, or without either, evaluates in test_metrics'
rotated ``eval_20_7_0`` and ``four_ranks_two_empty``.)
"""

from __future__ import annotations

import pytest

import reference
from harness import launch
from rank_orders import expand, with_rotations
from test_join_core import DIVIDE, ok

TRAIN = dict(batch_size=8, epochs=2, join=DIVIDE)
SCENARIOS = {
    # the measured stock failure: 37 eval samples in shards of 20, 11 and 6
    'iterable_3': dict(TRAIN, shards=[40, 21, 13], eval_shards=[20, 11, 6], eval_after=True),
    'stock_iterable_3': dict(TRAIN, shards=[40, 21, 13], eval_shards=[20, 11, 6], join=None),
    'empty_and_microbatched_3': dict(
        TRAIN, shards=[16, 8, 8], eval_shards=[0, 9, 2], eval_microbatch=3, eval_after=True
    ),
    'exact_sampler_3': dict(TRAIN, shards=[24, 16, 9], eval_map=37, eval_after=True),
    'fewer_samples_than_ranks_3': dict(TRAIN, shards=[8, 8, 8], eval_map=2, eval_after=True),
    'torch_sampler_3': dict(TRAIN, shards=[16, 9, 8], eval_map=37, eval_sampler='torch', eval_after=True),
    'two_ranks': dict(TRAIN, shards=[16, 9], eval_shards=[3, 14], eval_batch_size=2, eval_after=True),
    'four_ranks': dict(TRAIN, shards=[16, 9, 8, 1], eval_shards=[7, 0, 5, 13], eval_microbatch=2, eval_after=True),
    # training on a map-style dataset sharded by ExactDistributedSampler (shuffled per epoch)
    'train_exact_sampler_3': dict(TRAIN, dataset='map', map_size=50, shards=[0, 0, 0], epochs=3),
    'train_exact_sampler_4': dict(TRAIN, dataset='map', map_size=14, shards=[0, 0, 0, 0], batch_size=3, epochs=2),
}
SCENARIOS = with_rotations(SCENARIOS, ['iterable_3', 'empty_and_microbatched_3', 'two_ranks', 'four_ranks'])


@pytest.fixture(scope='module')
def runs() -> dict:
    results = {}
    for world in (2, 3, 4):
        calls = [(n, 'train', {'cfg': c}) for n, c in SCENARIOS.items() if len(c['shards']) == world]
        results.update(launch(world, calls, timeout=420))
    return results


@pytest.mark.parametrize(
    'name', expand([n for n, c in SCENARIOS.items() if '@' not in n and c.get('join') and 'eval_after' in c], SCENARIOS)
)
def test_every_evaluation_equals_one_process_evaluating_all_data(runs, name):
    cfg = SCENARIOS[name]
    for rank, res in enumerate(ok(runs, name)):
        evals = len(res['eval_params'])
        assert evals == cfg['epochs'] + 1  # one per epoch, and trainer.eval() at the end
        for i, params in enumerate(res['eval_params']):
            ref = reference.evaluate(params, cfg)
            accuracy = res['eval']['MulticlassAccuracy'][i]
            assert accuracy == pytest.approx(ref['correct'] / ref['total'], abs=1e-7), (
                f'{name}: rank {rank}, evaluation {i}: accuracy {accuracy} but {ref["correct"]}/{ref["total"]}'
            )
            assert res['eval']['MeanLoss'][i] == pytest.approx(ref['MeanLoss'], abs=1e-6)


def test_stock_composer_evaluation_is_not_exact(runs):
    """The failure UnevenJoin fixes: stock Composer stops evaluating at the shortest shard."""
    cfg = SCENARIOS['stock_iterable_3']
    res = ok(runs, 'stock_iterable_3')[0]
    ref = reference.evaluate(res['eval_params'][-1], cfg)
    assert ref['total'] == 37
    assert res['eval']['MulticlassAccuracy'][-1] != pytest.approx(ref['MulticlassAccuracy'], abs=1e-7)


@pytest.mark.parametrize('name', ['train_exact_sampler_3', 'train_exact_sampler_4'])
def test_training_with_exact_sampler_trains_every_sample_once_per_epoch(runs, name):
    cfg = SCENARIOS[name]
    per_rank = ok(runs, name)
    orders = []
    for epoch in range(cfg['epochs']):
        ids = [i for res in per_rank for i in res['sample_ids'][epoch]]
        assert sorted(ids) == list(range(cfg['map_size'])), f'{name}: epoch {epoch} trained {sorted(ids)}'
        orders.append(per_rank[0]['sample_ids'][epoch])
        for res in per_rank:
            assert res['timestamp']['sample'] == cfg['map_size'] * cfg['epochs']
    assert orders[0] != orders[1]  # shuffled anew each epoch
