"""Where Composer's own tests (v0.32.1, UnevenJoin in every Trainer) found UnevenJoin behaving otherwise than stock.

Issue 29, each checked on real ranks through Composer's Trainer against an independent expectation:

1. a ``DistributedSampler`` passed as ``batch_sampler=`` is reshuffled every epoch, as Composer reshuffles it
   (expected orders: torch's own ``DistributedSampler`` in this process);
2. a rank that shadows a whole step gives no warning a rank with data does not give (torchmetrics' "compute
   before update"), and with warnings as errors (Composer's test configuration) the run completes on every
   rank instead of one rank raising while the other waits in the metric's sync; both rank orders;
3. a checkpoint saved by 2 ranks resumes on 3 at an epoch boundary (every sample of the new shards trained
   once, the replicas equal), and mid-epoch every rank stops with an error naming both world sizes.

Beside them: a ``DataSpec`` of the user's own (train, with a ``split_batch`` of its own, and eval) holds its own
``split_batch`` again after ``fit()``, ``eval()`` and ``predict()`` (UnevenJoin wraps it only while it runs), and a
second ``fit()`` still trains and evaluates every sample once; DDP and FSDP1, the short rank first and last.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from composer_join import ExactDistributedSampler
from harness import RankError, launch

SIZE, BATCH, EPOCHS = 24, 2, 2  # Composer's test_set_dataloaders_to_cur_epoch
# rank 1 has 8 more samples (Composer's test_rank_dependent_dataloader_lengths), then the long rank first
SHARDS = {'short_first': [16, 24], 'long_first': [24, 16]}
RESIZE_SIZE, RESIZE_BATCH = 26, 4  # 2 ranks: 13, 13 samples (4 batches each); 3 ranks: 9, 9, 8 (3, 3, 2)
# the user's DataSpecs: train batches of 4 (3 and 1 per rank), eval batches of 4 (3 and 1)
SPEC_CASES = {
    f'{wrapper}-{order}': dict(shards=shards, eval_shards=eval_shards, wrapper=wrapper)
    for wrapper in ('ddp', 'fsdp1')
    for order, shards, eval_shards in (('short_last', [10, 3], [9, 2]), ('short_first', [3, 10], [2, 9]))
}


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp('resize'))
    calls = [
        ('orders', 'scenarios_stock_parity:batch_sampler_orders', dict(size=SIZE, batch_size=BATCH, epochs=EPOCHS))
    ]
    for name, shards in SHARDS.items():
        for error in (False, True):
            calls.append(
                (f'{name}-{error}', 'scenarios_stock_parity:shadow_warnings', dict(shards=shards, error=error))
            )
    calls.append(
        (
            'save',
            'scenarios_stock_parity:save_for_resize',
            dict(folder=folder, size=RESIZE_SIZE, batch_size=RESIZE_BATCH),
        )
    )
    for name, kwargs in SPEC_CASES.items():
        calls.append((f'spec-{name}', 'scenarios_stock_parity:user_data_specs', kwargs))
    runs = launch(2, calls, timeout=300)
    runs['folder'] = folder
    return runs


@pytest.fixture(scope='module')
def resized(two_ranks) -> dict:
    files = ok(two_ranks, 'save')[0]['checkpoints']
    assert 'ep1-ba4-rank0.pt' in files and 'ep0-ba2-rank0.pt' in files, files
    kwargs = dict(folder=two_ranks['folder'], size=RESIZE_SIZE, batch_size=RESIZE_BATCH)
    calls = [
        (key, 'scenarios_stock_parity:resume_resized', dict(checkpoint=file, **kwargs))
        for key, file in (('boundary', 'ep1-ba4-rank0.pt'), ('mid_epoch', 'ep0-ba2-rank0.pt'))
    ]
    return launch(3, calls, timeout=300)


def ok(runs: dict, name: str) -> list:
    errors = [f'rank {r}: {e}' for r, e in enumerate(runs[name]) if isinstance(e, RankError)]
    assert not errors, f'{name} failed: ' + '; '.join(errors)
    return runs[name]


def test_a_distributed_sampler_passed_as_batch_sampler_is_reshuffled_every_epoch(two_ranks):
    dataset = list(range(SIZE))
    for rank, res in enumerate(ok(two_ranks, 'orders')):
        expected = {}
        for epoch in range(EPOCHS):
            sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, drop_last=True)
            sampler.set_epoch(epoch)
            expected[epoch] = list(sampler)
        assert expected[0] != expected[1]  # the check below can tell a reshuffle from a repeat
        assert res['ids'] == expected, f'rank {rank}'
        assert res['sampler_epoch'] == EPOCHS - 1  # what Composer's test asserts


@pytest.mark.parametrize('error', [False, True], ids=['recorded', 'as_errors'])
@pytest.mark.parametrize('name', SHARDS)
def test_a_shadowing_rank_gives_no_warning_and_warnings_as_errors_do_not_hang(two_ranks, name, error):
    per_rank = ok(two_ranks, f'{name}-{error}')  # as_errors: a warning would have raised (and hung) a rank
    shards = SHARDS[name]
    for rank, res in enumerate(per_rank):
        before_update = [w for w in res['warnings'] if 'before the ``update``' in w]
        assert not before_update, f'rank {rank}: {before_update}'
        # every rank's own DistributedSampler halves its own dataset: rank r's half, every sample trained
        own = list(DistributedSampler(list(range(shards[rank])), num_replicas=2, rank=rank, shuffle=False))
        assert res['trained'] == sorted(own), f'rank {rank}'
        assert res['samples'] == sum(s // 2 for s in shards)


def test_a_checkpoint_of_2_ranks_resumes_on_3_at_an_epoch_boundary(resized):
    dataset = list(range(RESIZE_SIZE))
    per_rank = ok(resized, 'boundary')
    for rank, res in enumerate(per_rank):
        assert res['error'] is None, f'rank {rank}: {res["error"]}'
        sampler = ExactDistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        assert res['ids'] == {1: list(sampler)}, f'rank {rank}'  # its new shard of epoch 1, each sample once
        assert (res['epoch'], res['batch']) == (2, 4 + 3)  # 4 steps on 2 ranks, then the longest 3-rank shard's 3
        assert res['report_worlds'] == [2, 3]
        assert torch.equal(res['params'], per_rank[0]['params']), f'rank {rank}: replicas differ'


def test_a_checkpoint_of_2_ranks_resumes_on_3_mid_epoch_every_sample_once(two_ranks, resized):
    # ExactDistributedSampler names every rank's shard in one index space: the rest of epoch 0 resumes on 3 ranks
    # (issue 35), each sample of it once; epoch 1 then on the 3 ranks' shards. (Before: every rank stopped at
    # FIT_START naming both world sizes; before that, IndexError in the report at the first step.)
    dataset = list(range(RESIZE_SIZE))
    saved = ok(two_ranks, 'save')  # its first 2 batches (8 samples per rank) were trained before the checkpoint
    before = [i for res in saved for i in res['ids'][0][: 2 * RESIZE_BATCH]]
    per_rank = ok(resized, 'mid_epoch')
    after = [i for res in per_rank for i in res['ids'].get(0, [])]
    assert sorted(before + after) == dataset, 'epoch 0 across both runs: every sample once'
    for rank, res in enumerate(per_rank):
        assert res['error'] is None, f'rank {rank}: {res["error"]}'
        sampler = ExactDistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        assert res['ids'][1] == list(sampler), f'rank {rank}'
        assert torch.equal(res['params'], per_rank[0]['params']), f'rank {rank}: replicas differ'


@pytest.mark.parametrize('name', SPEC_CASES)
def test_a_data_spec_of_the_users_own_splits_as_before_once_fit_eval_and_predict_end(two_ranks, name):
    case = SPEC_CASES[name]
    for rank, run in enumerate(ok(two_ranks, f'spec-{name}')):
        # True: the very split_batch the DataSpec was made with (else the repr of what replaced it)
        assert all(v is True for v in run['kept'].values()), f'rank {rank}: {run["kept"]}'
        assert sorted(run['kept']) == [
            f'{w}/{s}' for w in ('eval', 'fit', 'predict', 'second_fit') for s in ('eval', 'train')
        ]
        own = [1000 * rank + i for i in range(case['shards'][rank])]
        assert {e: sorted(ids) for e, ids in run['trained'].items()} == {0: own, 1: own}, f'rank {rank}'
        # the evaluations after each epoch and trainer.eval(): each the whole eval shard, once
        own_eval = [1000 * (10 + rank) + i for i in range(case['eval_shards'][rank])]
        assert [sorted(ids) for ids in run['evaluated']] == [own_eval] * 3, f'rank {rank}'
