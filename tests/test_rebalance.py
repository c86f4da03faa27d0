"""``UnevenJoin(mode='rebalance')`` on real ranks through Composer's Trainer, against a single-process reference.

The reference here is written from the README's specification ("Rebalancing"), not from
``composer_join.rebalance.rebalance``: it knows which batches form each step (not which rank trains which)
and computes the gradient semantics directly: at step ``t`` the mean of the per-sample loss
gradients over the samples of the step's batches, times ``A_t / W`` (``A_t`` = batches in the
step, one per rank) with ``divide_by_initial_world_size``. All scenarios of one world size run in
one launch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import reference
from harness import RankError, launch
from rank_orders import base, expand, with_rotations
from toy import make_module, per_sample_loss, shard

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
RB = {'mode': 'rebalance'}
RB_NO_DIVIDE = {'mode': 'rebalance', 'divide_by_initial_world_size': False}

SCENARIOS: dict[str, dict] = {
    # 2 ranks
    'ratio_2_1': dict(shards=[80, 40], batch_size=8, epochs=2, join=RB),
    'second_fit': dict(shards=[80, 40], batch_size=8, epochs=2, max_duration='1ep', second_fit=True, join=RB),
    'ratio_4_1_adam_no_divide': dict(shards=[64, 16], batch_size=8, epochs=1, optimizer='adam', join=RB_NO_DIVIDE),
    'empty_dict': dict(shards=[40, 0], batch_size=8, epochs=1, fmt='dict', join=RB),
    'tensor_batches': dict(shards=[24, 56], batch_size=8, epochs=1, fmt='tensor', join=RB),
    'strings_move': dict(shards=[32, 16], batch_size=8, epochs=1, fmt='text', join=RB),
    'mb_single': dict(shards=[43, 21], batch_size=8, epochs=1, microbatch=3, sync='single_auto_sync', join=RB),
    'mb_multi': dict(shards=[43, 21], batch_size=8, epochs=1, microbatch=3, sync='multi_auto_sync', join=RB),
    'mb_forced': dict(shards=[43, 21], batch_size=8, epochs=1, microbatch=3, sync='forced_sync', join=RB),
    'gift_read_fails': dict(shards=[40, 8], batch_size=8, epochs=1, fail_at={0: 20}, join=RB),
    'len_too_short': dict(shards=[40, 8], batch_size=8, epochs=1, claimed_len={0: 16}, join=RB),
    'unpicklable': dict(shards=[40, 8], batch_size=8, epochs=1, fmt='lambdas', join=RB),
    # 3 ranks
    'empty_three': dict(shards=[40, 0, 13], batch_size=4, epochs=2, join=RB),
    'three_mb_multi': dict(shards=[48, 8, 8], batch_size=8, epochs=1, microbatch=3, sync='multi_auto_sync', join=RB),
    # 4 ranks
    'four_ranks_4_1': dict(shards=[64, 16, 16, 16], batch_size=8, epochs=2, join=RB),
    'map_skewed_sampler': dict(shards=[30, 10, 0, 8], batch_size=4, epochs=2, dataset='skewed', join=RB),
}
# which rank is short (the receiver) or long (the donor) must not matter: these again with the ranks rotated;
# the unpicklable donor on the last rank too (the failing donor there: tests/test_protocol.py, in one process)
SCENARIOS = with_rotations(SCENARIOS, ['ratio_2_1', 'empty_dict', 'empty_three', 'unpicklable'])
TRAINED = [n for n in SCENARIOS if base(n) not in ('gift_read_fails', 'len_too_short', 'unpicklable')]


@pytest.fixture(scope='module')
def runs() -> dict:
    results = {}
    for world in (2, 3, 4):
        calls = [
            (name, 'scenarios_rebalance:train', {'cfg': cfg})
            for name, cfg in SCENARIOS.items()
            if len(cfg['shards']) == world
        ]
        results.update(launch(world, calls, timeout=420))
    return results


def ok(runs: dict, name: str) -> list[dict]:
    errors = [f'rank {r}: {e}' for r, e in enumerate(runs[name]) if isinstance(e, RankError)]
    assert not errors, f'{name} failed: ' + '; '.join(errors)
    return runs[name]


# -- the reference, from the README's specification ------------------------------------------------


def expected_steps(counts: list[int]) -> list[list[tuple[int, int]]]:
    """Per step, the batches ``(owner, index in the owner's shard)`` trained, by the README's rules."""
    world, left, taken, steps = len(counts), list(counts), [0] * len(counts), []
    while sum(left):
        step = []
        holders = [r for r in range(world) if left[r] > 0]
        for r in holders:  # every rank with batches left trains its next own one
            step.append((r, taken[r]))
            taken[r], left[r] = taken[r] + 1, left[r] - 1
        for _ in range(world - len(holders)):  # each other rank: one batch of the rank with the most left
            donor = sorted(range(world), key=lambda r: (-left[r], r))[0]
            if left[donor] == 0:
                break
            step.append((donor, taken[donor]))
            taken[donor], left[donor] = taken[donor] + 1, left[donor] - 1
        steps.append(step)
    return steps


def shard_batches(cfg: dict, epoch: int) -> list[list[tuple]]:
    """Per rank, its own batches in order: ``(x, y, key)``, ``key`` identifying the batch."""
    b, world = cfg['batch_size'], len(cfg['shards'])
    out = []
    for r in range(world):
        if cfg.get('dataset') == 'skewed':
            x, y = shard(7, sum(cfg['shards']))
            g = torch.Generator()
            g.manual_seed(3 + epoch)
            start = sum(cfg['shards'][:r])
            ids = torch.randperm(len(y), generator=g)[start : start + cfg['shards'][r]]
            out.append(
                [(x[ids[i : i + b]], y[ids[i : i + b]], tuple(ids[i : i + b].tolist())) for i in range(0, len(ids), b)]
            )
        else:
            x, y = shard(r, cfg['shards'][r])
            out.append([(x[i : i + b], y[i : i + b], _key(x[i])) for i in range(0, len(y), b)])
    return out


def _key(first_x: torch.Tensor) -> tuple:
    return tuple(round(v, 5) for v in first_x.tolist())


def reference_train(cfg: dict) -> dict:
    divide = cfg['join'].get('divide_by_initial_world_size', True)
    world = len(cfg['shards'])
    module = make_module(cfg.get('model', 'mlp'))
    optimizer = reference.optimizer_for(cfg, module.parameters())
    for epoch in range(cfg['epochs']):
        own = shard_batches(cfg, epoch)
        for step in expected_steps([len(batches) for batches in own]):
            batches = [own[r][i] for r, i in step]
            loss = sum(per_sample_loss(module, x, y).sum() for x, y, _ in batches)
            samples = sum(len(y) for _, y, _ in batches)
            optimizer.zero_grad()
            (loss / samples * (len(batches) / world if divide else 1.0)).backward()
            optimizer.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def observed(cfg: dict, per_rank: list[dict]) -> list[list[list[tuple[int, int] | None]]]:
    """Per epoch, per step, per rank: the ``(owner, index)`` of the batch in its ``state.batch``, None if shadow."""
    out = []
    for epoch in range(cfg['epochs']):
        lookup = {
            key: (r, i) for r, batches in enumerate(shard_batches(cfg, epoch)) for i, (_, _, key) in enumerate(batches)
        }
        rows = [[s for s in res['steps'] if s['epoch'] == epoch] for res in per_rank]
        assert len({len(r) for r in rows}) == 1, 'ranks ran different numbers of steps'
        steps = []
        for t in range(len(rows[0])):
            cells = []
            for r, row in enumerate(rows):
                s = row[t]
                if s['shadow']:
                    assert s['size'] == 0
                    cells.append(None)
                else:
                    cells.append(lookup[tuple(s['ids']) if s['ids'] is not None else _key(s['first_x'])])
            steps.append(cells)
        out.append(steps)
    return out


# -- tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', TRAINED)
def test_matches_the_reference_and_replicas_stay_identical(runs, name):
    cfg = SCENARIOS[name]
    ref = reference_train(cfg)
    reference.assert_like_reference(name, ok(runs, name), ref, TOL)


@pytest.mark.parametrize('name', TRAINED)
def test_every_batch_once_in_the_specified_steps(runs, name):
    cfg = SCENARIOS[name]
    world = len(cfg['shards'])
    per_rank = ok(runs, name)
    counts = [-(-n // cfg['batch_size']) for n in cfg['shards']]
    steps = math.ceil(sum(counts) / world)
    for epoch, seen in enumerate(observed(cfg, per_rank)):
        expected = expected_steps(counts)
        assert len(seen) == len(expected) == steps
        for t, (cells, batches) in enumerate(zip(seen, expected)):
            assert sorted(c for c in cells if c is not None) == sorted(batches), f'{name}: epoch {epoch} step {t}'
            if t < steps - 1:
                assert None not in cells, f'{name}: a rank idles at step {t}, before the last step'
    for res in per_rank:
        assert res['dataloader_len'] == steps
        assert res['timestamp'] == {
            'batch': steps * cfg['epochs'],
            'sample': sum(cfg['shards']) * cfg['epochs'],
            'epoch': cfg['epochs'],
        }


def assert_report_matches(report: dict, steps: list, world: int) -> None:
    """An epoch report's per-rank counts equal what the observed steps (per step, per rank: (source, batch) or None) say."""
    cells = [(q, c) for row in steps for q, c in enumerate(row)]
    assert report['own_batches'] == [sum(c is not None and c[0] == r for q, c in cells if q == r) for r in range(world)]
    assert report['received_batches'] == [
        sum(c is not None and c[0] != r for q, c in cells if q == r) for r in range(world)
    ]
    assert report['given_batches'] == [
        sum(c is not None and c[0] == r and q != r for q, c in cells) for r in range(world)
    ]
    assert report['shadow_steps'] == [sum(c is None for q, c in cells if q == r) for r in range(world)]
    assert sum(report['received_batches']) > 0
    assert all((report['bytes_sent'][r] > 0) == (report['given_batches'][r] > 0) for r in range(world))


@pytest.mark.parametrize(
    'name', expand(['ratio_2_1', 'empty_three', 'four_ranks_4_1', 'map_skewed_sampler', 'empty_dict'], SCENARIOS)
)
def test_report_counts_own_received_given_shadow_and_bytes(runs, name):
    cfg = SCENARIOS[name]
    world = len(cfg['shards'])
    per_rank = ok(runs, name)
    seen = observed(cfg, per_rank)
    for res in per_rank:
        assert len(res['reports']) == cfg['epochs']
        for report, steps in zip(res['reports'], seen):
            assert_report_matches(report, steps, world)
        logged = res['logged']
        assert logged['uneven_join/bytes_moved'] == [sum(r['bytes_sent']) for r in res['reports']]
        assert logged['uneven_join/rank_0/given_batches'] == [r['given_batches'][0] for r in res['reports']]
    assert any('bytes moved between ranks' in line for line in per_rank[0]['log_lines'])  # rank 0 logs the summary


def test_bytes_moved_are_the_batches_plus_small_headers(runs):
    cfg = SCENARIOS['ratio_2_1']
    report = ok(runs, 'ratio_2_1')[0]['reports'][0]
    payload = report['given_batches'][0] * cfg['batch_size'] * (6 * 4 + 8)  # float32 features, int64 label
    assert payload < report['bytes_sent'][0] < payload + 1200 * report['given_batches'][0]


def test_each_sample_id_once_per_epoch_with_a_map_style_sampler(runs):
    cfg = SCENARIOS['map_skewed_sampler']
    per_rank = ok(runs, 'map_skewed_sampler')
    for epoch in range(cfg['epochs']):
        ids = [i for res in per_rank for s in res['steps'] if s['epoch'] == epoch and not s['shadow'] for i in s['ids']]
        assert sorted(ids) == list(range(sum(cfg['shards'])))
    empty_rank = per_rank[2]  # its shard is empty: everything it trains was received
    assert sum(not s['shadow'] for s in empty_rank['steps']) > 0


def test_received_batches_are_real_batches_in_state_batch(runs):
    for name in expand(['empty_dict', 'empty_three'], SCENARIOS):
        cfg = SCENARIOS[name]
        empty = cfg['shards'].index(0)
        for steps in observed(cfg, ok(runs, name)):
            mine = [row[empty] for row in steps if row[empty] is not None]
            assert mine and all(owner != empty for owner, _ in mine)  # is_shadow_step was False for all of them


def test_non_tensor_content_moves_with_the_batch(runs):
    per_rank = ok(runs, 'strings_move')
    x, y = shard(0, 32)
    received = [s for s in per_rank[1]['steps'] if _key(s['first_x']) in {_key(x[i]) for i in range(0, 32, 8)}]
    assert received, 'rank 1 received no batch'
    for s in received:
        start = [_key(x[i]) for i in range(0, 32, 8)].index(_key(s['first_x'])) * 8
        assert s['text'] == [f'sample {int(v)}' for v in y[start : start + 8]]


@pytest.mark.parametrize('name', expand(['gift_read_fails'], SCENARIOS))
def test_a_failing_donor_stops_every_rank_without_a_hang(runs, name):
    (d,) = SCENARIOS[name]['fail_at']  # rank 0, or the last rank when rotated
    donor, receiver = runs[name][d], runs[name][1 - d]
    assert donor.type == 'RuntimeError' and 'disk read error at sample 20' in donor.message
    assert receiver.type == 'UnevenInputsError' and f'rank {d} could not read or send' in receiver.message


def test_a_len_that_hides_batches_stops_every_rank(runs):
    rank0, rank1 = runs['len_too_short']
    assert rank0.type == rank1.type == 'UnevenInputsError'
    assert 'yielded more than the 2 batches' in rank0.message
    assert 'rank(s) [0] could not form batch' in rank1.message


@pytest.mark.parametrize('name', expand(['unpicklable'], SCENARIOS))
def test_a_batch_that_cannot_be_sent_stops_every_rank_with_a_clear_error(runs, name):
    shards = SCENARIOS[name]['shards']
    d = shards.index(max(shards))  # the donor: rank 0, or the last rank when rotated
    donor, receiver = runs[name][d], runs[name][1 - d]
    assert donor.type == 'UnevenInputsError'
    assert f'rank {d} cannot send the batch rank {1 - d} is to train at step 1' in donor.message
    assert "use mode='shadow'" in donor.message
    assert receiver.type == 'UnevenInputsError' and f'rank {d} could not read or send' in receiver.message


# -- the schedule's properties and the argument, without ranks -----------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=6))
def test_schedule_properties(counts):
    from composer_join.rebalance.rebalance import schedule

    steps = schedule(counts)
    world = len(counts)
    assert len(steps) == math.ceil(sum(counts) / world)
    cells = [c for row in steps for c in row if c is not None]
    assert sorted(cells) == [(r, i) for r in range(world) for i in range(counts[r])]
    assert [sorted(c for c in row if c is not None) for row in steps] == [sorted(s) for s in expected_steps(counts)]
    for r in range(world):  # a rank's assigned steps come first; only the last step may shadow
        mine = [row[r] is not None for row in steps]
        assert mine == sorted(mine, reverse=True)
        assert all(mine[:-1])


def test_mode_must_be_one_of_the_allowed_values_in_python_and_yaml():
    from composer_join import UnevenJoin
    from composer_join.config.config import ConfigError, build, load_config
    from composer_join.config.registry import ALGORITHMS

    with pytest.raises(ValueError, match="must be one of 'shadow', 'rebalance'; got 'rebalanse'"):
        UnevenJoin(mode='rebalanse')
    with pytest.raises(ConfigError, match=r"algorithms\.uneven_join: .*must be one of 'shadow', 'rebalance'"):
        build(ALGORITHMS, {'uneven_join': {'mode': 'rebalanse'}}, 'algorithms')
    [join] = build(ALGORITHMS, {'uneven_join': {'mode': 'rebalance'}}, 'algorithms')
    assert join.mode == 'rebalance' and UnevenJoin().mode == 'shadow'
    # the YAML form, as a command-line override of a shipped config
    cfg = load_config(ROOT / 'configs' / 'digits_uneven.yaml', ['algorithms=[{uneven_join: {mode: rebalanse}}]'])
    with pytest.raises(ConfigError, match=r"algorithms\[0\]\.uneven_join: .*must be one of 'shadow', 'rebalance'"):
        build(ALGORITHMS, OmegaConf.to_container(cfg.algorithms), 'algorithms')
    cfg = load_config(ROOT / 'configs' / 'digits_uneven.yaml', ['algorithms=[{uneven_join: {mode: rebalance}}]'])
    assert build(ALGORITHMS, OmegaConf.to_container(cfg.algorithms), 'algorithms')[0].mode == 'rebalance'
