"""``Trainer.predict()``, Composer's callbacks and Trainer options with UnevenJoin on uneven shards.

One 2-rank launch. Predict: every rank predicts every sample of its own shard once (compared with
the model applied to each sample by this process), under DDP and FSDP2, with an empty shard, also
with ``mode='rebalance'``; stock Composer stops every rank at the shortest shard. Callbacks and options: toy model, shards 24 and
10, batch 8 (rank 1 shadows steps 3 and 6), every rank trains, logs and stops the same.

Which rank runs short must not matter: ``callbacks`` (rank 0, the rank that saves the checkpoints and
whose logs are read, then shadows steps 3 and 6 itself), ``early_stopper`` (the short eval shard on rank 0
as well), ``subsets`` and ``generate`` also run with their ranks swapped (``'<name>@1'``,
tests/rank_orders.py), in the same launch. Predict already has its empty shard on either rank; the
duration and second-fit scenarios follow the same per-step path (suite time).
"""

from __future__ import annotations

import pytest
import torch

from harness import launch
from rank_orders import expand, with_rotations
from test_join_core import ok
from toy import make_module, shard

PREDICT = {
    'predict_ddp': dict(shards=[21, 6]),
    'predict_ddp_empty': dict(shards=[0, 13]),
    'predict_fsdp2': dict(shards=[21, 6], wrapper='fsdp2'),
    'predict_fsdp2_empty_no_outputs': dict(shards=[13, 0], wrapper='fsdp2', return_outputs=False),
    # mode='rebalance' changes training only: predict() still gives every rank its own shard (it shadows)
    'predict_ddp_rebalance': dict(shards=[21, 6], mode='rebalance'),
    'predict_fsdp2_rebalance_empty': dict(shards=[0, 13], wrapper='fsdp2', mode='rebalance'),
    'predict_stock': dict(shards=[21, 6], join=False),
}
EVAL = dict(eval_shards=[12, 3])
TRAIN = {
    'callbacks': dict(
        shards=[24, 10],
        callbacks=[
            'SpeedMonitor',
            'LRMonitor',
            'OptimizerMonitor',
            'MemoryMonitor',
            'RuntimeEstimator',
            'CheckpointSaver',
        ],
    ),
    'early_stopper': dict(shards=[24, 10], callbacks=['EarlyStopper'], eval_interval='1ba', **EVAL),
    'threshold_stopper': dict(shards=[24, 10], callbacks=['ThresholdStopper'], eval_interval='3ba', **EVAL),
    'subsets': dict(
        shards=[40, 10],
        trainer=dict(train_subset_num_batches=3, eval_subset_num_batches=1),
        eval_interval='3ba',
        **EVAL,
    ),
    'max_batches': dict(shards=[24, 10], max_duration='4ba'),
    'max_samples': dict(shards=[24, 10], max_duration='40sp'),
    'max_tokens': dict(shards=[24, 10], max_duration='160tok', fmt='dict'),
    'second_fit_no_spin': dict(
        shards=[24, 10], max_duration='1ep', fits=[{}, {'duration': '1ep'}], trainer=dict(spin_dataloaders=False)
    ),
}
TRAIN = with_rotations(TRAIN, ['callbacks', 'early_stopper', 'subsets'])
GENERATE = with_rotations({'generate': dict(shards=[12, 5])})
CUMULATIVE = [16, 26, 34, 50, 60, 68]  # real samples after each step (24/10, batch 8: 8+8, 8+2, 8+0)


@pytest.fixture(scope='module')
def runs() -> dict:
    calls = [(n, 'scenarios_surface:predict', {'cfg': c}) for n, c in PREDICT.items()]
    calls += [(n, 'scenarios_surface:surface_train', {'cfg': c}) for n, c in TRAIN.items()]
    calls += [(n, 'scenarios_surface:hf_generate', {'cfg': c}) for n, c in GENERATE.items()]
    calls += [
        ('without_pass', 'scenarios_surface:without_join_pass', {'cfg': dict(shards=[24, 10])}),
    ]
    return launch(2, calls, timeout=420)


@pytest.mark.parametrize('name', [n for n in PREDICT if n != 'predict_stock'])
def test_predict_gives_every_rank_its_whole_shard_once(runs, name):
    cfg = PREDICT[name]
    steps = max(-(-n // 8) for n in cfg['shards'])
    for rank, res in enumerate(ok(runs, name)):
        n = cfg['shards'][rank]
        own = -(-n // 8)
        assert res['predict_sample'] == sum(cfg['shards']) and res['predict_batch'] == steps
        # PREDICT_BATCH_END: real batches first, then shadow ones with zero outputs and a zero-sample batch
        assert [(rows, shadow) for rows, _, shadow, _ in res['seen']] == [
            (min(8, n - 8 * i), False) for i in range(own)
        ] + [(0, True)] * (steps - own)
        if cfg.get('return_outputs', True) is False:
            assert res['outputs'] == []
            continue
        assert len(res['outputs']) == steps
        assert [len(o) for o in res['outputs'][own:]] == [0] * (steps - own)
        x, _ = shard(60 + rank, n)
        expected = make_module('mlp')(x).detach()
        got = torch.cat(res['outputs'])
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, rtol=0, atol=1e-6)


def test_stock_predict_stops_every_rank_at_the_shortest_shard(runs):
    """What UnevenJoin changes: without it rank 0 predicts 8 of its 21 samples, silently."""
    ranks = ok(runs, 'predict_stock')
    assert [sum(len(o) for o in r['outputs']) for r in ranks] == [8, 6]


def _same_on_both(ranks, key):
    assert ranks[0][key] == ranks[1][key], key
    return ranks[0][key]


def short_rank(cfg: dict) -> int:
    return cfg['shards'].index(min(cfg['shards']))


@pytest.mark.parametrize('name', expand(['callbacks'], TRAIN))
def test_callbacks_log_real_steps_and_agree(runs, name):
    ranks = ok(runs, name)
    short = short_rank(TRAIN[name])  # rank 1, or rank 0 (which saves the checkpoints) when rotated
    assert [r['shadow'] for r in ranks] == [[False, False, True] * 2 if r == short else [False] * 6 for r in range(2)]
    for res in ranks:
        assert res['speed_samples'] == CUMULATIVE[-4:]  # SpeedMonitor's window (3 steps): real samples only
        assert len(res['logged']['throughput/samples_per_sec']) == 3
        assert len(res['logged']['time/remaining_estimate']) >= 1
    assert _same_on_both([r['logged'] for r in ranks], 'lr-SGD/group0') == [0.1] * 6
    norms = _same_on_both([r['logged'] for r in ranks], 'l2_norm/grad/global')  # the synced gradient
    assert len(norms) == 6 and all(v > 0 for v in norms)
    assert {'ba3-rank0.pt', 'ba6-rank0.pt'} <= set(ranks[0]['checkpoints'])  # ba3: the short rank shadows it
    assert (ranks[0]['params'] - ranks[1]['params']).abs().max() == 0


@pytest.mark.parametrize('name, stop', [(n, 4) for n in expand(['early_stopper'], TRAIN)] + [('threshold_stopper', 3)])
def test_stoppers_stop_every_rank_at_the_same_step(runs, name, stop):
    ranks = ok(runs, name)
    assert [r['batch'] for r in ranks] == [stop, stop]
    assert [r['sample'] for r in ranks] == [CUMULATIVE[stop - 1]] * 2
    _same_on_both([r['logged'] for r in ranks], 'metrics/eval/MeanLoss')


@pytest.mark.parametrize('name', expand(['subsets'], TRAIN))
def test_subset_options(runs, name):
    ranks = ok(runs, name)  # 40/10 with 3 batches per epoch: 24 + 10 samples per epoch
    short = short_rank(TRAIN[name])  # rank 1, or rank 0 when rotated
    assert [(r['batch'], r['sample']) for r in ranks] == [(6, 68)] * 2
    assert ranks[short]['shadow'] == [False, False, True] * 2
    assert _same_on_both(ranks, 'eval_batches') == [3, 6]  # eval_interval 3ba: on the short rank's shadow steps
    # eval_subset_num_batches=1: batch 4 of one rank's 12 and the other's 3 samples; accuracy over 7 samples
    assert all(
        abs(v * 7 - round(v * 7)) < 1e-5
        for v in _same_on_both([r['logged'] for r in ranks], 'metrics/eval/MulticlassAccuracy')
    )


@pytest.mark.parametrize('name', ['max_batches', 'max_samples', 'max_tokens'])
def test_max_duration_ending_mid_epoch(runs, name):
    for res in ok(runs, name):  # 4 batches: 34 samples in epoch 0, 16 in epoch 1 ('40sp': the first step past 40)
        assert (res['batch'], res['sample'], res['epoch']) == (4, 50, 1)
        assert res['token'] == (200 if name == 'max_tokens' else 0)  # 4 tokens per real sample, none for shadows


def test_second_fit_without_spinning(runs):
    ranks = ok(runs, 'second_fit_no_spin')
    assert [(r['batch'], r['sample'], r['epoch']) for r in ranks] == [(6, 68, 2)] * 2
    assert ranks[1]['shadow'] == [False, False, True] * 2
    assert (ranks[0]['params'] - ranks[1]['params']).abs().max() == 0


@pytest.mark.parametrize('name', expand(['generate'], GENERATE))
def test_generate_runs_on_every_rank_at_the_same_steps(runs, name):
    ranks = ok(runs, name)  # tiny GPT-2, shards 12/5, batch 4: rank 1 (rank 0 when rotated) shadows steps 3 and 6
    assert ranks[short_rank(GENERATE[name])]['shadow'] == [False, False, True] * 2
    assert [r['generated_at'] for r in ranks] == [[3, 6]] * 2  # every 3 batches: on the short rank's shadow steps
    assert [r['sample'] for r in ranks] == [34, 34]


def test_a_trainer_without_the_join_pass_stops_every_rank_at_fit_start(runs):
    for message in runs['without_pass']:
        assert isinstance(message, str) and 'algorithm_passes=composer_join.join.passes.join_pass' in message
