"""``UnevenJoin(mode='rebalance')`` when some or all ranks' dataloaders have no ``len()``, on real ranks.

The reference is a single-process replay written from the rule in docs/rebalancing-without-len.md
(not from ``composer_join.rebalance.readahead``): :func:`simulate` plays every rank's read-ahead buffer and
the give/receive rule step by step from the shard sizes alone, which gives which batch each rank
trains at each step; the test checks that the ranks recorded exactly that assignment, then
replays it in one process with the gradient semantics (mean of the per-sample loss gradients over
the step's samples, times ``A_t / W``) and compares the weights. One launch per world size.

Which rank runs short must not matter (tests/rank_orders.py): every scenario but two of the three
microbatching variants (``mb_multi`` stands for ``mb_single`` and ``mb_forced`` too) and the failing
ones runs again with its short (or empty) rank first, in the middle and last, as ``'<name>@<k>'``
(shards and the ranks without ``len()`` move together); the simulation and the replay read the rotated
config, and the rank that holds the unsendable batch is the one the rotated config gives the long
shard. The failing scenarios with the other rank failing are decisions tested in one process
(tests/test_protocol.py, ``readahead_fails_*@1``).
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from harness import RankError, launch
from rank_orders import base, expand, with_rotations
from test_rebalance import assert_report_matches
from toy import make_module, per_sample_loss, shard

TOL = 1e-5
READ_AHEAD = 2

SCENARIOS: dict[str, dict] = {
    # 2 ranks
    'all_unsized_2_1': dict(shards=[80, 40], batch_size=8, epochs=2),
    'mixed_empty_mid_batch_adam': dict(
        shards=[43, 0],
        batch_size=8,
        epochs=2,
        unsized=[0],
        optimizer='adam',
        join={'divide_by_initial_world_size': False},
    ),
    'sized_long_unsized_short': dict(shards=[61, 5], batch_size=4, epochs=1, unsized=[1]),
    'mb_single': dict(shards=[43, 21], batch_size=8, epochs=1, unsized=[1], microbatch=3, sync='single_auto_sync'),
    'mb_multi': dict(shards=[43, 21], batch_size=8, epochs=1, unsized=[1], microbatch=3, sync='multi_auto_sync'),
    'mb_forced': dict(shards=[43, 21], batch_size=8, epochs=1, unsized=[1], microbatch=3, sync='forced_sync'),
    'unsendable_falls_back': dict(shards=[40, 8], batch_size=8, epochs=1, fmt='local_dict'),
    'fails_mid_epoch': dict(shards=[40, 8], batch_size=8, epochs=1, fail_at={0: 36}),
    'fails_at_the_start': dict(shards=[40, 8], batch_size=8, epochs=1, fail_at={1: 3}),
    # batch 4 is read at step 2, which needs no agreement (every buffer full): step 2 trains, step 3 stops all
    'fails_on_a_step_nobody_agreed_on': dict(shards=[80, 80], batch_size=8, epochs=1, fail_at={0: 36}),
    # 3 ranks
    'three_mixed_empty': dict(shards=[40, 0, 13], batch_size=4, epochs=2, unsized=[0, 1]),
    # 4 ranks
    'four_4_1': dict(shards=[64, 16, 16, 16], batch_size=8, epochs=1),
    'four_one_empty_mb_multi': dict(
        shards=[24, 24, 24, 0], batch_size=8, epochs=1, unsized=[3], microbatch=3, sync='multi_auto_sync'
    ),
}
ROTATED = [n for n in SCENARIOS if n not in ('mb_single', 'mb_forced') and not n.startswith('fails_')]
BASE_NAMES = list(SCENARIOS)
SCENARIOS = with_rotations(SCENARIOS, ROTATED)
TRAINED = [n for n in expand(BASE_NAMES, SCENARIOS) if not n.startswith('fails_')]
TEXT_OVERRIDES = ['data.pydoc_text.fraction=0.1', 'algorithms.uneven_join.mode=rebalance']
RESUME = dict(shards=[56, 16], batch_size=8, epochs=2, resume_at=[3, 8])  # steps 2-4 and 7-9 are the tails
# a dataset that resumes itself (Composer's protocol, registered): replayed, as the read-ahead buffers are in no checkpoint
RESUMES_ITSELF = dict(RESUME, resumes_itself=True)


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    results = {}
    for world in (2, 3, 4):
        calls = [
            (name, 'scenarios_readahead:train', {'cfg': cfg})
            for name, cfg in SCENARIOS.items()
            if len(cfg['shards']) == world
        ]
        if world == 2:
            calls.append(
                (
                    'resume',
                    'scenarios_readahead:resume',
                    {'cfg': RESUME, 'folder': str(tmp_path_factory.mktemp('readahead'))},
                )
            )
            calls.append(('text', 'scenarios_readahead:text_token_budget', {'overrides': TEXT_OVERRIDES}))
            calls.append(
                (
                    'resumes_itself',
                    'scenarios_readahead:resume',
                    {'cfg': RESUMES_ITSELF, 'folder': str(tmp_path_factory.mktemp('resumes_itself'))},
                )
            )
        results.update(launch(world, calls, timeout=420))
    return results


def ok(runs: dict, name: str) -> list:
    errors = [f'rank {r}: {e}' for r, e in enumerate(runs[name]) if isinstance(e, RankError)]
    assert not errors, f'{name} failed: ' + '; '.join(errors)
    return runs[name]


# -- the reference: the rule of docs/rebalancing-without-len.md, played from the shard sizes -----------


Cell = Optional[tuple[int, int]]  # (owner rank, index of the batch in the owner's shard); None: idle


def simulate(counts: list[int], sendable: bool = True) -> list[list[Cell]]:
    """Per step, per rank, the batch it trains, by the documented rule (``sendable=False``: no batch can move)."""
    world = len(counts)
    read, drained = [0] * world, [False] * world
    buffers = [collections.deque() for _ in range(world)]

    def fill(r: int, size: int) -> None:  # read own batches until the buffer holds `size`, or the end is hit
        while not drained[r] and len(buffers[r]) < size:
            if read[r] < counts[r]:
                buffers[r].append((r, read[r]))
                read[r] += 1
            else:
                drained[r] = True

    steps: list[list[Cell]] = []
    for r in range(world):  # the epoch's start: buffers filled, levels exchanged
        fill(r, READ_AHEAD)
    transfers = True
    while True:
        held = [len(b) for b in buffers]
        if sum(held) == 0:
            return steps
        row: list[Cell] = [buffers[r].popleft() if held[r] else None for r in range(world)]
        gives: dict[int, list[int]] = collections.defaultdict(list)
        if transfers:
            given = [0] * world
            for r in range(world):
                if held[r]:
                    continue
                surplus = {q: held[q] - 1 - given[q] for q in range(world) if held[q] >= 1}
                donors = [q for q in surplus if surplus[q] >= 1 or not drained[q]]
                if donors:
                    donor = sorted(donors, key=lambda q: (-surplus[q], q))[0]
                    given[donor] += 1
                    gives[donor].append(r)
        stop_transfers = False
        for donor, receivers in sorted(gives.items()):
            for r in receivers:  # buffered batches first, then fresh ones; unsendable: the donor keeps it
                fill(donor, 1)
                if not buffers[donor]:
                    continue  # the donor ran out: r idles
                if not sendable:
                    stop_transfers = True
                    break
                row[r] = buffers[donor].popleft()
        transfers = transfers and not stop_transfers
        for r in range(world):
            fill(r, READ_AHEAD)
        steps.append(row)


def agreed_steps(counts: list[int], sendable: bool = True) -> list[bool]:
    """Per step, whether the ranks must exchange rows, by the documented rule: not if every rank held 2 or more.

    The levels a step is judged by are those of the previous step (the epoch's start for step 0) if
    that step was agreed, else one less than the ones before it (what every rank is known to hold).
    A rank's level after a step is its own batches not yet used (trained or given), at most 2.
    """
    steps = simulate(counts, sendable)
    levels = [min(READ_AHEAD, n) for n in counts]  # at the epoch's start
    out = []
    for t in range(len(steps)):
        agreed = min(levels) < 2
        out.append(agreed)
        if agreed:
            used = [sum(c is not None and c[0] == r for row in steps[: t + 1] for c in row) for r in range(len(counts))]
            levels = [min(READ_AHEAD, n - u) for n, u in zip(counts, used)]
        else:
            levels = [held - 1 for held in levels]
    return out


def counts_of(cfg: dict) -> list[int]:
    return [math.ceil(n / cfg['batch_size']) for n in cfg['shards']]


def batch(cfg: dict, cell: tuple[int, int]):
    owner, i = cell
    x, y = shard(owner, cfg['shards'][owner])
    b = cfg['batch_size']
    return x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]


def replay(cfg: dict, steps_per_epoch: list[list[list[Cell]]]) -> dict:
    """One process trains the steps' batches with the gradient semantics of "What it computes"."""
    divide = cfg.get('join', {}).get('divide_by_initial_world_size', True)
    world = len(cfg['shards'])
    module = make_module('mlp')
    optimizer = reference.optimizer_for(cfg, module.parameters())
    for steps in steps_per_epoch:
        for row in steps:
            cells = [c for c in row if c is not None]
            if not cells:
                continue
            batches = [batch(cfg, c) for c in cells]
            samples = sum(len(y) for _, y in batches)
            loss = sum(per_sample_loss(module, x, y).sum() for x, y in batches)
            optimizer.zero_grad()
            (loss / samples * (len(cells) / world if divide else 1.0)).backward()
            optimizer.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def observed(cfg: dict, per_rank: list[dict]) -> list[list[list[Cell]]]:
    """Per epoch, per step, per rank: the ``(owner, index)`` of the batch the rank trained (from the sample ids)."""
    b = cfg['batch_size']
    assert len({len(res['steps']) for res in per_rank}) == 1, 'ranks ran different numbers of steps'
    out: list[list[list[Cell]]] = []
    for t in range(len(per_rank[0]['steps'])):
        epoch = per_rank[0]['steps'][t]['epoch']
        assert all(res['steps'][t]['epoch'] == epoch for res in per_rank)
        if epoch == len(out):
            out.append([])
        row = []
        for res in per_rank:
            ids = res['steps'][t]['ids']
            if ids is None:
                row.append(None)
                continue
            owner, first = divmod(ids[0], 1000)
            assert first % b == 0 and ids == list(range(ids[0], ids[0] + len(ids))), ids
            row.append((owner, first // b))
        out[-1].append(row)
    return out


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', TRAINED)
def test_each_step_trains_the_batches_the_rule_gives(runs, name):
    cfg = SCENARIOS[name]
    expected = simulate(counts_of(cfg), sendable=cfg.get('fmt') != 'local_dict')
    seen = observed(cfg, ok(runs, name))
    assert len(seen) == cfg['epochs']
    for epoch, steps in enumerate(seen):
        assert steps == expected, f'{name}: epoch {epoch}'
        cells = sorted(c for row in steps for c in row if c is not None)
        assert cells == [(r, i) for r, n in enumerate(counts_of(cfg)) for i in range(n)]  # every batch once


@pytest.mark.parametrize('name', TRAINED)
def test_weights_match_the_single_process_replay_and_replicas_stay_identical(runs, name):
    cfg = SCENARIOS[name]
    expected = simulate(counts_of(cfg), sendable=cfg.get('fmt') != 'local_dict')
    reference.assert_like_reference(name, ok(runs, name), replay(cfg, [expected] * cfg['epochs']), TOL)


def test_rebalancing_keeps_every_rank_busy_with_a_bounded_read_ahead(runs):
    for name in TRAINED:
        cfg = SCENARIOS[name]
        per_rank = ok(runs, name)
        assert all(res['loader'] == 'ReadAheadRebalancer' for res in per_rank)
        assert all(res['peak_held'] <= READ_AHEAD for res in per_rank), name
        if base(name) == 'unsendable_falls_back':
            continue
        assert not any('falling back' in line for line in per_rank[0]['log_lines']), name
        total, world = sum(counts_of(cfg)), len(cfg['shards'])
        steps = len(simulate(counts_of(cfg)))
        assert steps <= math.ceil(total / world) + 1, name
        shadow = sum(res['steps'][t]['ids'] is None for res in per_rank for t in range(steps))
        assert shadow < world * 3, name


def test_steps_where_every_buffer_is_full_exchange_no_rows(runs):
    for name in TRAINED:
        cfg = SCENARIOS[name]
        expected = agreed_steps(counts_of(cfg), sendable=cfg.get('fmt') != 'local_dict')
        for res in ok(runs, name):
            per_epoch = [[s['agreed'] for s in res['steps'] if s['epoch'] == e] for e in range(cfg['epochs'])]
            for epoch, agreed in enumerate(per_epoch):
                assert agreed == expected, f'{name}: epoch {epoch}'
    assert agreed_steps([5, 5]) == [False, True, False, True, True] and all(agreed_steps([5, 1]))
    assert sum(agreed_steps(counts_of(SCENARIOS['four_4_1']))) < len(agreed_steps(counts_of(SCENARIOS['four_4_1'])))


def test_report_counts_own_received_given_and_shadow_steps(runs):
    for name in expand(['all_unsized_2_1', 'mixed_empty_mid_batch_adam', 'three_mixed_empty'], SCENARIOS):
        cfg = SCENARIOS[name]
        per_rank = ok(runs, name)
        steps = observed(cfg, per_rank)[0]
        world = len(cfg['shards'])
        for res in per_rank:
            # epoch 0 (the last epoch of a fit for a number of samples has no EPOCH_END)
            assert_report_matches(res['reports'][0], steps, world)


@pytest.mark.parametrize('name', expand(['unsendable_falls_back'], SCENARIOS))
def test_an_unsendable_batch_falls_back_to_shadowing_with_one_warning(runs, name):
    shards = SCENARIOS[name]['shards']
    donor = shards.index(max(shards))  # the long rank: the one that would give a batch
    per_rank = ok(runs, name)
    warnings = [line for line in per_rank[0]['log_lines'] if 'falling back to shadowing' in line]
    assert len(warnings) == 1 and f'rank(s) [{donor}] hold a batch that cannot be sent' in warnings[0]
    assert per_rank[0]['reports'] == [] or sum(per_rank[0]['reports'][0]['received_batches']) == 0


def failing_and_other(runs: dict, name: str) -> tuple[int, RankError, RankError]:
    (rank,) = SCENARIOS[name]['fail_at']
    return rank, runs[name][rank], runs[name][1 - rank]


@pytest.mark.parametrize('rotation', [''])
def test_a_dataloader_raising_mid_epoch_stops_every_rank(runs, rotation):
    rank, failing, other = failing_and_other(runs, 'fails_mid_epoch' + rotation)
    assert isinstance(failing, RankError) and failing.type == 'RuntimeError'
    assert 'disk read error at sample 36' in failing.message
    assert isinstance(other, RankError) and other.type == 'UnevenInputsError'
    assert f'rank(s) [{rank}] could not form batch 1' in other.message
    # read at step 2: step 2 trains, step 3 stops all
    rank, failing, other = failing_and_other(runs, 'fails_on_a_step_nobody_agreed_on' + rotation)
    assert isinstance(failing, RankError) and failing.type == 'RuntimeError'
    assert 'disk read error at sample 36' in failing.message
    assert isinstance(other, RankError) and other.type == 'UnevenInputsError'
    assert f'rank(s) [{rank}] could not form batch 3' in other.message
    # while filling the buffer, before the epoch's level exchange
    rank, failing, other = failing_and_other(runs, 'fails_at_the_start' + rotation)
    assert isinstance(failing, RankError) and failing.type == 'RuntimeError'
    assert 'disk read error at sample 3' in failing.message
    assert isinstance(other, RankError) and other.type == 'UnevenInputsError'
    assert f'rank(s) [{rank}] could not read the first batches of the epoch' in other.message


@pytest.mark.parametrize('at', RESUMES_ITSELF['resume_at'])
def test_a_dataset_that_resumes_itself_is_replayed_from_a_mid_epoch_checkpoint(runs, at):
    # its position would depend on read-ahead buffers no checkpoint holds: Composer replays (spins) the epoch
    # instead, and the resumed run trains what the uninterrupted one did (a dataset that also loaded its state
    # would skip its samples twice)
    full = ok(runs, 'resumes_itself')
    for rank in range(2):
        whole, resumed = full[rank]['full'], full[rank][f'resumed@{at}']
        assert resumed['steps'] == [s for s in whole['steps'] if s['batch'] >= at]
        assert reference.max_abs_diff(whole['params'], resumed['params']) == 0.0


@pytest.mark.parametrize('at', RESUME['resume_at'])
def test_a_checkpoint_resumed_mid_tail_gives_the_same_batches_and_weights(runs, at):
    full = ok(runs, 'resume')
    expected = simulate(counts_of(RESUME))
    steps = len(expected)
    step = at % steps
    assert any(row[1] is not None and row[1][0] == 0 for row in expected[step:]), 'not in the tail'
    for rank in range(2):
        whole, resumed = full[rank]['full'], full[rank][f'resumed@{at}']
        assert reference.max_abs_diff(whole['params'], resumed['params']) == 0.0
        after = [s for s in whole['steps'] if s['batch'] >= at]
        assert resumed['steps'] == after  # same ids at the same global steps: nothing skipped or repeated
    reference.assert_like_reference(
        'resume', [full[r]['full'] for r in range(2)], replay(RESUME, [expected] * RESUME['epochs']), TOL
    )


# -- the token-budget text config (configs/text_token_budget.yaml), its shards without len() -----------


def test_token_budget_text_config_matches_the_replay(runs):
    import sys

    from composer.optim import DecoupledAdamW

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'examples'))
    from models import MODELS

    per_rank = runs['text']
    errors = [str(e) for e in per_rank if isinstance(e, RankError)]
    assert not errors, errors
    assert [res['loader'] for res in per_rank] == ['ReadAheadRebalancer'] * 2
    own = [res['own'] for res in per_rank]
    counts = [len(o) for o in own]
    assert counts[0] != counts[1]  # token budgets make the shards uneven
    lookup = {
        tuple(t.flatten()[:64].tolist() + [t.shape[0], t.shape[1]]): (r, i)
        for r, batches in enumerate(own)
        for i, (t, _) in enumerate(batches)
    }
    steps = len(per_rank[0]['steps'])
    seen = [
        [
            None
            if res['steps'][t]['batch'] is None
            else lookup[
                tuple(res['steps'][t]['batch'][0].flatten()[:64].tolist() + list(res['steps'][t]['batch'][0].shape))
            ]
            for res in per_rank
        ]
        for t in range(steps)
    ]
    assert seen == simulate(counts)
    assert len(seen) < max(counts)  # shorter than shadowing's epoch
    lrs = [[s['lr'] for s in res['steps']] for res in per_rank]
    assert lrs[0] == lrs[1]

    torch_model = MODELS['byte_lm'](dim=64)
    torch_model.load_state_dict({**torch_model.state_dict(), **per_rank[0]['init']})
    optimizer = DecoupledAdamW(torch_model.parameters(), lr=3.0e-3, weight_decay=0.0)
    for t, row in enumerate(seen):
        cells = [c for c in row if c is not None]
        batches = [own[r][i] for r, i in cells]
        samples = sum(len(b[0]) for b in batches)
        loss = sum(len(b[0]) / samples * torch_model.loss(torch_model(b), b) for b in batches)
        for group in optimizer.param_groups:
            group['lr'] = lrs[0][t]
        optimizer.zero_grad()
        (loss * len(cells) / len(row)).backward()
        optimizer.step()
    ref = {k: v.detach().clone() for k, v in torch_model.named_parameters()}
    for rank, res in enumerate(per_rank):
        diff = reference.max_abs_diff(res['params'], ref)
        assert diff < TOL, f'rank {rank} is {diff:.2e} from the replay'


# -- the rule's properties, without ranks -------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=2, max_size=6))
def test_the_rule_trains_every_batch_once_in_at_most_one_step_more_than_the_sized_scheme(counts):
    steps = simulate(counts)
    cells = sorted(c for row in steps for c in row if c is not None)
    assert cells == [(r, i) for r, n in enumerate(counts) for i in range(n)]
    assert len(steps) <= max(1, math.ceil(sum(counts) / len(counts)) + 1)


def test_assign_follows_the_documented_rule():
    from composer_join.rebalance.readahead import assign

    assert assign([(0, True), (0, True)]) is None  # every buffer empty: the epoch ends
    assert assign([(2, False), (0, True), (0, True), (0, True)]) == [0, 0, 0, 0]  # buffer, then fresh reads
    assert assign([(2, True), (0, True), (0, True)]) == [0, 0, None]  # drained: only the buffer's surplus
    assert assign([(2, False), (2, True), (0, True), (0, True)]) == [0, 1, 0, 1]  # largest surplus, ties low
    assert assign([(1, True), (2, False), (0, True)]) == [0, 1, 1]
    assert assign([(2, False), (0, True)], transfers=False) == [0, None]
