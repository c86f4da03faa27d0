"""UnevenJoin under every DDPSyncStrategy, with microbatching, unused parameters and token weighting.

Ranks split a step into different numbers of microbatches whenever their batches differ in size (a
partial last batch, a shadow batch). Each scenario is compared with the single-process reference,
and the collectives of each kind of step are counted and compared with stock Composer.

Which rank runs short must not matter (tests/rank_orders.py): every scenario, and the counted uneven
and shadow scenarios under every strategy (their counts must not depend on which rank shadows), runs
again with its short (or empty) rank first, in the middle and last, as ``'<name>@<k>'``. The rotations
join the launch of their world size.
"""

from __future__ import annotations

import pytest

import reference
from harness import launch
from rank_orders import expand, with_rotations
from test_join_core import DIVIDE, NO_DIVIDE, TOL, ok

STRATEGIES = ['single_auto_sync', 'multi_auto_sync', 'forced_sync', None]  # None: Composer's default
BASE = dict(shards=[40, 21, 13], batch_size=8, epochs=2, microbatch=3)

SCENARIOS: dict[str, dict] = {}
for sync in STRATEGIES:
    SCENARIOS[f'mlp_{sync}'] = dict(BASE, sync=sync, join=DIVIDE)
    SCENARIOS[f'unused_{sync}'] = dict(
        BASE, sync=sync, join=NO_DIVIDE, model='branch', find_unused=True, optimizer='adam'
    )
    SCENARIOS[f'tokens_{sync}'] = dict(BASE, sync=sync, join=DIVIDE, model='lm', tokens=True)
SCENARIOS['four_ranks_multi'] = dict(
    shards=[30, 17, 9, 0], batch_size=6, epochs=1, microbatch=4, sync='multi_auto_sync', join=DIVIDE
)

# Collective counting. Every len() is known, so the steps before the shortest rank's last batch are
# planned without an agreement; the first agreed step starts its agreement in its own window, later
# ones a step ahead (in the previous step's window). Shards 24, 20, 20: step 1 is planned (every rank
# has a full batch), step 2 is agreed and has uneven microbatch counts (8, 4, 4 samples). Shards 24,
# 24, 16: step 1 is agreed (and starts step 2's agreement), step 2 is a shadow step for the third rank.
COUNTED: dict[str, dict] = {}
for sync in STRATEGIES[:3]:
    common = dict(batch_size=8, epochs=1, microbatch=3, sync=sync, count_collectives=True)
    COUNTED[f'count_uneven_{sync}'] = dict(common, shards=[24, 20, 20], join=DIVIDE)
    COUNTED[f'count_shadow_{sync}'] = dict(common, shards=[24, 24, 16], join=DIVIDE)
    COUNTED[f'count_stock_{sync}'] = dict(common, shards=[16, 16, 16], join=None)

BASE_SCENARIOS = list(SCENARIOS)
SCENARIOS = with_rotations(SCENARIOS)
COUNTED = with_rotations(COUNTED, [n for n in COUNTED if not n.startswith('count_stock_')])
ROTATIONS = ['', '@1', '@2']  # the counted uneven and shadow scenarios' rotations (both have k = 1 and 2)


@pytest.fixture(scope='module')
def runs() -> dict:
    three = {**{k: v for k, v in SCENARIOS.items() if len(v['shards']) == 3}, **COUNTED}
    results = launch(3, [(name, 'train', {'cfg': cfg}) for name, cfg in three.items()], timeout=480)
    four = [(name, 'train', {'cfg': cfg}) for name, cfg in SCENARIOS.items() if len(cfg['shards']) == 4]
    results.update(launch(4, four, timeout=240))
    return results


@pytest.mark.parametrize('name', expand(BASE_SCENARIOS, SCENARIOS))
def test_gradient_equals_reference_and_replicas_stay_identical(runs, name):
    cfg = SCENARIOS[name]
    ref = reference.train(cfg, divide=cfg['join']['divide_by_initial_world_size'])
    per_rank = ok(runs, name)
    reference.assert_like_reference(name, per_rank, ref['params'], TOL)
    for res in per_rank:
        assert res['timestamp']['sample'] == sum(cfg['shards']) * cfg['epochs']


def counts(runs, name: str, step: int) -> dict[str, int]:
    per_rank = ok(runs, name)
    assert all(res['collectives'][step] == per_rank[0]['collectives'][step] for res in per_rank), (
        f'{name}: ranks issued different collectives at step {step}'
    )
    return per_rank[0]['collectives'][step]


def grad_syncs(c: dict[str, int]) -> int:
    return c.get('ddp_grad_bucket', 0)


def without(c: dict[str, int], *kinds: str) -> dict[str, int]:
    return {k: v for k, v in c.items() if k not in kinds}


@pytest.mark.parametrize('rotation', ROTATIONS)
@pytest.mark.parametrize('sync', STRATEGIES[:3])
def test_collectives_per_step(runs, sync, rotation):
    stock = counts(runs, f'count_stock_{sync}', 1)
    even = counts(runs, f'count_uneven_{sync}{rotation}', 1)
    uneven = counts(runs, f'count_uneven_{sync}{rotation}', 2)
    shadowing = f'count_shadow_{sync}{rotation}'
    before_shadow, shadow = counts(runs, shadowing, 1), counts(runs, shadowing, 2)
    # A step planned from the lengths issues stock Composer's collectives and no more.
    assert without(even, 'ddp_grad_bucket') == without(stock, 'ddp_grad_bucket')
    # An agreed step adds one small all-reduce: the first in its own window, a shadow step's in the one before.
    assert uneven['all_reduce'] == stock['all_reduce'] + 1
    params = 4  # the MLP's parameter tensors, all in one DDP bucket
    presence = 1 if sync == 'forced_sync' else 0  # which parameters have gradients somewhere (a rank shadows)
    assert before_shadow['all_reduce'] + shadow['all_reduce'] == 2 * stock['all_reduce'] + 2 + presence
    if sync == 'single_auto_sync':
        assert grad_syncs(stock) == grad_syncs(even) == grad_syncs(uneven) == grad_syncs(shadow) == 1
    if sync == 'multi_auto_sync':
        assert grad_syncs(stock) == 3  # one per microbatch
        assert grad_syncs(before_shadow) == 3  # agreed, and every rank has 3 microbatches
        # microbatch counts differ, or are not known on a planned step: only each rank's last one
        assert grad_syncs(even) == grad_syncs(uneven) == grad_syncs(shadow) == 1
    if sync == 'forced_sync':
        assert grad_syncs(stock) == 0 and stock['all_reduce'] == 4 + params  # Composer's manual per-parameter sync
    for c in (even, uneven, before_shadow, shadow):
        assert without(c, 'all_reduce', 'ddp_grad_bucket') == without(stock, 'all_reduce', 'ddp_grad_bucket')
