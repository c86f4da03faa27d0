"""Composer's automatic microbatching with UnevenJoin: an OOM on some ranks, then Composer's retry on all.

On CPU, through Composer's own OOM path (``tests/scenarios_oom.py``): the model raises Composer's
recognised CUDA OOM on chosen ranks, at a chosen step and point (forward, loss, backward), while the
microbatch size in force is above a limit. Composer halves the size on every rank and splits the same
batch again; the run must then train exactly what a run with the halved size from the start trains
(the single-process reference does not depend on the microbatch size), under DDP (every sync
strategy) and FSDP1/FSDP2, on steps planned from the lengths, agreed steps and shadow steps, and in
evaluation. On main, the first of these died in gloo (Composer's per-microbatch OOM check is a
collective, and ranks with different microbatch counts issued different numbers of them).

One 2-rank launch runs every scenario (shards 40 and 21, batch 8, microbatch 4: 5 steps, steps 0-1
planned from the lengths, step 2 the first agreed, steps 3-4 shadow steps for rank 1).

Which rank runs short, and which one raises, must not matter: six scenarios run again with their ranks
swapped (``'<name>@1'``, tests/rank_orders.py: shards, eval shards and the OOM rules' ranks together), in
the same launch. Between them and their originals the OOM falls on rank 0 and on the last rank, on the
short rank and on the long one, in a planned, an agreed and a shadowing step, in a forward without
``len()``, in evaluation, and under DDP, FSDP1 and FSDP2: ``planned_forward`` (the short rank raises
at step 0), ``forward_beside_a_shadow_rank`` (the long rank raises beside the shadowing one),
``no_len_forward``, ``eval_one_rank`` (the rank with less eval data raises), ``fsdp1_shadow_rank_forward``
(the shadowing rank raises) and ``fsdp2_agreed_loss``. The other scenarios differ from these only in the
point, the sync strategy or the optimizer (suite time).
"""

from __future__ import annotations

import pytest

import reference
from harness import launch
from rank_orders import expand, with_rotations
from test_join_core import DIVIDE, NO_DIVIDE, TOL, ok

BASE = dict(shards=[40, 21], batch_size=8, epochs=1, microbatch=4, join=DIVIDE)


def oom(ranks, steps, point='forward', limit=2) -> list[dict]:
    return [dict(ranks=ranks, steps=steps, point=point, limit=limit)]


DDP: dict[str, dict] = {
    'planned_forward': dict(BASE, oom=oom([1], [0])),
    'agreed_forward_multi': dict(BASE, sync='multi_auto_sync', oom=oom([0], [2])),
    # rank 1 shadows step 3: under DDP its microbatch runs no model code (docs/shadow-steps.md), so it cannot
    # hit an OOM itself; it must still meet rank 0's handshake (and retries on the template). Swapped ('@1'), it
    # found the shadowing rank 0 writing the reduced gradients to the wrong parameters after the retry (fixed)
    'forward_beside_a_shadow_rank': dict(BASE, oom=oom([0], [3])),
    'real_rank_loss_forced': dict(BASE, sync='forced_sync', oom=oom([0], [3], 'loss')),
    'planned_loss_forced': dict(BASE, sync='forced_sync', join=NO_DIVIDE, oom=oom([1], [1], 'loss')),
    'planned_backward': dict(BASE, oom=oom([0], [1], 'backward')),
    'unused_params_multi': dict(
        BASE, sync='multi_auto_sync', model='branch', find_unused=True, optimizer='adam', oom=oom([1], [2])
    ),
    'no_len_forward': dict(BASE, dataset='iterable_nolen', max_duration='5ba', max_steps=5, oom=oom([1], [0])),
    'both_ranks_twice': dict(BASE, sync='multi_auto_sync', oom=oom([0, 1], [2]) + oom([0], [2], 'loss', limit=1)),
    'eval_one_rank': dict(BASE, eval_shards=[20, 7], eval_microbatch=4, oom=oom([1], ['eval'])),
}
FSDP: dict[str, dict] = {
    'fsdp1_planned_forward': dict(BASE, wrapper='fsdp1', oom=oom([1], [0])),
    'fsdp1_agreed_loss': dict(BASE, wrapper='fsdp1', oom=oom([0], [2], 'loss')),
    'fsdp1_no_len': dict(
        BASE, wrapper='fsdp1', dataset='iterable_nolen', max_duration='5ba', max_steps=5, oom=oom([0], [1])
    ),
    # a shadowing rank's OOM, in its forward on the template (its loss is UnevenJoin's stand-in): rank 1 shadows
    # from step 1; Composer removes its FSDP1 OOM hooks after 3 OOM-free batches (stock too), so within step 2
    'fsdp1_shadow_rank_forward': dict(BASE, shards=[40, 8], wrapper='fsdp1', oom=oom([1], [1])),
    'fsdp2_agreed_loss': dict(BASE, wrapper='fsdp2', oom=oom([0], [2], 'loss')),
    # every rank OOMs in evaluation: under FSDP, Composer's eval retry has no in-forward check
    'fsdp1_eval': dict(BASE, wrapper='fsdp1', eval_shards=[20, 7], eval_microbatch=4, oom=oom([0, 1], ['eval'])),
}
ROTATED = [
    'planned_forward',
    'forward_beside_a_shadow_rank',
    'no_len_forward',
    'eval_one_rank',
    'fsdp1_shadow_rank_forward',
    'fsdp2_agreed_loss',
]
SCENARIOS = with_rotations({**DDP, **FSDP}, ROTATED)


@pytest.fixture(scope='module')
def runs() -> dict:
    return launch(2, [(n, 'scenarios_oom:train_oom', {'cfg': c}) for n, c in SCENARIOS.items()], timeout=420)


def expected_sizes(cfg: dict) -> tuple[int, set]:
    """The microbatch size after the retries, and the (rank, step) pairs that must have raised."""
    rules = cfg['oom']
    size = cfg['microbatch']
    while any(size > r['limit'] for r in rules):
        size //= 2
    return size, {(rank, step) for r in rules for rank in r['ranks'] for step in r['steps']}


@pytest.mark.parametrize('name', expand([*DDP, *FSDP], SCENARIOS))
def test_oom_on_some_ranks_is_retried_on_all_and_trains_like_the_halved_size(runs, name):
    cfg = SCENARIOS[name]
    per_rank = ok(runs, name)
    size, raisers = expected_sizes(cfg)
    raised = {
        (rank, 'eval' if step < 0 else step) for rank, res in enumerate(per_rank) for step, _, _ in res['ooms_raised']
    }
    assert raised == raisers, f'{name}: OOMs raised at {raised}, expected at {raisers}'
    ref = reference.train(cfg, divide=cfg['join']['divide_by_initial_world_size'])
    steps = cfg.get('max_steps', ref['steps_per_epoch'])
    for rank, res in enumerate(per_rank):
        diff = reference.max_abs_diff(res['params'], ref['params'])
        assert diff < TOL, f'{name}: rank {rank} is {diff:.2e} from the reference'
        assert res['timestamp']['batch'] == steps
        if 'eval' in cfg['oom'][0]['steps']:
            assert res['eval_microbatch_sizes'][-1] == size
        else:
            assert res['train_microbatch_sizes'][-1] == size
    if 'step_params' in per_rank[0]:  # DDP: the replicas never drift apart
        reference.assert_like_reference(name, per_rank, ref['params'], TOL)


@pytest.mark.parametrize('name', expand(['eval_one_rank', 'fsdp1_eval'], SCENARIOS))
def test_evaluation_after_an_oom_is_exact(runs, name):
    cfg = SCENARIOS[name]
    per_rank = ok(runs, name)
    reference.assert_evaluation_like_reference(per_rank, cfg)
