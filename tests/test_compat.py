"""Composer's own algorithms next to UnevenJoin, after Composer's ``tests/algorithms/algorithm_settings.py``.

Two ranks, one launch. For every algorithm:

* uneven shards (12 and 6 samples, batch 4, 2 epochs: a partial batch, a shadow step per epoch),
  the algorithm listed *before* UnevenJoin (as a YAML would list it): the run finishes, every rank
  reads its whole shard every epoch, Composer counts every sample once (and the report agrees),
  the replicas end identical;
* even shards (8 and 8, 1 epoch), UnevenJoin listed *first*: the weights equal stock Composer's
  (no UnevenJoin) with the same seed, for the algorithms that act on every batch or loss.

Before issue 17, MixUp, CutMix, SelectiveBackprop, SAM and Alibi (its sequence-length scaling)
crashed or aborted on uneven shards, and SeqLengthWarmup could not read the dataloader's batch size.
"""

from __future__ import annotations

import pytest

from harness import launch
from scenarios_compat import NLP, VISION
from test_join_core import ok

UNEVEN = dict(shards=[12, 6], epochs=2)  # batch 4: GhostBatchNorm (ghost batch 2) refuses a 1-sample batch, stock too
EVEN = dict(shards=[8, 8], epochs=1)
REFUSED = ['GhostBatchNorm_4']  # stop every rank at FIT_START (composer_join.refusals)
ALGORITHMS = [n for n in [*VISION, *NLP] if n not in REFUSED]
# where UnevenJoin's place among the algorithms or its weighting could change the numbers (the
# others only operate on the model once, at INIT, or on whole epochs: suite time)
AGAINST_STOCK = [
    'MixUp_interpolate_loss',
    'CutMix',
    'SelectiveBackprop',
    'SAM',
    'LabelSmoothing',
    'ProgressiveResizing',
    'Alibi',
    'SeqLengthWarmup',
]
REPLICA_TOL = 1e-6  # SAM: each rank adds and subtracts its own perturbation, so rounding differs (stock too)
STOCK_TOL = 1e-6
TRAIN = 'scenarios_compat:algorithm_train'


# batch-reshaping algorithms with microbatches (the counts change after the plan), and under FSDP2
# (SelectiveBackprop's extra forward all-gathers: the shadow rank must run it too)
MORE = {
    'Alibi/microbatch_multi_auto_sync': dict(algorithm='Alibi', microbatch=3, sync='multi_auto_sync'),
    'SelectiveBackprop/microbatch_multi_auto_sync': dict(
        algorithm='SelectiveBackprop', microbatch=1, sync='multi_auto_sync'
    ),
    'SelectiveBackprop/fsdp2': dict(algorithm='SelectiveBackprop', wrapper='fsdp2'),
    'MixUp_interpolate_loss/fsdp2': dict(algorithm='MixUp_interpolate_loss', wrapper='fsdp2'),
}


@pytest.fixture(scope='module')
def runs() -> dict:
    calls = []
    for name in ALGORITHMS:
        calls.append((f'{name}/uneven', TRAIN, {'cfg': dict(UNEVEN, algorithm=name, join='after')}))
        if name in AGAINST_STOCK:
            calls.append((f'{name}/even', TRAIN, {'cfg': dict(EVEN, algorithm=name, join='first')}))
            calls.append((f'{name}/stock', TRAIN, {'cfg': dict(EVEN, algorithm=name, join=None)}))
    for name in REFUSED:
        calls.append((f'{name}/refused', TRAIN, {'cfg': dict(UNEVEN, algorithm=name, join='after', expect_error=True)}))
    for name, extra in MORE.items():
        calls.append((name, TRAIN, {'cfg': dict(UNEVEN, join='after', **extra)}))
    return launch(2, calls, timeout=480)


@pytest.mark.parametrize('name', [f'{n}/uneven' for n in ALGORITHMS] + list(MORE))
def test_uneven_shards_train_every_sample_once_and_replicas_agree(runs, name):
    ranks = ok(runs, name)
    shards, epochs = UNEVEN['shards'], UNEVEN['epochs']
    for rank, res in enumerate(ranks):
        assert res['read'] == list(range(shards[rank])) * epochs, f'rank {rank} did not read its shard once per epoch'
        assert res['sample'] == sum(shards) * epochs
        assert res['batch'] == -(-max(shards) // 4) * epochs
        assert res['real_samples'] == [shards] * epochs
    assert (ranks[0]['params'] - ranks[1]['params']).abs().max() <= REPLICA_TOL


@pytest.mark.parametrize('name', AGAINST_STOCK)
def test_even_shards_match_stock_composer(runs, name):
    joined, stock = ok(runs, f'{name}/even'), ok(runs, f'{name}/stock')
    for rank in range(2):
        assert joined[rank]['sample'] == stock[rank]['sample'] == sum(EVEN['shards'])
        assert (joined[rank]['params'] - stock[rank]['params']).abs().max() <= STOCK_TOL


def test_an_algorithm_that_cannot_shadow_stops_every_rank_at_fit_start(runs):
    for res in ok(runs, 'GhostBatchNorm_4/refused'):
        assert 'GhostBatchNorm(ghost_batch_size=4) cannot run beside UnevenJoin' in res['error']
        assert 'ghost_batch_size <= 2' in res['error']
