"""Even steps cost nothing: with a len() on every rank, UnevenJoin adds no collective on the steps before the
shortest rank's last batch, so its extra collectives per epoch do not grow with the epoch's length.

Collectives are counted per step on real ranks (``CollectiveCounter``: Python-level ``torch.distributed``
calls and DDP's gradient bucket all-reduces), with and without UnevenJoin on even shards. The steps that
need no agreement are also checked where skipping it could go wrong: batch sizes (and so microbatch
counts) that differ between ranks on every step under ``multi_auto_sync``, and a dataloader that fails
on a step nobody agreed on.

Which rank runs short must not matter (tests/rank_orders.py): the varied-batch scenarios run again
with their ranks swapped, as ``'<name>@1'`` (batch plans move with their ranks; the even counted
scenarios would not change); the shortest plan and the reference follow the rotated config. A failing
dataloader runs here once on a planned step (and once in an evaluation) and once with a len() that
overstates, on real ranks; where else it fails (the first step, the last planned one) and the other rank
order are decisions tested in one process (tests/test_protocol.py, ``fails_at_step_*``, ``len_overstates@1``).
"""

from __future__ import annotations

import pytest

import reference
from harness import RankError, launch
from rank_orders import base, expand, with_rotations
from test_join_core import DIVIDE, NO_DIVIDE, TOL, ok
from toy import shard

SYNCS = ['single_auto_sync', 'multi_auto_sync', 'forced_sync']
LENGTHS = {'short': 4, 'long': 12}  # steps per epoch
COUNTED: dict[str, dict] = {}
for sync in SYNCS:
    for length, steps in LENGTHS.items():
        common = dict(shards=[8 * steps] * 2, batch_size=8, epochs=2, microbatch=3, sync=sync, count_collectives=True)
        COUNTED[f'join_{sync}_{length}'] = dict(common, join=DIVIDE)
        COUNTED[f'stock_{sync}_{length}'] = dict(common, join=None)

# Batch sizes vary from step to step and between ranks (microbatch 3: 1 to 3 microbatches), as with
# token-budget batching; the batch counts are uneven too (7 and 9 batches), except with find_unused_parameters
# (there a shadow step would hit a limit of its own, see the README's Limits).
PLAN = [[8, 5, 8, 3, 7, 8, 2], [4, 8, 6, 8, 2, 8, 3, 8, 1]]
PLAN_SAME_COUNT = [PLAN[0], PLAN[1][:7]]
VARIED = {
    'varied_multi': dict(
        batch_plan=PLAN,
        shards=[sum(p) for p in PLAN],
        batch_size=8,
        epochs=2,
        microbatch=3,
        sync='multi_auto_sync',
        join=DIVIDE,
    ),
    'varied_unused': dict(
        batch_plan=PLAN_SAME_COUNT,
        shards=[sum(p) for p in PLAN_SAME_COUNT],
        batch_size=8,
        epochs=2,
        microbatch=3,
        model='branch',
        find_unused=True,
        optimizer='adam',
        join=NO_DIVIDE,
    ),
}
# A dataloader that fails on a step planned from the lengths (5 batches each: steps 0 to 3 are planned), and a
# len() that promises more than it yields (the other steps and rank orders: tests/test_protocol.py, in one process).
FAILING = {
    'fails_at_step_1': dict(shards=[40, 40], batch_size=8, epochs=1, join=DIVIDE, fail_at={1: 12}),
    'len_overstates': dict(shards=[40, 24], batch_size=8, epochs=1, join=DIVIDE, claimed_len={1: 40}),
}
FAILING_EVAL = {  # 5 eval batches per rank: batches 0 to 3 planned; rank 1 fails at batch 1 of the evaluation
    'eval_fails_at_step_1': dict(
        shards=[16, 16], batch_size=8, epochs=1, join=DIVIDE, eval_shards=[20, 20], eval_fail_at={1: 6}
    ),
}
VARIED = with_rotations(VARIED)
AFTER = {'after_failure': dict(shards=[16, 16], batch_size=8, epochs=1, join=DIVIDE)}  # the process group still works


@pytest.fixture(scope='module')
def runs() -> dict:
    calls = [(name, 'train', {'cfg': cfg}) for name, cfg in {**COUNTED, **FAILING}.items()]
    calls += [(name, 'scenarios_cost:train_batch_plan', {'cfg': cfg}) for name, cfg in VARIED.items()]
    calls += [(name, 'scenarios_cost:train_failing_eval', {'cfg': cfg}) for name, cfg in FAILING_EVAL.items()]
    calls += [(name, 'train', {'cfg': cfg}) for name, cfg in AFTER.items()]
    return launch(2, calls, timeout=420)


def per_step(runs, name: str) -> list[dict[str, int]]:
    per_rank = ok(runs, name)
    assert all(res['collectives'] == per_rank[0]['collectives'] for res in per_rank), (
        f'{name}: ranks issued different collectives'
    )
    return per_rank[0]['collectives']


def others(c: dict[str, int]) -> dict[str, int]:
    """Every collective but DDP's gradient bucket all-reduces."""
    return {k: v for k, v in c.items() if k != 'ddp_grad_bucket'}


@pytest.mark.parametrize('sync', SYNCS)
def test_no_collective_beyond_stock_before_the_last_batch(runs, sync):
    for length, steps in LENGTHS.items():
        join, stock = per_step(runs, f'join_{sync}_{length}'), per_step(runs, f'stock_{sync}_{length}')
        assert len(join) == len(stock) == 2 * steps
        for t in range(2 * steps):
            last = t % steps == steps - 1
            extra = {'all_reduce': 1} if last else {}  # the last step's agreement (partial batches, overflow)
            expected = {k: stock[t].get(k, 0) + extra.get(k, 0) for k in {**stock[t], **extra}}
            assert others(join[t]) == others(expected), f'{sync}, {length}: step {t}'
            grads = join[t].get('ddp_grad_bucket', 0)
            if sync == 'multi_auto_sync' and not last:
                # unknown microbatch counts elsewhere: each rank syncs its last microbatch only, same sum
                assert grads == 1 and stock[t]['ddp_grad_bucket'] == 3
            else:
                assert grads == stock[t].get('ddp_grad_bucket', 0), f'{sync}, {length}: step {t}'


@pytest.mark.parametrize('sync', SYNCS)
def test_extra_collectives_do_not_grow_with_the_number_of_steps(runs, sync):
    extra = {}
    for length in LENGTHS:
        join, stock = per_step(runs, f'join_{sync}_{length}'), per_step(runs, f'stock_{sync}_{length}')
        extra[length] = sum(sum(others(c).values()) for c in join) - sum(sum(others(c).values()) for c in stock)
    assert extra == {'short': 2, 'long': 2}  # one per epoch, 2 epochs, at 4 and at 12 steps per epoch


@pytest.mark.parametrize('sync', SYNCS)
def test_results_equal_the_reference(runs, sync):
    for length in LENGTHS:
        cfg = COUNTED[f'join_{sync}_{length}']
        ref = reference.train(cfg)
        stock = ok(runs, f'stock_{sync}_{length}')
        for rank, res in enumerate(ok(runs, f'join_{sync}_{length}')):
            assert reference.max_abs_diff(res['params'], ref['params']) < TOL
            assert reference.max_abs_diff(res['params'], stock[rank]['params']) < TOL  # even shards: stock is right
            assert res['timestamp']['sample'] == sum(cfg['shards']) * 2
            for report in res['reports']:  # sample counts of planned steps reach every rank's report
                assert report['real_samples'] == cfg['shards'] and report['shadow_steps'] == [0, 0]


def steps_using_the_branch_only_where_no_sync_happens(plan: list[list[int]], microbatch: int) -> list[int]:
    """Steps at which the branch model's extra head (label-0 samples) is used on some rank, but in no rank's last
    microbatch: the only microbatch that syncs when each rank syncs its last one only."""
    labels = [shard(rank, sum(sizes))[1] for rank, sizes in enumerate(plan)]
    steps = []
    for t in range(min(len(sizes) for sizes in plan)):
        chunks = [labels[r][sum(sizes[:t]) : sum(sizes[: t + 1])].split(microbatch) for r, sizes in enumerate(plan)]
        early = any(bool((c == 0).any()) for ch in chunks for c in ch[:-1])
        if early and not any(bool((ch[-1] == 0).any()) for ch in chunks):
            steps.append(t)
    return steps


@pytest.mark.parametrize('name', list(VARIED))
def test_microbatch_counts_that_differ_on_every_step(runs, name):
    cfg = VARIED[name]
    if cfg.get('find_unused'):  # the case a sync on the last microbatch only could get wrong does occur
        early = steps_using_the_branch_only_where_no_sync_happens(cfg['batch_plan'], cfg['microbatch'])
        assert early == {'varied_unused': [0, 3, 4], 'varied_unused@1': [0, 5]}[name]  # rotated: other samples
    ref = reference.train(cfg, divide=cfg['join']['divide_by_initial_world_size'])
    per_rank = ok(runs, name)
    reference.assert_like_reference(name, per_rank, ref['params'], TOL)
    for res in per_rank:
        assert res['timestamp']['sample'] == sum(cfg['shards']) * cfg['epochs']
        plan = cfg['batch_plan']
        for report in res['reports']:
            assert report['real_samples'] == cfg['shards']
            assert report['real_batches'] == [len(p) for p in plan]
            # stock Composer would drop the batches past the shortest plan: their sizes are agreed, summed per rank
            shortest = min(len(p) for p in plan)
            assert report['tail_samples'] == [sum(p[shortest:]) for p in plan]


STEP_AND_CAUSE = {  # the rank that cannot form the batch is the one its config makes fail
    'fails_at_step_1': (1, ('RuntimeError', 'disk read error at sample 12')),
    'len_overstates': (
        3,
        (
            'UnevenInputsError',
            'the dataloader of rank(s) [{rank}] ran out after 3 batches in epoch 0, '
            'fewer than its len() promised (this rank: len() 5)',
        ),
    ),
    'eval_fails_at_step_1': (1, ('RuntimeError', 'disk read error at sample 6')),
}


def failing_rank(cfg: dict) -> int:
    (rank,) = cfg.get('fail_at') or cfg.get('claimed_len') or cfg['eval_fail_at']
    return rank


@pytest.mark.parametrize('name', expand(STEP_AND_CAUSE, {**FAILING, **FAILING_EVAL}))
def test_a_rank_that_cannot_form_a_planned_batch_stops_every_rank(runs, name):
    rank = failing_rank({**FAILING, **FAILING_EVAL}[name])
    step, (kind, message) = STEP_AND_CAUSE[base(name)]
    cause = (kind, message.format(rank=rank))
    per_rank = runs[name]
    assert all(isinstance(res, RankError) for res in per_rank), f'{name}: some rank did not stop: {per_rank}'
    assert (per_rank[rank].type, cause[1] in per_rank[rank].message) == (cause[0], True), per_rank[rank]
    other = per_rank[1 - rank]
    says = (
        f'rank(s) [{rank}] ran out after {step} batches'
        if base(name) == 'len_overstates'
        else f'rank(s) [{rank}] could not form batch {step} of epoch '
    )
    assert other.type == 'UnevenInputsError' and says in other.message, other
    for res in ok(runs, 'after_failure'):
        assert res['timestamp']['sample'] == 32


def test_planned_steps_and_the_report_they_feed():
    from composer_join.core.plan import RankStatus, StepPlan, plan_from_lengths, steps_planned_from_lengths
    from composer_join.core.report import EpochReport

    assert steps_planned_from_lengths([5, 3, 4], 5) == 2  # the shortest rank's last batch is step 2
    assert steps_planned_from_lengths([5, 3, 4], 2) == 1  # the trainer asked for 2 batches only
    assert steps_planned_from_lengths([5, 0], 5) == 0 and steps_planned_from_lengths([5, None], None) == 0
    plan = plan_from_lengths(0, 1, RankStatus(True, 8, 3), 3)
    assert plan.active_ranks == [0, 1, 2] and not plan.joined_ranks and not plan.even_microbatches
    assert plan.grad_factor(True) == 1.0 and plan.template_source is None and plan.statuses[1].samples == 8
    report = EpochReport(epoch=0, world_size=2)
    report.record(plan_from_lengths(0, 0, RankStatus(True, 8, 1), 2))  # every rank records the same
    unreported = (RankStatus(True, 5, 1, unreported_samples=8), RankStatus(True, 8, 1, unreported_samples=7))
    report.record(StepPlan(1, unreported))  # the first agreed step brings every rank's planned samples
    report.record(StepPlan(2, (RankStatus(False, 0, 1), RankStatus(True, 2, 1))))
    assert (report.real_batches, report.real_samples, report.shadow_steps) == ([2, 3], [13, 17], [1, 0])
    # the planned step's sizes are in the counts only; the step rank 0 shadowed is the tail: rank 1's batch of 2
    assert report.tail_samples == [0, 2] and report.stock_dropped_samples == 2
