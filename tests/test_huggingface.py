"""Hugging Face models through Composer's ``HuggingFaceModel``, on uneven train and eval shards.

A tiny GPT-2 (built from a config, no download, no dropout) trains on 2 and 3 ranks with several
evaluations per run. Training is compared with a single-process reference written with plain torch
and transformers (``reference_hf``), evaluation with one process evaluating all the eval data. All
scenarios of one world size share one process group.

Which rank runs short must not matter: ``adam_3`` (rank 2 short and without eval data) runs again
with that rank first and in the middle, ``crash_repro`` (the shorter eval shard, whose shadow evaluation
steps hand the popped template around) and ``mutating`` with their ranks swapped (tests/rank_orders.py:
train and eval shards together), in the launch of their world size. The other scenarios vary the
optimizer, the sync strategy or the loss weighting on the same layouts (suite time).
"""

from __future__ import annotations

import pytest

import reference
import reference_hf
from harness import launch
from rank_orders import expand, with_rotations
from test_join_core import ok

TOL = 1e-5
BASE2 = dict(shards=[12, 7], eval_shards=[8, 4], batch_size=4, epochs=2, eval_interval='2ba', join={})
BASE3 = dict(shards=[12, 7, 3], eval_shards=[9, 4, 0], batch_size=4, epochs=2, eval_interval='2ba', join={})
SYNCS = ['single_auto_sync', 'multi_auto_sync', 'forced_sync']

SCENARIOS: dict[str, dict] = {
    # the crash of issue 9: HuggingFaceModel.eval_forward pops 'labels' from the batch it is given,
    # so the second shadow evaluation step failed when it was handed the same template object again
    'crash_repro': dict(shards=[8, 8], eval_shards=[8, 4], batch_size=4, epochs=2, eval_interval='1ep', join={}),
    'adam_2': dict(BASE2, optimizer='adam', lr=1e-3),
    'stock_2': dict(BASE2, optimizer='adam', lr=1e-3, join=None),
    'sgd_no_divide_3': dict(BASE3, join={'divide_by_initial_world_size': False}),
    'adam_3': dict(BASE3, optimizer='adam', lr=1e-3),
    **{f'microbatch_{sync}': dict(BASE3, microbatch=3, sync=sync, epochs=1, eval_interval='1ep') for sync in SYNCS},
    **{
        f'tokens_{sync}': dict(BASE3, microbatch=3, sync=sync, epochs=1, eval_interval='1ep', tokens=True)
        for sync in SYNCS
    },
}
MUTATING = {  # a toy model that pops keys from its batch and scales the rest in place
    'mutating': dict(
        shards=[20, 9], eval_shards=[10, 3], batch_size=4, epochs=2, eval_interval='3ba', microbatch=2, join={}
    ),
}
# the short rank, the rank without eval data, on the other side too (see the module docstring)
ORIGINAL = list(SCENARIOS)
SCENARIOS = with_rotations(SCENARIOS, ['adam_3', 'crash_repro'])
MUTATING = with_rotations(MUTATING)
JOINED = expand([n for n in ORIGINAL if SCENARIOS[n]['join'] is not None], SCENARIOS)


@pytest.fixture(scope='module')
def runs() -> dict:
    results = {}
    for world in (2, 3):
        calls = [(n, 'scenarios_hf:hf_train', {'cfg': c}) for n, c in SCENARIOS.items() if len(c['shards']) == world]
        calls += [
            (n, 'scenarios_hf:mutating_train', {'cfg': c}) for n, c in MUTATING.items() if len(c['shards']) == world
        ]
        results.update(launch(world, calls, timeout=360))
    return results


def evaluations(cfg: dict) -> int:
    steps = max(-(-n // cfg['batch_size']) for n in cfg['shards']) * cfg['epochs']
    every = int(cfg['eval_interval'][:-2])
    return cfg['epochs'] // every if cfg['eval_interval'].endswith('ep') else -(-steps // every)  # and at the end


@pytest.mark.parametrize('name', expand(['crash_repro'], SCENARIOS))
def test_shadow_evaluation_steps_do_not_crash_a_model_that_pops_labels(runs, name):
    cfg = SCENARIOS[name]
    for rank, res in enumerate(ok(runs, name)):
        assert len(res['eval']['LanguageCrossEntropy']) == 2, f'rank {rank}: expected two evaluations'
        for i, params in enumerate(res['eval_params']):
            ref = reference_hf.evaluate(params, cfg)
            assert res['eval']['LanguageCrossEntropy'][i] == pytest.approx(ref['loss'], abs=1e-6)


@pytest.mark.parametrize('name', JOINED)
def test_training_matches_single_process_reference_and_replicas_stay_identical(runs, name):
    cfg = SCENARIOS[name]
    ref = reference_hf.train(cfg)
    per_rank = ok(runs, name)
    reference.assert_like_reference(name, per_rank, ref, TOL)
    for res in per_rank:
        assert res['samples'] == sum(cfg['shards']) * cfg['epochs']


@pytest.mark.parametrize('name', JOINED)
def test_every_evaluation_equals_one_process_evaluating_all_data(runs, name):
    cfg = SCENARIOS[name]
    for rank, res in enumerate(ok(runs, name)):
        assert len(res['eval_params']) == evaluations(cfg) >= 1
        for i, params in enumerate(res['eval_params']):
            ref = reference_hf.evaluate(params, cfg)
            assert res['eval']['TokensEvaluated'][i] == ref['tokens']
            assert res['eval']['LanguageCrossEntropy'][i] == pytest.approx(ref['loss'], abs=1e-6), (
                f'{name}: rank {rank}, evaluation {i}'
            )


def test_stock_composer_trains_and_evaluates_less(runs):
    """The failure UnevenJoin fixes, measured on the same data: 2 ranks, shards of 12 and 7, eval 8 and 4."""
    cfg = SCENARIOS['stock_2']
    ours, stock = ok(runs, 'adam_2')[0], ok(runs, 'stock_2')[0]
    assert ours['samples'] == 38 and stock['samples'] == 30  # stock stops each epoch after 2 of 3 steps
    ref = reference_hf.evaluate(stock['eval_params'][-1], cfg)
    assert ref['tokens'] == 12 * 7 and ours['eval']['TokensEvaluated'] == [84] * evaluations(cfg)
    assert stock['eval']['TokensEvaluated'] == [56, 56]  # 4 + 4 of 12 sequences, 7 tokens each; 4 steps, not 6
    assert abs(stock['eval']['LanguageCrossEntropy'][-1] - ref['loss']) > 1e-4


@pytest.mark.parametrize('name', expand(['mutating'], MUTATING))
def test_a_model_that_mutates_its_batch_is_never_handed_the_same_batch_twice(runs, name):
    cfg = MUTATING[name]
    short = cfg['shards'].index(9)  # rank 1, or rank 0 when rotated
    ref = reference.train(dict(cfg, fmt='dict'))
    for rank, res in enumerate(ok(runs, name)):
        assert res['repeats'] == 0, f'rank {rank}: the model was handed a batch object it had already seen'
        assert res['shadow_steps'] == (4 if rank == short else 0)  # 5 steps per epoch, the short rank has 3 batches
        assert reference.max_abs_diff(res['params'], ref['params']) < TOL
        assert res['samples'] == 58
        assert len(res['eval']) == evaluations(cfg) == 4
        for i, params in enumerate(res['eval_params']):
            assert res['eval'][i] == pytest.approx(reference.evaluate(params, cfg)['MeanLoss'], abs=1e-6)
