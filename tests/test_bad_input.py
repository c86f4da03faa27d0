"""Bad input stops every rank with a clear error at the same step, never a hang or silently wrong training.

Two ranks, one process group for every scenario. The scenarios catch ``UnevenInputsError`` and
return its message, so each test checks what every rank was told.
"""

from __future__ import annotations

import pytest

from composer_join import is_shadow_step
from harness import RankError, launch

CALLS = [
    # rank 1 runs out after one step and shadows with its dict template while rank 0 yields tuples
    ('differs_between_ranks', 'scenarios_badinput:train_on', dict(formats=[['tuple'] * 3, ['dict']])),
    # rank 0's batches gain a key at step 2, while rank 1 shadows with the structure of its step 0
    ('changes_between_steps', 'scenarios_badinput:train_on', dict(formats=[['dict', 'dict', 'dict+mask'], ['dict']])),
    # rank 0's labels change dtype at step 1, while rank 1 (an empty shard) shadows after rank 0's step 0
    ('dtype_changes', 'scenarios_badinput:train_on', dict(formats=[['tuple', 'float64'], []])),
    # different structures on ranks that never shadow are Composer's business: allowed, as without UnevenJoin
    ('differs_without_shadow', 'scenarios_badinput:train_on', dict(formats=[['tuple'] * 2, ['dict'] * 2])),
    # len() says 5 batches, the dataloader yields 1 (a shorter rank) or 2 (the longest rank)
    ('len_overstates', 'scenarios_badinput:train_on', dict(formats=[['tuple'] * 3, ['tuple']], claimed=[None, 5])),
    (
        'len_overstates_longest',
        'scenarios_badinput:train_on',
        dict(formats=[['tuple'] * 2, ['tuple'] * 2], claimed=[5, None]),
    ),
    ('wrong_type', 'scenarios_badinput:wrong_argument', dict(kwargs={'divide_by_initial_world_size': 'yes'})),
    ('wrong_type_int', 'scenarios_badinput:wrong_argument', dict(kwargs={'enable': 1})),
]


@pytest.fixture(scope='module')
def runs() -> dict:
    return launch(2, CALLS, timeout=240)


def errors(runs: dict, name: str) -> list[str]:
    per_rank = runs[name]
    assert not any(isinstance(r, RankError) for r in per_rank), per_rank
    assert all(r['error'] is not None for r in per_rank), f'{name}: some rank trained on: {per_rank}'
    return [r['error'] for r in per_rank]


def test_batch_structure_that_differs_between_ranks_where_a_rank_shadows(runs):
    for message in errors(runs, 'differs_between_ranks'):
        assert 'at step 1 of epoch 0 rank(s) [1] shadow' in message
        assert 'rank 0: tuple(float32[2d], int64[1d]); rank 1: dict{x: float32[2d], y: int64[1d]}' in message
        assert "make every rank's dataloader yield one structure at every step" in message
    assert [r['batch'] for r in runs['differs_between_ranks']] == [1, 1]  # stopped before training step 1


def test_batch_structure_that_changes_between_steps(runs):
    for message in errors(runs, 'changes_between_steps'):
        assert 'at step 2 of epoch 0 rank(s) [1] shadow' in message
        assert (
            'rank 0: dict{mask: float32[1d], x: float32[2d], y: int64[1d]}; rank 1: dict{x: float32[2d], y: '
            'int64[1d]}' in message
        )
    for message in errors(runs, 'dtype_changes'):
        assert 'at step 1 of epoch 0 rank(s) [1] shadow' in message
        assert 'rank 0: tuple(float32[2d], int32[1d]); rank 1: tuple(float32[2d], int64[1d])' in message


def test_structures_may_differ_where_no_rank_shadows(runs):
    for res in runs['differs_without_shadow']:
        assert res['error'] is None and res['sample'] == 16


def test_a_len_that_overstates_is_an_error_on_every_rank(runs):
    for message in errors(runs, 'len_overstates'):
        assert (
            'the dataloader of rank(s) [1] ran out after 1 batches in epoch 0, fewer than its len() promised' in message
        )
    for message in errors(runs, 'len_overstates_longest'):
        assert 'rank(s) [0] ran out after 2 batches' in message
    assert [r['batch'] for r in runs['len_overstates']] == [1, 1]


def test_arguments_of_the_wrong_type_are_refused_on_every_rank(runs):
    assert (
        runs['wrong_type']
        == ["TypeError: UnevenJoin(divide_by_initial_world_size=...) must be True or False, got 'yes'"] * 2
    )
    assert all(
        r.startswith('TypeError: UnevenJoin(enable=...) must be True or False, got 1') for r in runs['wrong_type_int']
    )


def test_is_shadow_step_wants_the_trainer_state():
    with pytest.raises(
        TypeError, match=r'is_shadow_step\(state\) takes the trainer\'s State \(trainer.state\), got int'
    ):
        is_shadow_step(3)
