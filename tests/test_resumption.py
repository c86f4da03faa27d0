"""Resuming from a checkpoint taken at any batch ends exactly where the uninterrupted run ends.

Three ranks, one process group for all scenarios. Each scenario trains once uninterrupted with a
checkpoint after every batch, then resumes from some of those checkpoints (``load_path``) and,
after a crash, with ``autoresume=True``. Every resumed run must end with the uninterrupted run's
weights, optimizer state, timestamps and epoch reports, and train, step by step, exactly the
samples the uninterrupted run trained after the checkpoint (sample ids): none twice, none skipped.
The uninterrupted run itself is checked against the single-process reference where the reference
describes it, and trains every sample of every shard once per epoch.

Which rank runs short must not matter: ``iterable_sized`` (its empty rank) and ``self_resuming`` (its
short rank) run again with that rank first and last (tests/rank_orders.py), in the same launch, so
that rank 0, which writes the checkpoint's metadata and Composer's rank-0 dataset state and picks the
checkpoint to autoresume from, is the empty or short one. They resume from fewer checkpoints (batch 5,
mid-epoch 0, after the short rank has run out; ``iterable_sized`` also autoresumes at 8, in epoch 1) and
not from 0.1.0's checkpoint, which holds the original layout (suite time).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reference
from harness import RankError, launch
from rank_orders import expand, with_rotations

TOL = 1e-6
WORLD = 3
# Written by composer-join 0.1.0 before the package moved into subpackages (issue 26), from 'iterable_sized' at
# batch 5 (tests/data/README.md): loading it must still resume exactly where the uninterrupted run is.
SAVED_BY_0_1_0 = {5: str(Path(__file__).parent / 'data' / 'checkpoint-0.1.0-ep0-ba5-rank0.pt')}

# name -> config. Per-rank shards of 4-sample batches: 21, 0, 13 samples = 6, 0, 4 batches per epoch.
SCENARIOS: dict[str, dict] = {
    # an empty shard, rank 2 shadowing from step 4; checkpoints in epoch 0, at the epoch boundary, in epoch 1
    'iterable_sized': dict(
        data='sized',
        shards=[21, 0, 13],
        batch_size=4,
        epochs=2,
        resume_at=[1, 5, 6, 8, 11],
        autoresume_at=[8],
        saved_by_0_1_0=SAVED_BY_0_1_0,
    ),
    # microbatches of 3 under multi_auto_sync (uneven microbatch counts), Adam
    'microbatch': dict(
        data='sized',
        shards=[21, 5, 13],
        batch_size=4,
        epochs=2,
        microbatch=3,
        sync='multi_auto_sync',
        optimizer='adam',
        resume_at=[4, 9],
    ),
    # map-style, a shuffling DistributedSampler subclass with uneven shards of 17, 2 and 8 samples
    'shuffled_subclass': dict(
        data='shuffled_subclass',
        map_size=27,
        cuts=[0, 17, 19, 27],
        batch_size=4,
        epochs=2,
        resume_at=[3, 5, 7],
        autoresume_at=[7],
    ),
    # map-style, ExactDistributedSampler (shuffled, shards of 10, 10, 9 samples in batches of 3)
    'exact_sampler': dict(data='exact_sampler', map_size=29, batch_size=3, epochs=2, resume_at=[3, 6]),
    # iterable shards without len(), a duration in batches: epoch 0 has 6 steps, epoch 1 is cut at step 4
    'unsized': dict(data='unsized', shards=[21, 0, 13], batch_size=4, max_duration='10ba', resume_at=[3, 7]),
    # a dataset that resumes itself (Composer's state_dict(num_samples, from_beginning) protocol)
    'self_resuming': dict(
        data='self_resuming', shards=[21, 6, 13], batch_size=4, epochs=2, resume_at=[2, 5, 8], autoresume_at=[9]
    ),
}

# rank 0 empty or short, and the last rank: fewer checkpoints (see the module docstring)
FEWER = {
    'iterable_sized': dict(resume_at=[5], autoresume_at=[8], saved_by_0_1_0={}),
    'self_resuming': dict(resume_at=[5], autoresume_at=[]),
}
ORIGINAL = list(SCENARIOS)
SCENARIOS.update(
    (n, c) for n, c in with_rotations({k: dict(SCENARIOS[k], **v) for k, v in FEWER.items()}).items() if '@' in n
)
ALL = expand(ORIGINAL, SCENARIOS)


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    calls = [
        (
            name,
            'scenarios_resume:resume_cases',
            dict(cfg=cfg, folder=str(tmp_path_factory.mktemp(name.replace('@', '_')))),
        )
        for name, cfg in SCENARIOS.items()
    ]
    return launch(WORLD, calls, timeout=300)


def ok(runs: dict, name: str) -> list[dict]:
    errors = [f'rank {r}: {e}' for r, e in enumerate(runs[name]) if isinstance(e, RankError)]
    assert not errors, f'{name} failed: ' + '; '.join(errors)
    return runs[name]


def resumed(per_rank: list[dict]) -> list[str]:
    return [k for k in per_rank[0] if k != 'full']


@pytest.mark.parametrize('name', ALL)
def test_resumed_runs_end_exactly_where_the_uninterrupted_run_ends(runs, name):
    per_rank = ok(runs, name)
    cfg = SCENARIOS[name]
    expected = [cfg['resume_at'], cfg.get('autoresume_at', []), cfg.get('saved_by_0_1_0', {})]
    assert len(resumed(per_rank)) == sum(map(len, expected))
    for rank, res in enumerate(per_rank):
        full = res['full']
        for key in resumed(per_rank):
            run = res[key]
            diff = reference.max_abs_diff(run['params'], full['params'])
            assert diff < TOL, f'{name} {key}: rank {rank} weights are {diff:.2e} from the uninterrupted run'
            assert run['optimizer'].shape == full['optimizer'].shape
            assert torch.allclose(run['optimizer'], full['optimizer'], atol=TOL, rtol=0), f'{name} {key}: optimizer'
            assert run['timestamp'] == full['timestamp'], f'{name} {key}: rank {rank}'
            # the per-epoch reports count what was trained in each epoch, before and after the checkpoint
            assert run['reports'] == full['reports'], f'{name} {key}: rank {rank}'


@pytest.mark.parametrize('name', ALL)
def test_no_sample_is_trained_twice_or_skipped(runs, name):
    for rank, res in enumerate(ok(runs, name)):
        full = res['full']['ids']
        for key in resumed(ok(runs, name)):
            at = int(key.split('@')[1])
            after = {step: ids for step, ids in full.items() if step >= at}
            assert res[key]['ids'] == after, f'{name} {key}: rank {rank} trained other samples after resuming'


@pytest.mark.parametrize('name', ALL)
def test_uninterrupted_run_trains_every_sample_once_per_epoch(runs, name):
    cfg = SCENARIOS[name]
    per_rank = ok(runs, name)
    trained = sorted(i for res in per_rank for ids in res['full']['ids'].values() for i in ids)
    if cfg['data'] in ('shuffled_subclass', 'exact_sampler'):
        expected = sorted(list(range(cfg['map_size'])) * cfg['epochs'])
    elif 'max_duration' in cfg:
        return  # cut mid-epoch: checked against the reference below
    else:
        expected = sorted([r * 1000 + i for r, n in enumerate(cfg['shards']) for i in range(n)] * cfg['epochs'])
    assert trained == expected
    if cfg['data'] == 'shuffled_subclass':  # and the order really changes between epochs
        epochs = [
            [i for s, ids in sorted(per_rank[0]['full']['ids'].items()) for i in ids if (s < 5) == first]
            for first in (True, False)
        ]
        assert epochs[0] != epochs[1]


@pytest.mark.parametrize('name', expand(['iterable_sized', 'microbatch', 'unsized', 'self_resuming'], SCENARIOS))
def test_uninterrupted_run_matches_the_reference(runs, name):
    cfg = dict(SCENARIOS[name])
    if 'max_duration' in cfg:
        cfg.update(epochs=2, max_steps=int(cfg['max_duration'][:-2]))
    ref = reference.train(cfg)
    for rank, res in enumerate(ok(runs, name)):
        assert reference.max_abs_diff(res['full']['params'], ref['params']) < 1e-5, f'{name}: rank {rank}'


@pytest.mark.parametrize('name', expand(['self_resuming'], SCENARIOS))
def test_a_dataset_that_resumes_itself_is_given_its_own_sample_count(runs, name):
    # Composer passes the global sample_in_epoch; each rank's shard is told how many of ITS samples were trained.
    cfg = SCENARIOS[name]
    steps = 6  # longest shard: 21 samples in batches of 4
    for rank, res in enumerate(ok(runs, name)):
        n = cfg['shards'][rank]
        own = [min(4 * s, n) for s in range(1, steps + 1)]
        # every save asks twice: UnevenJoin for this rank's own count (what each rank resumes from), then Composer
        # for its rank-0 copy, with the global count (kept: a sharded checkpoint's load expects it)
        calls = res['full']['dataset_counts'][0::2]
        # one checkpoint per batch in each epoch, plus an epoch-end save at the final batch (count 0)
        assert calls[:steps] == own
        assert calls[steps : 2 * steps] == own


def test_the_position_adapter_is_chosen_by_what_the_data_is(recwarn):
    # mosaicml-streaming's StreamingDataset splits one global sample space across ranks itself: left to Composer,
    # silently; a registered class (a subclass too) gets its adapter; an unknown class with the same methods is
    # never called with guessed arguments: left to Composer, with one warning (once the ranks agreed on it) naming
    # it and how to register
    from streaming import StreamingDataset

    from composer_join import SampleCountPosition, register_position
    from composer_join.data.positions import Kind, agreed_position, kind_of, position_for

    class Shard:
        def state_dict(self, num_samples, from_beginning):
            return {'sample_in_epoch': num_samples}

        def load_state_dict(self, state):
            pass

    class Registered(Shard):
        pass

    class Sub(Registered):
        pass

    register_position(Registered, SampleCountPosition)
    streaming = StreamingDataset.__new__(StreamingDataset)
    assert position_for(None, streaming) is None and kind_of(None, None, streaming) == Kind.COMPOSER
    assert agreed_position(None, [Kind.COMPOSER], None, streaming) is None
    assert not recwarn.list
    assert isinstance(position_for(None, Sub()), SampleCountPosition)
    assert kind_of(position_for(None, Sub()), None, Sub()) == Kind.OWN
    assert position_for(None, Shard()) is None and kind_of(None, None, Shard()) == Kind.UNREGISTERED
    assert agreed_position(None, [Kind.UNREGISTERED], None, Shard()) is None
    assert agreed_position(None, [Kind.UNREGISTERED], None, Shard()) is None  # once per class
    [warning] = recwarn.list
    assert 'Shard' in str(warning.message) and 'register_position' in str(warning.message)
