"""Bad input stops every rank with a clear error at the same step, never a hang or silently wrong training.

Two ranks, one process group for every scenario. The scenarios catch ``UnevenInputsError`` and
return its message, so each test checks what every rank was told. Every dataloader scenario also
runs with its ranks swapped (``'<name>@1'``), so the shadowing, short or misbehaving rank is rank 0
once and the last rank once; the expected messages are computed from the (rotated) config.
"""

from __future__ import annotations

import pytest

from composer_join import is_shadow_step
from harness import RankError, launch
from rank_orders import base, expand, with_rotations

TRAIN_ON: dict[str, dict] = {
    # rank 1 runs out after one step and shadows with its dict template while rank 0 yields tuples
    'differs_between_ranks': dict(formats=[['tuple'] * 3, ['dict']]),
    # rank 0's batches gain a key at step 2, while rank 1 shadows with the structure of its step 0
    'changes_between_steps': dict(formats=[['dict', 'dict', 'dict+mask'], ['dict']]),
    # rank 0's labels change dtype at step 1, while rank 1 (an empty shard) shadows after rank 0's step 0
    'dtype_changes': dict(formats=[['tuple', 'float64'], []]),
    # different structures on ranks that never shadow are Composer's business: allowed, as without UnevenJoin
    'differs_without_shadow': dict(formats=[['tuple'] * 2, ['dict'] * 2]),
    # len() says 5 batches, the dataloader yields 1 (a shorter rank) or 2 (the longest rank)
    'len_overstates': dict(formats=[['tuple'] * 3, ['tuple']], claimed=[None, 5]),
    'len_overstates_longest': dict(formats=[['tuple'] * 2, ['tuple'] * 2], claimed=[5, None]),
}
# which rank shadows, runs out or misbehaves must not matter: every scenario again with its ranks swapped
# (``'<name>@1'``, tests/rank_orders.py: ``formats`` and ``claimed`` together), in the same launch
TRAIN_ON = with_rotations(TRAIN_ON)
CALLS = [(name, 'scenarios_badinput:train_on', cfg) for name, cfg in TRAIN_ON.items()] + [
    ('wrong_type', 'scenarios_badinput:wrong_argument', dict(kwargs={'divide_by_initial_world_size': 'yes'})),
    ('wrong_type_int', 'scenarios_badinput:wrong_argument', dict(kwargs={'enable': 1})),
]
# the structure UnevenJoin describes for a batch of each format (tests/scenarios_badinput.py:batch)
STRUCTURE = {
    'tuple': 'tuple(float32[2d], int64[1d])',
    'dict': 'dict{x: float32[2d], y: int64[1d]}',
    'dict+mask': 'dict{mask: float32[1d], x: float32[2d], y: int64[1d]}',
    'float64': 'tuple(float32[2d], int32[1d])',
}


@pytest.fixture(scope='module')
def runs() -> dict:
    return launch(2, CALLS, timeout=240)


def errors(runs: dict, name: str) -> list[str]:
    per_rank = runs[name]
    assert not any(isinstance(r, RankError) for r in per_rank), per_rank
    assert all(r['error'] is not None for r in per_rank), f'{name}: some rank trained on: {per_rank}'
    return [r['error'] for r in per_rank]


def shadowing(cfg: dict, step: int) -> list[int]:
    """The ranks out of batches at ``step``."""
    return [r for r, f in enumerate(cfg['formats']) if len(f) <= step]


def structures(cfg: dict, step: int) -> str:
    """Every rank's batch structure at ``step``, as the error lists them: a shadowing rank's is its template,
    the structure of its own step 0, or, for a rank without batches, of the lowest rank with data's step 0."""
    formats = cfg['formats']
    first = next(f[0] for f in formats if f)
    described = [STRUCTURE[f[step] if step < len(f) else f[0] if f else first] for f in formats]
    return '; '.join(f'rank {r}: {d}' for r, d in enumerate(described))


@pytest.mark.parametrize('name', expand(['differs_between_ranks'], TRAIN_ON))
def test_batch_structure_that_differs_between_ranks_where_a_rank_shadows(runs, name):
    cfg = TRAIN_ON[name]
    for message in errors(runs, name):
        assert f'at step 1 of epoch 0 rank(s) {shadowing(cfg, 1)} shadow' in message
        assert structures(cfg, 1) in message, message
        assert "make every rank's dataloader yield one structure at every step" in message
    assert [r['batch'] for r in runs[name]] == [1, 1]  # stopped before training step 1


@pytest.mark.parametrize('name', expand(['changes_between_steps', 'dtype_changes'], TRAIN_ON))
def test_batch_structure_that_changes_between_steps(runs, name):
    cfg = TRAIN_ON[name]
    step = 2 if base(name) == 'changes_between_steps' else 1
    for message in errors(runs, name):
        assert f'at step {step} of epoch 0 rank(s) {shadowing(cfg, step)} shadow' in message
        assert structures(cfg, step) in message, message


@pytest.mark.parametrize('name', expand(['differs_without_shadow'], TRAIN_ON))
def test_structures_may_differ_where_no_rank_shadows(runs, name):
    for res in runs[name]:
        assert res['error'] is None and res['sample'] == 16


@pytest.mark.parametrize('name', expand(['len_overstates', 'len_overstates_longest'], TRAIN_ON))
def test_a_len_that_overstates_is_an_error_on_every_rank(runs, name):
    cfg = TRAIN_ON[name]
    (rank,) = [r for r, n in enumerate(cfg['claimed']) if n is not None]
    yielded = len(cfg['formats'][rank])
    for message in errors(runs, name):
        assert (
            f'the dataloader of rank(s) [{rank}] ran out after {yielded} batches in epoch 0, fewer than its len() '
            'promised' in message
        ), message
    if base(name) == 'len_overstates':
        assert [r['batch'] for r in runs[name]] == [1, 1]


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
