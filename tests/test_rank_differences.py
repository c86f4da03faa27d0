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
"""

from __future__ import annotations

import pytest
import torch

import reference
from harness import RankError, launch

TOL = 1e-6
WORLD = 3

RESUME: dict[str, dict] = {
    # the case: shards of 8, 24 and 20 in batches of 4 (2, 6, 5 batches); at batch 4 rank 0 shadows
    # and ranks 1 and 2 have trained 16 samples each. 9 = epoch 1, step 3.
    'rank0_short': dict(data='self_resuming', shards=[8, 24, 20], batch_size=4, epochs=2, resume_at=[1, 4, 9]),
    # batches of 2, 1 and 3 samples (11, 6, 5 batches): steps 0-3 are planned from the lengths, without
    # agreement (checkpoints 2 and 14 fall there), steps 4-10 agreed
    'batch_sizes': dict(data='self_resuming', shards=[21, 6, 13], batch_sizes=[2, 1, 3], epochs=2,
                        resume_at=[2, 7, 14]),
    # rebalancing: 2 + 6 + 5 batches in 5 steps per epoch; ranks 0 and 2 receive batches from rank 1
    'rebalance': dict(data='self_resuming', shards=[8, 24, 20], batch_size=4, epochs=2, join={'mode': 'rebalance'},
                      resume_at=[2, 3, 7]),
    # FSDP2, sharded checkpoints (a folder per checkpoint, one file per rank)
    'fsdp2_sharded': dict(data='self_resuming', shards=[8, 24, 20], batch_size=4, epochs=1, wrapper='fsdp2',
                          state_dict_type='sharded', resume_at=[4]),
}


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    calls = [(name, 'scenarios_resume:resume_cases', dict(cfg=cfg, folder=str(tmp_path_factory.mktemp(name))))
             for name, cfg in RESUME.items()]
    return launch(WORLD, calls, timeout=420)


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


@pytest.mark.parametrize('name', ['rank0_short', 'batch_sizes', 'rebalance'])
def test_the_uninterrupted_run_trains_every_sample_once_per_epoch(runs, name):
    cfg = RESUME[name]
    trained = sorted(i for res in ok(runs, name) for ids in res['full']['ids'].values() for i in ids)
    assert trained == sorted([r * 1000 + i for r, n in enumerate(cfg['shards']) for i in range(n)] * cfg['epochs'])


@pytest.mark.parametrize('name', ['rank0_short', 'batch_sizes', 'fsdp2_sharded'])
def test_the_uninterrupted_run_matches_the_reference(runs, name):
    cfg = dict(RESUME[name])
    if 'batch_sizes' in cfg:
        cfg['batch_size'], cfg['batch_plan'] = 0, [[b] * (n // b) + ([n % b] if n % b else []) for n, b in zip(cfg['shards'], cfg['batch_sizes'])]
    ref = reference.train(cfg)
    for rank, res in enumerate(ok(runs, name)):
        assert reference.max_abs_diff(res['full']['params'], ref['params']) < 1e-5, f'{name}: rank {rank}'
