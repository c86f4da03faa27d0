"""Where ranks differ beyond their amount of data: per-rank dataset states on resumption, per-rank settings,
custom DataSpecs, batches of Python lists.

Three ranks, one launch for every scenario that ends cleanly (tests/scenarios_resume.py,
tests/scenarios_ranks.py); a rank without UnevenJoin, which breaks the process group, runs in a
launch of its own.

**Per-rank datasets that resume themselves** (Composer's ``state_dict(num_samples, from_beginning)``
protocol, which Composer checkpoints from rank 0 only): each run trains once uninterrupted with a
checkpoint after every batch, then resumes from some of them. The resumed run must train, step by
step, the samples the uninterrupted run trained after the checkpoint, and end with its weights,
optimizer state, timestamps and reports: when rank 0 runs out first, when batch sizes differ
between ranks (checkpoints on steps planned from the lengths), in ``mode='rebalance'``, and from
FSDP2 sharded checkpoints.

**Settings that differ between ranks** stop every rank before the first step, with an error naming
each differing setting and the ranks holding each value; a rank without UnevenJoin at all makes the
first agreement fail at once (gloo: that rank aborts), and the UnevenJoin ranks say what is likely.

**Batches of Python lists** (raw strings, records) shadow like tensor batches, counted and split by
the user's ``DataSpec`` (Composer's default cannot count them), under DDP and FSDP2, and match the
single-process reference; where an FSDP batch splits into more microbatches than counted, every
rank stops at the same step.

Which rank is short or differs must not matter (tests/rank_orders.py, ``'<name>@<k>'``, in the same
launch): ``rank0_short`` also with its short rank in the middle and last; the settings ``mode`` and
``enable`` also with the odd rank first, in the middle and last (``throw_and_divide`` has it first and
last already); ``records_ddp`` also with its empty shard first and in the middle. The others differ from
these in the wrapper, the batch sizes or the format only (suite time); ``strings_ddp`` has its short
rank last, ``records_fsdp2`` in the middle.
"""

from __future__ import annotations

import pytest
import torch

import reference
from harness import RankError, launch
from rank_orders import expand, with_rotations

TOL = 1e-6
WORLD = 3

RESUME: dict[str, dict] = {
    # the case: shards of 8, 24 and 20 in batches of 4 (2, 6, 5 batches); at batch 4 rank 0 shadows
    # and ranks 1 and 2 have trained 16 samples each. 9 = epoch 1, step 3.
    'rank0_short': dict(data='self_resuming', shards=[8, 24, 20], batch_size=4, epochs=2, resume_at=[4, 9]),
    # batches of 2, 1 and 3 samples (11, 6, 5 batches): steps 0-3 are planned from the lengths, without
    # agreement (checkpoints 2 and 14 fall there), steps 4-10 agreed
    'batch_sizes': dict(data='self_resuming', shards=[21, 6, 13], batch_sizes=[2, 1, 3], epochs=2, resume_at=[2, 14]),
    # rebalancing: 2 + 6 + 5 batches in 5 steps per epoch; ranks 0 and 2 receive batches from rank 1
    'rebalance': dict(
        data='self_resuming',
        shards=[8, 24, 20],
        batch_size=4,
        epochs=2,
        join={'mode': 'rebalance'},
        resume_at=[2, 3, 7],
    ),
    # FSDP2, sharded checkpoints (a folder per checkpoint, one file per rank)
    'fsdp2_sharded': dict(
        data='self_resuming',
        shards=[8, 24, 20],
        batch_size=4,
        epochs=1,
        wrapper='fsdp2',
        state_dict_type='sharded',
        resume_at=[4],
    ),
}
RESUME = with_rotations(RESUME, ['rank0_short'])


SHARDS = [16, 8, 4]
SETTINGS: dict[str, dict] = {  # per_rank: UnevenJoin(**kwargs) on each rank
    'mode': dict(per_rank=[{}, {'mode': 'rebalance'}, {}], shards=SHARDS),
    'throw_and_divide': dict(
        per_rank=[{'divide_by_initial_world_size': False}, {}, {'throw_on_early_termination': True}], shards=SHARDS
    ),
    'enable': dict(per_rank=[{}, {}, {'enable': False}], shards=SHARDS),
    'all_disabled': dict(per_rank=[{'enable': False}] * 3, shards=SHARDS),  # the same everywhere: stock Composer
}
SETTINGS = with_rotations(SETTINGS, ['mode', 'enable'])
DEFAULTS = {'mode': 'shadow', 'throw_on_early_termination': False, 'divide_by_initial_world_size': True, 'enable': True}

LISTS: dict[str, dict] = {
    # records (one dict per sample) split into pairs by a custom split_batch, an empty shard, multi_auto_sync
    'records_ddp': dict(
        fmt='records', split='pairs', shards=[20, 9, 0], batch_size=4, epochs=2, microbatch=3, sync='multi_auto_sync'
    ),
    # raw strings, parsed by the model; Composer's default split (which cannot split an empty list)
    'strings_ddp': dict(
        fmt='strings', shards=[13, 24, 6], batch_size=8, epochs=1, microbatch=3, sync='multi_auto_sync'
    ),
    # FSDP2: pairs give 4 microbatches for 8 samples (Composer's default would give 3), padded across ranks
    'records_fsdp2': dict(
        fmt='records', split='pairs', shards=[20, 9, 13], batch_size=8, epochs=1, microbatch=3, wrapper='fsdp2'
    ),
    # a batch_transforms that doubles every batch after it was counted: more microbatches than counted
    'doubling_fsdp2': dict(
        fmt='records',
        split='pairs',
        shards=[20, 9, 13],
        batch_size=8,
        epochs=1,
        microbatch=3,
        wrapper='fsdp2',
        doubling=True,
    ),
}
LISTS = with_rotations(LISTS, ['records_ddp'])


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    calls = [
        (name, 'scenarios_resume:resume_cases', dict(cfg=cfg, folder=str(tmp_path_factory.mktemp(name))))
        for name, cfg in RESUME.items()
    ]
    calls += [(name, 'scenarios_ranks:with_settings', cfg) for name, cfg in SETTINGS.items()]
    calls += [(name, 'scenarios_ranks:train_lists', dict(cfg=cfg)) for name, cfg in LISTS.items()]
    return launch(WORLD, calls, timeout=480)


def ok(runs: dict, name: str) -> list:
    errors = [f'rank {r}: {e}' for r, e in enumerate(runs[name]) if isinstance(e, RankError)]
    assert not errors, f'{name} failed: ' + '; '.join(errors)
    return runs[name]


@pytest.mark.parametrize('name', RESUME)
def test_each_rank_resumes_its_own_dataset_where_it_was(runs, name):
    per_rank = ok(runs, name)
    for rank, res in enumerate(per_rank):
        full = res['full']
        for at in RESUME[name]['resume_at']:
            run = res[f'load_path@{at}']
            after = {step: ids for step, ids in full['ids'].items() if step >= at}
            assert run['ids'] == after, f'{name}@{at}: rank {rank} trained other samples after resuming'
            diff = reference.max_abs_diff(run['params'], full['params'])
            assert diff < TOL, f'{name}@{at}: rank {rank} weights are {diff:.2e} from the uninterrupted run'
            assert torch.allclose(run['optimizer'], full['optimizer'], atol=TOL, rtol=0), f'{name}@{at}: optimizer'
            assert run['timestamp'] == full['timestamp'], f'{name}@{at}: rank {rank}'
            assert run['reports'] == full['reports'], f'{name}@{at}: rank {rank}'


@pytest.mark.parametrize('name', expand(['rank0_short', 'batch_sizes', 'rebalance'], RESUME))
def test_the_uninterrupted_run_trains_every_sample_once_per_epoch(runs, name):
    cfg = RESUME[name]
    trained = sorted(i for res in ok(runs, name) for ids in res['full']['ids'].values() for i in ids)
    assert trained == sorted([r * 1000 + i for r, n in enumerate(cfg['shards']) for i in range(n)] * cfg['epochs'])


@pytest.mark.parametrize('name', expand(['rank0_short', 'batch_sizes', 'fsdp2_sharded'], RESUME))
def test_the_uninterrupted_run_matches_the_reference(runs, name):
    cfg = dict(RESUME[name])
    if 'batch_sizes' in cfg:
        cfg['batch_size'] = 0
        cfg['batch_plan'] = [
            [b] * (n // b) + ([n % b] if n % b else []) for n, b in zip(cfg['shards'], cfg['batch_sizes'])
        ]
    ref = reference.train(cfg)
    for rank, res in enumerate(ok(runs, name)):
        assert reference.max_abs_diff(res['full']['params'], ref['params']) < 1e-5, f'{name}: rank {rank}'


# -- settings ---------------------------------------------------------------------------------------


def differing(per_rank: list[dict]) -> list[str]:
    """Per setting that differs between ranks, ``'<key>=<value> on rank(s) [...], ...'``, values in order of first rank."""
    parts = []
    for key, default in DEFAULTS.items():
        holders: dict = {}
        for rank, settings in enumerate(per_rank):
            holders.setdefault(settings.get(key, default), []).append(rank)
        if len(holders) > 1:
            parts.append(', '.join(f'{key}={value!r} on rank(s) {ranks}' for value, ranks in holders.items()))
    return parts


def test_the_expected_setting_messages_are_the_measured_ones():  # the helper above, on the unrotated scenarios
    assert differing(SETTINGS['mode']['per_rank']) == [
        "mode='shadow' on rank(s) [0, 2], mode='rebalance' on rank(s) [1]"
    ]
    assert differing(SETTINGS['throw_and_divide']['per_rank']) == [
        'throw_on_early_termination=False on rank(s) [0, 1], throw_on_early_termination=True on rank(s) [2]',
        'divide_by_initial_world_size=False on rank(s) [0], divide_by_initial_world_size=True on rank(s) [1, 2]',
    ]
    assert differing(SETTINGS['enable']['per_rank']) == ['enable=True on rank(s) [0, 1], enable=False on rank(s) [2]']


@pytest.mark.parametrize('name', expand(['mode', 'throw_and_divide', 'enable'], SETTINGS))
def test_settings_that_differ_between_ranks_stop_every_rank_before_the_first_step(runs, name):
    parts = differing(SETTINGS[name]['per_rank'])
    assert parts
    for rank, res in enumerate(ok(runs, name)):
        assert res['error'].startswith('UnevenJoin is configured differently on different ranks: '), (name, res)
        for part in parts:
            assert part in res['error'], (name, rank, res['error'])
        assert res['batch'] == 0, f'{name}: rank {rank} trained {res["batch"]} steps'


def test_a_setting_that_is_the_same_everywhere_is_no_error(runs):
    for res in ok(runs, 'all_disabled'):  # disabled everywhere: Composer as without it (it stops at the shortest)
        assert res['error'] is None and res['batch'] == 1


def test_a_rank_without_uneven_join_fails_at_once_with_a_clear_message_on_the_others():
    # Rank 1 has no UnevenJoin: its first collective of the epoch is Composer's one-byte "exhausted" all-reduce,
    # where rank 0 runs UnevenJoin's first agreement. On gloo rank 1 aborts; rank 0 must say why, at once.
    # (Two ranks: a launch of its own, since the aborted rank breaks the process group; measured the same with 3.)
    calls = [('absent', 'scenarios_ranks:with_settings', dict(per_rank=[{}, None], shards=[16, 8]))]
    with pytest.raises(AssertionError) as failed:
        launch(2, calls, timeout=120, collective_timeout=20)
    output = str(failed.value)
    assert 'rank 1 exited with' in output  # the launch reports the aborted rank
    line = next(line for line in output.splitlines() if line.startswith('rank 0 stopped after'))
    assert "at batch 0: UnevenJoin's first agreement (at the start of fit or evaluation) failed" in line
    assert 'a rank whose Trainer has no UnevenJoin in its algorithms' in line
    seconds = float(line.split(' stopped after ')[1].split(' s ')[0])
    assert seconds < 10, f'rank 0 waited {seconds} s (the collective timeout is 20 s)'


# -- list batches, custom DataSpecs -----------------------------------------------------------------------


@pytest.mark.parametrize('name', expand(['records_ddp', 'strings_ddp', 'records_fsdp2'], LISTS))
def test_list_batches_shadow_and_match_the_reference(runs, name):
    cfg = LISTS[name]
    ref = reference.train(cfg)
    for rank, res in enumerate(ok(runs, name)):
        assert res['error'] is None
        assert reference.max_abs_diff(res['params'], ref['params']) < 1e-5, f'{name}: rank {rank}'
        assert any(res['shadow']) == (cfg['shards'][rank] < max(cfg['shards'])) or cfg['shards'][rank] % 8 == 0
        # the report counts with the DataSpec (len): Composer's default cannot count these batches
        assert res['reports'][0]['real_samples'] == cfg['shards']


@pytest.mark.parametrize('name', expand(['records_ddp'], LISTS))
def test_microbatches_are_the_dataspecs_split(runs, name):
    # 'pairs' splits 4 samples into 2 microbatches, a shadow batch into 1 (records_ddp, multi_auto_sync);
    # per rank by its shard, wherever the rotation put it
    by_shard = {
        20: [2] * 10,
        9: [2, 2, 1, 1, 1] * 2,  # 9 = 4 + 4 + 1, then shadow steps
        0: [1] * 10,  # an empty shard: shadow steps only
    }
    for rank, res in enumerate(ok(runs, name)):
        assert res['microbatches'] == by_shard[LISTS[name]['shards'][rank]], f'{name}: rank {rank}'


def test_fsdp_microbatches_are_padded_to_the_largest_count(runs):
    # FSDP2: 8 samples in pairs are 4 microbatches; every rank runs the step's largest count (padding)
    assert all(res['microbatches'] == [4, 4, 2] for res in ok(runs, 'records_fsdp2'))


def test_an_fsdp_batch_that_a_transform_doubles_is_counted_after_it_and_trains_exactly(runs):
    # issue 46, case 3: the counts are taken again after the DataSpec's batch_transforms (which doubles every batch:
    # 16 samples in 8 pairs where 8 were counted when the batch was fetched), so every rank pads to the step's largest
    # count of what Composer trains (before: every rank stopped at step 1). Each sample twice leaves every mean
    # gradient as it was: the weights are the undoubled run's, one process's.
    cfg = dict(LISTS['doubling_fsdp2'])
    del cfg['doubling']
    ref = reference.train(cfg)
    per_rank = ok(runs, 'doubling_fsdp2')
    for rank, res in enumerate(per_rank):
        assert res['error'] is None, f'rank {rank}: {res["error"]}'
        assert reference.max_abs_diff(res['params'], ref['params']) < 1e-5, f'rank {rank}'
    assert all(res['microbatches'] == per_rank[0]['microbatches'] for res in per_rank)
    assert per_rank[0]['microbatches'][0] == 8  # 8 pairs of the doubled batch, on every rank
