"""Shadow batches are inert: nothing a model computes sees them (issue 16).

The scenarios follow torch's own DDP uneven-input tests (``test_ddp_uneven_inputs`` with its
``UnusedParamModule``, ``validate_net_equivalence``, ``..._stop_iteration_sync_bn``), under DDP through
Composer's Trainer on 2 and 3 real ranks, with and without microbatching under each sync strategy,
each against the independent single-process reference ``reference_inert`` (buffers: every
``state_dict`` tensor equal on every rank). All scenarios of a world size share one launch.
SyncBatchNorm runs torch's real module and autograd function, with CPU stand-ins for its CUDA
kernels (``syncbn_cpu``; ``make test-gpu`` uses the real kernels).
"""

from __future__ import annotations

import pytest
import torch

import reference_inert
from harness import launch
from rank_orders import expand, with_rotations
from toy import shard
from toy_inert import Counting

TOL = 1e-5
SYNCS = {'single': 'single_auto_sync', 'multi': 'multi_auto_sync', 'forced': 'forced_sync'}


def _cases() -> dict[str, dict]:
    cases: dict[str, dict] = {}
    for short, sync in SYNCS.items():
        # SyncBatchNorm: rank 1 joins after one step; the partial batch (5) splits in 2 microbatches, full ones in 3
        cases[f'syncbn_{short}_mb3'] = dict(model='syncbn', shards=[21, 8], microbatch=3, sync=sync)
        # torch's UnusedParamModule: once rank 0 has run out no real sample uses t0 (find_unused_parameters on)
        cases[f'unused_{short}_mb3'] = dict(model='unused', shards=[8, 24], microbatch=3, sync=sync, find_unused=True)
        # a top-4 loss: the shadow has no samples to rank
        cases[f'topk_{short}_mb4'] = dict(model='mlp', loss='topk', shards=[32, 16], microbatch=4, sync=sync)
        # three heads chosen from the data (find_unused_parameters off, Composer's default); without
        # microbatches single_auto_sync and multi_auto_sync sync alike, so one of them
        if short != 'multi':
            cases[f'heads_{short}'] = dict(model='heads', shards=[16, 8], sync=sync)
    cases.update(
        syncbn=dict(model='syncbn', shards=[16, 8]),
        # a model that sums its own statistics over ranks in the forward, following the rule (shadow_forward)
        sumbn_multi_mb3=dict(model='sumbn', shards=[21, 8], microbatch=3, sync='multi_auto_sync'),
        unused=dict(model='unused', shards=[8, 24], find_unused=True),
        topk=dict(model='mlp', loss='topk', shards=[32, 16]),
        # a loss dict (Composer all-reduces each key): the stand-in loss has the same keys
        dict_loss_single_mb3=dict(model='mlp', loss='dict', shards=[21, 8], microbatch=3, sync='single_auto_sync'),
        bn_eval=dict(model='bn', shards=[16, 8], epochs=2, eval_shards=[10, 3]),
        bn_rank0_short_mb3=dict(model='bn', shards=[8, 21], microbatch=3, sync='multi_auto_sync', eval_shards=[3, 10]),
        count=dict(model='count', shards=[16, 8], epochs=2),
        # three ranks
        syncbn_3=dict(model='syncbn', shards=[16, 8, 24]),
        syncbn_3_multi_mb3=dict(model='syncbn', shards=[21, 8, 13], microbatch=3, sync='multi_auto_sync'),
        sumbn_3_forced_mb3=dict(model='sumbn', shards=[8, 21, 13], microbatch=3, sync='forced_sync'),
        unused_3_mb3=dict(model='unused', shards=[8, 24, 16], microbatch=3, sync='single_auto_sync', find_unused=True),
        topk_3_mb4=dict(model='mlp', loss='topk', shards=[32, 16, 8], microbatch=4, sync='forced_sync'),
        heads_3=dict(model='heads', shards=[16, 8, 24]),
        bn_eval_3=dict(model='bn', shards=[16, 8, 5], epochs=2, eval_shards=[10, 3, 0]),
        count_3=dict(model='count', shards=[16, 8, 24], epochs=2),
        # a second fit() on the same trainer: SyncBatchNorm's padded microbatches (the DataSpec's split_batch,
        # given back at the end of the first fit) wrapped again
        syncbn_second_fit_multi_mb3=dict(
            model='syncbn', shards=[21, 8], microbatch=3, sync='multi_auto_sync', epochs=2, second_fit=True
        ),
        # a communicating forward (shadow_forward) and a rank with no train data at all, train metrics on
        # (a tensor state and a list state); with microbatches too (issue 28: KeyError on the empty rank)
        sumbn_3_empty=dict(model='sumbn', shards=[24, 8, 0], train_metrics=True),
        sumbn_3_empty_mb3=dict(model='sumbn', shards=[24, 8, 0], microbatch=3, train_metrics=True),
    )
    for cfg in cases.values():
        cfg.setdefault('batch_size', 8)
    # which rank runs short must not matter: the short (or empty) rank also first, in the middle and last
    return with_rotations(cases, [n for n, c in cases.items() if c['model'] != 'heads' and len(c['shards']) == 3])


CASES = _cases()
# Under FSDP a shadow microbatch still runs the forward (FSDP all-gathers in it), on two template
# samples; its loss is a zero-weighted sum of the outputs, never the model's (here: a top-4 loss).
FSDP = {
    f'fsdp_topk_{w}_mb4': dict(
        model='mlp', loss='topk', shards=[32, 16], batch_size=8, microbatch=4, wrapper=w, join={}
    )
    for w in ('fsdp1', 'fsdp2')
}


# BatchNorm resumed after rank 0 (whose copy Composer checkpoints) ran out: at batch 2 rank 1 is the source
RESUME = {'bn_resume_rank0_short': dict(model='bn', shards=[8, 24], batch_size=8, resume_at=2)}


# A forward that all-reduces its statistics but is not marked shadow_forward: stopped with a clear error
UNMARKED = dict(model='sumbn_unmarked', shards=[16, 8], batch_size=8, expect_error=True)


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    results = {}
    for world in (2, 3):
        calls = [
            (name, 'scenarios_inert:train_inert', {'cfg': cfg})
            for name, cfg in CASES.items()
            if len(cfg['shards']) == world
        ]
        calls += [
            (name, 'scenarios_inert:train_fsdp_topk', {'cfg': cfg})
            for name, cfg in FSDP.items()
            if len(cfg['shards']) == world
        ]
        calls += [
            (name, 'scenarios_inert:resume', {'cfg': cfg, 'folder': str(tmp_path_factory.mktemp(name))})
            for name, cfg in RESUME.items()
            if len(cfg['shards']) == world
        ]
        if world == 2:  # last: it stops training midway
            calls.append(('unmarked', 'scenarios_inert:train_inert', {'cfg': UNMARKED}))
        results.update(launch(world, calls, timeout=420))
    return results


def ok(runs: dict, name: str) -> list[dict]:
    per_rank = runs[name]
    for rank, res in enumerate(per_rank):
        assert isinstance(res, dict), f'{name}: rank {rank} failed: {res}'
        assert res['error'] is None, f'{name}: rank {rank}: {res["error"]}'
    return per_rank


@pytest.mark.parametrize('name', sorted(CASES))
def test_every_state_dict_tensor_equal_on_every_rank(runs, name):
    """torch's validate_net_equivalence: parameters and buffers identical on every rank after fit."""
    per_rank = ok(runs, name)
    for rank, res in enumerate(per_rank[1:], start=1):
        for key, value in per_rank[0]['state'].items():
            assert torch.equal(res['state'][key], value), f'{name}: {key} differs between rank 0 and rank {rank}'


@pytest.mark.parametrize('name', sorted(n for n, c in CASES.items() if c['model'] != 'bn'))
def test_matches_the_single_process_reference(runs, name):
    """SyncBatchNorm over the union of real samples; data-chosen and rank-chosen parameters; top-k losses."""
    cfg = CASES[name]
    ref = reference_inert.train(cfg)
    for rank, res in enumerate(ok(runs, name)):
        for key, value in ref.items():
            if key == 'count':  # counts forwards: one process runs one per rank and step (see the count test)
                continue
            diff = float((res['state'][key].double() - value.double()).abs().max())
            assert diff < TOL, f'{name}: rank {rank}: {key} is {diff:.2e} from the reference'


@pytest.mark.parametrize('name', sorted(n for n, c in CASES.items() if c.get('train_metrics')))
def test_train_metrics_equal_one_process_over_each_steps_real_samples(runs, name):
    """Accuracy and the concatenated per-sample losses, computed by Composer at every step, on every rank."""
    steps: list = []
    reference_inert.train(CASES[name], steps)
    for rank, res in enumerate(ok(runs, name)):
        assert len(res['train_metrics']) == len(steps), f'{name}: rank {rank}'
        for t, (got, (predicted, y, losses)) in enumerate(zip(res['train_metrics'], steps)):
            accuracy = float((predicted == y).float().mean())
            assert float(got['MulticlassAccuracy']) == pytest.approx(accuracy, abs=1e-7), (name, rank, t)
            assert torch.allclose(got['Losses'].sort().values, losses.sort().values, atol=1e-5), (name, rank, t)


@pytest.mark.parametrize('name', sorted(FSDP))
def test_fsdp_shadow_microbatches_never_run_the_loss(runs, name):
    ref = reference_inert.train(FSDP[name])
    for rank, res in enumerate(ok(runs, name)):
        for key, value in res['params'].items():
            diff = float((value.double() - ref[key].double()).abs().max())
            assert diff < TOL, f'{name}: rank {rank}: {key} is {diff:.2e} from the reference'


@pytest.mark.parametrize(
    'name', sorted(n for n, c in CASES.items() if c['model'] in ('heads', 'unused', 'mlp', 'count'))
)
def test_the_model_never_runs_on_a_shadow_batch(runs, name):
    """Under DDP a shadow step runs no model code: every forward is one of this rank's real microbatches."""
    cfg = CASES[name]
    for rank, res in enumerate(ok(runs, name)):
        assert sum(res['forward_sizes']) == cfg['shards'][rank] * cfg.get('epochs', 1)
        assert min(res['forward_sizes'], default=1) > 0


def test_heads_scenarios_use_every_head_in_every_real_batch():
    """The premise of the heads scenarios: stock DDP (find_unused_parameters off) trains these real batches."""
    for name, cfg in CASES.items():
        if cfg['model'] == 'heads':
            for rank, n in enumerate(cfg['shards']):
                y = shard(rank, n)[1]
                for i in range(0, n, cfg['batch_size']):
                    assert set(y[i : i + cfg['batch_size']].tolist()) == {0, 1, 2}, (name, rank, i)


def test_unused_parameter_is_left_alone_once_no_real_sample_uses_it(runs):
    """t0 (used by rank 0 only) keeps the value of the last step rank 0 trained, and gets no momentum update."""
    for name in ('unused', 'unused_multi_mb3'):
        cfg = CASES[name]
        first_step = dict(cfg, shards=[min(n, cfg['batch_size']) for n in cfg['shards']])
        after_step_0 = reference_inert.train(first_step)
        for res in ok(runs, name):
            assert torch.equal(res['state']['t0.weight'], res['state']['t0.weight'])
            diff = float((res['state']['t0.weight'] - after_step_0['t0.weight']).abs().max())
            assert diff < TOL, f'{name}: t0 moved by {diff:.2e} after rank 0 ran out'


@pytest.mark.parametrize('name', expand(['bn_eval', 'bn_rank0_short_mb3', 'bn_eval_3'], CASES))
def test_uneven_evaluation_of_a_batchnorm_model_equals_one_process(runs, name):
    """Buffers are equal on every rank before every evaluation; its metrics are one process's on all the data."""
    cfg = CASES[name]
    per_rank = ok(runs, name)
    assert len(per_rank[0]['eval_states']) == cfg.get('epochs', 1)
    for i, state in enumerate(per_rank[0]['eval_states']):
        for res in per_rank[1:]:
            for key, value in state.items():
                assert torch.equal(res['eval_states'][i][key], value), f'{name}: eval {i}: {key} differs'
        expected = reference_inert.evaluate(state, cfg)
        for metric, value in expected.items():
            for res in per_rank:
                assert abs(res['eval'][metric][i] - value) < 1e-6, (name, i, metric, res['eval'][metric][i], value)


@pytest.mark.parametrize('name', sorted(RESUME))
def test_batchnorm_statistics_resume_exactly_after_rank_0_ran_out(runs, name):
    """The checkpoint holds the buffer source's statistics, so a resumed fit ends where the uninterrupted one does."""
    for rank, res in enumerate(ok(runs, name)):
        for key, value in res['state'].items():
            assert torch.equal(res['resumed'][key], value), f'{name}: rank {rank}: {key} differs after resuming'


@pytest.mark.parametrize('name', expand(['count', 'count_3'], CASES))
def test_a_buffer_replaced_in_the_forward_counts_every_step_once(runs, name):
    cfg = CASES[name]
    steps = max(-(-n // cfg['batch_size']) for n in cfg['shards']) * cfg['epochs']
    for res in ok(runs, name):
        assert int(res['state']['count']) == steps


def test_buffer_guard_restores_a_buffer_the_forward_replaces():
    """Where a shadow forward still runs (FSDP, SyncBatchNorm models), its buffers come back, even replaced ones."""
    from composer_join.core.changes import Changes
    from composer_join.shadow.buffers import BufferGuard

    module = Counting()
    original = module.count
    guard, changes = BufferGuard(module), Changes()
    guard.attach(changes)
    guard.armed = True
    module(torch.randn(2, 6), torch.zeros(2, dtype=torch.long), 0)
    assert module.count is not original and int(module.count) == 1
    guard.restore()
    assert module.count is original and int(module.count) == 0
    module(torch.randn(2, 6), torch.zeros(2, dtype=torch.long), 0)  # disarmed: real forwards count
    assert int(module.count) == 1
    guard.armed = True
    module(torch.randn(2, 6), torch.zeros(2, dtype=torch.long), 0)
    changes.undo()  # a run that stops mid-microbatch: the buffers come back and the hook leaves the module
    assert int(module.count) == 1 and not module._forward_pre_hooks


def test_an_unmarked_communicating_forward_stops_every_rank_with_a_clear_error(runs):
    """Instead of a gloo abort (or an NCCL hang, or silently mixed-up sums) at the first shadow step."""
    for rank, res in enumerate(runs['unmarked']):
        assert isinstance(res, dict), f'rank {rank}: {res}'
        assert res['error'] is not None and 'shadow_forward = True' in res['error'] and 'all_reduce' in res['error'], (
            res['error']
        )
        assert 'at step 1 ' in res['error'], res['error']
