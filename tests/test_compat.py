"""Composer's own algorithms next to UnevenJoin, after Composer's ``tests/algorithms/algorithm_settings.py``.

Two ranks, one launch. For every algorithm:

* uneven shards (12 and 6 samples, batch 4, 2 epochs: a partial batch, a shadow step per epoch),
  the algorithm listed *before* UnevenJoin (as a YAML would list it): the run finishes, every rank
  reads its whole shard every epoch, Composer counts every sample once (and the report agrees),
  the replicas end identical;
* even shards (8 and 8, 1 epoch), UnevenJoin listed *first*: the weights equal stock Composer's
  (no UnevenJoin) with the same seed, for the algorithms that act on every batch or loss.

And ``mode='rebalance'`` (with and without ``len()``) for MixUp (both ways), CutMix, SelectiveBackprop,
LabelSmoothing and SAM: every sample trained once, in the steps the rebalancing rules give, replicas
identical, and the weights equal to stock Composer's on shards laid out as rebalancing moves them;
SelectiveBackprop also under FSDP2 (equal to DDP), and there with microbatches of 1.

Before issue 17, MixUp, CutMix, SelectiveBackprop, SAM and Alibi (its sequence-length scaling)
crashed or aborted on uneven shards, and SeqLengthWarmup could not read the dataloader's batch size.

Which rank runs short must not matter: the algorithms that rewrite the batch or the loss (MixUp with
an interpolated loss, CutMix, SelectiveBackprop, SAM), GhostBatchNorm (its buffers: rank 0, the first
buffer source, shadows) and Alibi also run on uneven shards with their ranks swapped (6 and 12:
``'<name>/uneven@1'``, tests/rank_orders.py), and rebalancing onto an empty rank with MixUp and
SelectiveBackprop, with and without ``len()``, with the empty receiver on rank 0 and the donor last
(``'<name>/rb_sized_empty@1'``, ``'<name>/rb_unsized_empty@1'``); all in the same launch. The other
algorithms act on the model once, at INIT, or on whole epochs (suite time).
"""

from __future__ import annotations

import pytest

from harness import launch
from rank_orders import expand, with_rotations
from scenarios_compat import BATCH, NLP, VISION
from test_join_core import ok
from test_rebalance import expected_steps
from test_rebalance_unsized import simulate

UNEVEN = dict(shards=[12, 6], epochs=2)  # batch 4: GhostBatchNorm (ghost batch 2) refuses a 1-sample batch, stock too
EVEN = dict(shards=[8, 8], epochs=1)
REFUSED = ['GhostBatchNorm_4']  # stop every rank at FIT_START (composer_join.interop.refusals)
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
# the short rank first too (see the module docstring)
UNEVEN_ROTATED = ['MixUp_interpolate_loss', 'CutMix', 'SelectiveBackprop', 'SAM', 'GhostBatchNorm', 'Alibi']
UNEVEN_RUNS = with_rotations(
    {f'{n}/uneven': dict(UNEVEN, algorithm=n, join='after') for n in ALGORITHMS},
    [f'{n}/uneven' for n in UNEVEN_ROTATED],
)


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


# mode='rebalance', with every rank's len() (the planned schedule) and without (read-ahead), for the
# algorithms that rewrite the batch (MixUp's mixed inputs and interpolated loss) or cut it down
# (SelectiveBackprop's extra forward, at AFTER_DATALOADER). 19 and 4 samples: 5 and 1 batches (rank 0's
# last has 3 samples), 3 steps in both schemes with no idle rank, so stock Composer can train the same
# steps on shards laid out as the rebalancing rules (tests/test_rebalance*.py) move them; 18 and 0: rank 1
# trains only received batches, and the last step shadows (the algorithms see the stand-in there).
# SelectiveBackprop under FSDP2 too (its extra forward all-gathers, also on the shadow step's stand-in),
# and with microbatches of 1, so that the kept samples give the ranks different microbatch counts.
REBALANCED = ['MixUp_interpolate_loss', 'SelectiveBackprop', 'MixUp', 'CutMix', 'LabelSmoothing', 'SAM']
RB_LAID = dict(shards=[19, 4], epochs=2, join='after', mode='rebalance')
RB_EMPTY = dict(RB_LAID, shards=[18, 0])
RB_RUNS: dict[str, dict] = {}
for name in REBALANCED:
    RB_RUNS.update(
        {
            f'{name}/rb_sized': dict(RB_LAID, algorithm=name),
            f'{name}/rb_unsized': dict(RB_LAID, algorithm=name, unsized=True),
            f'{name}/rb_sized_empty': dict(RB_EMPTY, algorithm=name),
            f'{name}/rb_unsized_empty': dict(RB_EMPTY, algorithm=name, unsized=True),
        }
    )
SB = 'SelectiveBackprop'
RB_FSDP = {  # FSDP2 run -> the same run under DDP
    f'{SB}/rb_sized_empty/fsdp2': f'{SB}/rb_sized_empty',
    f'{SB}/rb_unsized_empty/fsdp2': f'{SB}/rb_unsized_empty',
}
for fsdp, ddp in RB_FSDP.items():
    RB_RUNS[fsdp] = dict(RB_RUNS[ddp], wrapper='fsdp2')
RB_RUNS[f'{SB}/rb_unsized/fsdp2_microbatch'] = dict(RB_LAID, algorithm=SB, unsized=True, wrapper='fsdp2', microbatch=1)
# the empty receiver on rank 0, the donor last
RB_RUNS = with_rotations(
    RB_RUNS, [f'{n}/{case}' for n in ('MixUp_interpolate_loss', SB) for case in ('rb_sized_empty', 'rb_unsized_empty')]
)


def batch_counts(shards: list[int]) -> list[int]:
    return [-(-n // BATCH) for n in shards]


def laid_out(shards: list[int]) -> list[list[tuple[int, int]]]:
    """Per rank, the ``(owner, index)`` of the batch it trains at each step under the read-ahead rule."""
    steps = simulate(batch_counts(shards))
    assert all(c is not None for row in steps for c in row), 'stock Composer cannot idle a rank'
    return [[row[r] for row in steps] for r in range(len(shards))]


@pytest.fixture(scope='module')
def runs() -> dict:
    calls = []
    calls += [(name, TRAIN, {'cfg': cfg}) for name, cfg in UNEVEN_RUNS.items()]
    for name in ALGORITHMS:
        if name in AGAINST_STOCK:
            calls.append((f'{name}/even', TRAIN, {'cfg': dict(EVEN, algorithm=name, join='first')}))
            calls.append((f'{name}/stock', TRAIN, {'cfg': dict(EVEN, algorithm=name, join=None)}))
    for name in REFUSED:
        calls.append((f'{name}/refused', TRAIN, {'cfg': dict(UNEVEN, algorithm=name, join='after', expect_error=True)}))
    for name, extra in MORE.items():
        calls.append((name, TRAIN, {'cfg': dict(UNEVEN, join='after', **extra)}))
    calls += [(name, TRAIN, {'cfg': cfg}) for name, cfg in RB_RUNS.items()]
    for name in REBALANCED:
        stock = dict(RB_LAID, algorithm=name, join=None, mode='shadow', layout=laid_out(RB_LAID['shards']))
        calls.append((f'{name}/rb_stock', TRAIN, {'cfg': stock}))
    return launch(2, calls, timeout=480)


@pytest.mark.parametrize('name', expand([f'{n}/uneven' for n in ALGORITHMS], UNEVEN_RUNS) + list(MORE))
def test_uneven_shards_train_every_sample_once_and_replicas_agree(runs, name):
    ranks = ok(runs, name)
    shards, epochs = UNEVEN_RUNS.get(name, UNEVEN)['shards'], UNEVEN['epochs']
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


def trained_cells(ranks: list[dict], epoch: int) -> list[list]:
    """Per step, per rank: the ``(owner, index)`` of the whole batch the rank trained (None: shadow), from its sample ids."""
    steps = [res['trained'][epoch] for res in ranks]
    assert len({len(s) for s in steps}) == 1, 'ranks ran different numbers of steps'
    rows = []
    for t in range(len(steps[0])):
        row = []
        for ids in (s[t] for s in steps):
            if ids is None:
                row.append(None)
                continue
            owner, first = divmod(ids[0], 1000)
            assert first % BATCH == 0 and ids == list(range(ids[0], ids[0] + len(ids))), ids
            row.append((owner, first // BATCH))
        rows.append(row)
    return rows


@pytest.mark.parametrize('name', expand([n for n in RB_RUNS if '@' not in n], RB_RUNS))
def test_rebalanced_every_sample_trains_once_in_the_specified_steps_and_replicas_agree(runs, name):
    cfg = RB_RUNS[name]
    ranks = ok(runs, name)
    shards, epochs, counts = cfg['shards'], cfg['epochs'], batch_counts(cfg['shards'])
    for rank, res in enumerate(ranks):
        assert res['read'] == list(range(shards[rank])) * epochs, f'rank {rank} did not read its shard once per epoch'
        assert res['sample'] == sum(shards) * epochs
        assert len(res['trained']) == epochs
    for epoch in range(epochs):
        seen = trained_cells(ranks, epoch)
        if cfg.get('unsized'):  # read-ahead: exactly the replayed rule's assignment
            assert seen == simulate(counts), f'epoch {epoch}'
        else:  # the planned schedule: the specified batches at every step
            assert [sorted(c for c in row if c is not None) for row in seen] == [
                sorted(s) for s in expected_steps(counts)
            ], f'epoch {epoch}'
        ids = sorted(i for res in ranks for step in res['trained'][epoch] for i in step or [])
        assert ids == [r * 1000 + i for r, n in enumerate(shards) for i in range(n)], (
            f'epoch {epoch}: not each sample once'
        )
    assert ranks[0]['batch'] == len(seen) * epochs
    assert (ranks[0]['params'] - ranks[1]['params']).abs().max() <= REPLICA_TOL


@pytest.mark.parametrize('name', REBALANCED)
def test_rebalanced_weights_equal_stock_composer_on_the_shards_as_rebalanced(runs, name):
    """Stock Composer, each rank given the batches the rules move to it (no rank idles on these shards)."""
    stock = ok(runs, f'{name}/rb_stock')
    for epoch in range(RB_LAID['epochs']):
        assert trained_cells(stock, epoch) == simulate(batch_counts(RB_LAID['shards']))
    for case in ('rb_sized', 'rb_unsized'):
        for rank, res in enumerate(ok(runs, f'{name}/{case}')):
            assert res['trained'] == stock[rank]['trained'], f'{case}: rank {rank} trained other batches'
            diff = float((res['params'] - stock[rank]['params']).abs().max())
            assert diff <= STOCK_TOL, f'{case}: rank {rank} is {diff:.2e} from stock Composer'


@pytest.mark.parametrize('fsdp', list(RB_FSDP))
def test_rebalanced_under_fsdp2_equals_the_same_run_under_ddp(runs, fsdp):
    """SelectiveBackprop is deterministic and BatchNorm trains on batch statistics: FSDP2 must give DDP's weights."""
    for rank, (a, b) in enumerate(zip(ok(runs, fsdp), ok(runs, RB_FSDP[fsdp]))):
        assert a['sharded'] and not b['sharded']
        assert a['trained'] == b['trained']
        diff = float((a['params'] - b['params']).abs().max())
        assert diff <= STOCK_TOL, f'rank {rank} is {diff:.2e} from DDP'
