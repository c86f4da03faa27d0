"""A subset of the suite under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch checks every collective on every rank.

With ``DETAIL``, torch wraps each gloo (and NCCL) process group in a checker that, before every
collective, compares its sequence number, operation, tensor shapes and dtypes across all ranks (over
a gloo helper group) and raises ``Detected mismatch between collectives`` on every rank where they
differ, instead of a hang, a crash later or tensors of equal size silently mixed up. UnevenJoin's
claim is that every rank issues the same collectives, shadow steps and padded microbatches included,
so this check tests the claim directly, on top of the reference comparisons.

The ranks get ``DETAIL`` through their environment (:func:`harness.launch` copies the test process's
at launch time; ``rank_worker`` reads it again, since torch reads it once, at import, in the harness's
server). :func:`test_the_check_is_live_in_the_ranks` proves it is in force: shapes 2x3 against 3x2,
which gloo all-reduces without noticing, raise under ``DETAIL`` and go through without it.

The subset (:data:`SUBSET`): scenarios of the suite's own tables, one launch per world size (2 and 3
ranks), each checked by its own module's test functions, called here on these runs: DDP (sync
strategies and microbatches, an empty rank, train metrics), FSDP1 (microbatch padding, evaluation, an
empty rank, rebalancing with and without ``len()``), rebalancing with and without ``len()``
(microbatches, an empty receiver), evaluation on uneven shards; then a few random draws of
``tests/test_random_unevenness.py`` per world size, FSDP2 left out. Every launch also reports its
ranks' debug level. ``make test-detail`` runs this module alone; ``make test`` runs it with the rest.

Left out, and why:

- FSDP2: torch's checking wrapper of a gloo group lacks ``allgather_into_tensor_coalesced``, which
  FSDP2 calls (``Backend gloo does not support allgather_into_tensor_coalesced``; stock Composer too).
- ``tests/test_fsdp.py``'s collective counts: under ``DETAIL`` FSDP1 adds its own check of the
  forward order, two ``all_gather_into_tensor`` at the first step, on every rank alike.
- FSDP1 sharded checkpoints: saving the optimizer state under ``DETAIL`` calls
  ``torch.cpu.memory_summary``, which torch 2.7 does not have (an ``AttributeError`` on rank 0;
  stock Composer too).
"""

from __future__ import annotations

from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

import test_evaluation
import test_fsdp
import test_join_core
import test_random_unevenness
import test_rebalance
import test_rebalance_unsized
import test_sync_strategies
from harness import RankError, launch

DETAIL = 'DETAIL'
RANDOM_CONFIGS = 4  # per world size (test_random_unevenness.py draws 6 per world size, FSDP2 included)


def _fsdp_scenarios() -> dict:
    return {**test_fsdp.SCENARIOS, **test_fsdp.THREE, **test_fsdp.REBALANCE}


def _fsdp_reference(runs: dict, name: str) -> None:
    test_fsdp.check_reference(name, _fsdp_scenarios()[name], test_join_core.ok(runs, name))


def _fsdp_evaluation(runs: dict, name: str) -> None:
    _fsdp_reference(runs, name)
    test_fsdp.reference.assert_evaluation_like_reference(test_join_core.ok(runs, name), _fsdp_scenarios()[name])


# module -> (its scenario table, the rank side that trains them, its checks: functions of (runs, name))
MODULES: dict[ModuleType, tuple] = {
    test_join_core: (test_join_core.SCENARIOS, 'train', [test_join_core.test_matches_single_process_reference]),
    test_sync_strategies: (
        test_sync_strategies.SCENARIOS,
        'train',
        [test_sync_strategies.test_gradient_equals_reference_and_replicas_stay_identical],
    ),
    test_fsdp: (_fsdp_scenarios(), 'scenarios_fsdp:train', [_fsdp_reference]),
    test_rebalance: (
        test_rebalance.SCENARIOS,
        'scenarios_rebalance:train',
        [
            test_rebalance.test_matches_the_reference_and_replicas_stay_identical,
            test_rebalance.test_every_batch_once_in_the_specified_steps,
        ],
    ),
    test_rebalance_unsized: (
        test_rebalance_unsized.SCENARIOS,
        'scenarios_readahead:train',
        [
            test_rebalance_unsized.test_each_step_trains_the_batches_the_rule_gives,
            test_rebalance_unsized.test_weights_match_the_single_process_replay_and_replicas_stay_identical,
        ],
    ),
    test_evaluation: (
        test_evaluation.SCENARIOS,
        'train',
        [test_evaluation.test_every_evaluation_equals_one_process_evaluating_all_data],
    ),
}
# (module, scenario): what runs under DETAIL, in this order in the launch of its world size. A mismatch leaves the
# ranks' sequence numbers apart for the rest of their launch, so every later scenario of it fails too: the first
# failure is the one to read. Rebalancing (point-to-point transfers) last.
SUBSET: list[tuple[ModuleType, str]] = [
    # DDP: the sync strategies with microbatches (uneven counts per step), unused parameters, an empty rank,
    # Adam with a cosine schedule, train metrics
    (test_sync_strategies, 'mlp_multi_auto_sync'),
    (test_sync_strategies, 'unused_forced_sync'),
    (test_join_core, 'cosine_adam_2ep'),
    (test_join_core, 'dict_batches_metrics'),
    (test_join_core, 'empty_first_ranks'),
    # FSDP1: padded microbatches, evaluation, an empty rank
    (test_fsdp, 'fsdp1_microbatch'),
    (test_fsdp, 'fsdp1_eval'),
    (test_fsdp, 'fsdp1_empty_shard'),
    # evaluation on uneven shards, an empty eval shard, eval microbatches
    (test_evaluation, 'two_ranks'),
    (test_evaluation, 'iterable_3'),
    (test_evaluation, 'empty_and_microbatched_3'),
    # rebalancing with every len(): microbatches, transfers between some ranks only (3 ranks), the empty rank last
    (test_rebalance, 'mb_multi'),
    (test_rebalance, 'empty_three'),
    (test_rebalance, 'empty_three@2'),
    (test_rebalance, 'three_mb_multi'),
    # rebalancing without len(); both under FSDP1
    (test_rebalance_unsized, 'mb_multi'),
    (test_rebalance_unsized, 'three_mixed_empty'),
    (test_fsdp, 'fsdp1_rebalance_three'),
    (test_fsdp, 'fsdp1_readahead_three'),
]
CHECKS = {
    (test_fsdp, 'fsdp1_eval'): [_fsdp_evaluation],
    (test_fsdp, 'fsdp1_rebalance_three'): [
        test_fsdp.test_rebalance_trains_every_batch_once_padded_and_equal_to_the_reference
    ],
    (test_fsdp, 'fsdp1_readahead_three'): [
        test_fsdp.test_rebalance_trains_every_batch_once_padded_and_equal_to_the_reference
    ],
}


def _module(module: ModuleType) -> str:
    return module.__name__.removeprefix('test_')


def _cfg(module: ModuleType, name: str) -> dict:
    return MODULES[module][0][name]


@pytest.fixture(scope='module')
def runs() -> dict:
    """``{module: {scenario: per-rank results}}``, and ``{'debug_level': {world: per rank}}``."""
    results: dict[str, dict] = {_module(m): {} for m in MODULES}
    results['debug_level'] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv('TORCH_DISTRIBUTED_DEBUG', DETAIL)
        for world in (2, 3):
            calls = [('debug_level', 'scenarios_detail:debug_level', {})]
            calls += [
                (f'{_module(m)}/{name}', MODULES[m][1], {'cfg': _cfg(m, name)})
                for m, name in SUBSET
                if len(_cfg(m, name)['shards']) == world
            ]
            per_call = launch(world, calls, timeout=480)
            results['debug_level'][world] = per_call.pop('debug_level')
            for key, per_rank in per_call.items():
                module, name = key.split('/')
                results[module][name] = per_rank
    return results


def test_the_check_is_live_in_the_ranks(monkeypatch):
    """Shapes 2x3 against 3x2: gloo all-reduces them silently; under DETAIL, set for this launch only, every rank raises."""
    monkeypatch.delenv('TORCH_DISTRIBUTED_DEBUG', raising=False)
    off = launch(
        2, [('level', 'scenarios_detail:debug_level', {}), ('mismatch', 'scenarios_detail:mismatched_all_reduce', {})]
    )
    assert off['level'] == ['OFF', 'OFF']
    assert off['mismatch'] == [12.0, 12.0]  # no error: six ones from each rank, summed as if they matched
    monkeypatch.setenv('TORCH_DISTRIBUTED_DEBUG', DETAIL)
    on = launch(
        2, [('level', 'scenarios_detail:debug_level', {}), ('mismatch', 'scenarios_detail:mismatched_all_reduce', {})]
    )
    assert on['level'] == [DETAIL, DETAIL]
    for rank, error in enumerate(on['mismatch']):
        assert isinstance(error, RankError) and error.type == 'RuntimeError', (rank, error)
        assert 'Detected mismatch between collectives' in error.message and 'Tensor shapes' in error.message, error


def test_the_subset_ran_under_detail(runs):
    assert runs['debug_level'] == {2: [DETAIL] * 2, 3: [DETAIL] * 3}


@pytest.mark.parametrize(('module', 'name'), SUBSET, ids=[f'{_module(m)}/{n}' for m, n in SUBSET])
def test_scenario_passes_its_own_checks_under_detail(runs, module, name):
    for check in CHECKS.get((module, name), MODULES[module][2]):
        check(runs[_module(module)], name)


@pytest.mark.parametrize('world', [2, 3])
def test_random_draws_without_fsdp2_match_the_reference_under_detail(world, monkeypatch):
    monkeypatch.setenv('TORCH_DISTRIBUTED_DEBUG', DETAIL)
    draws = test_random_unevenness.configs(world).filter(lambda cfg: cfg['wrapper'] != 'fsdp2')

    @test_random_unevenness.PROFILE
    @given(st.lists(draws, min_size=RANDOM_CONFIGS, max_size=RANDOM_CONFIGS))
    def run(cfgs):
        test_random_unevenness.check(world, cfgs)

    run()
