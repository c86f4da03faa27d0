"""Hybrid sharding and tensor parallelism (issue 36): each data-parallel member joins as one, by design.

Four ranks on gloo, through Composer's ``Trainer`` (tests/scenarios_layouts.py, with the test-only CPU workarounds):
FSDP1 ``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2`` and FSDP2 over a 2 x 2 (replicate x shard) mesh, where every rank
is its own data-parallel member, and tensor parallelism of degree 2 beside FSDP1, where each TP group of 2 ranks is
one member (2 members). Shards are given per member (an empty rank, an empty member); microbatches of 3; shadow and
rebalance, with and without ``len()``; the empty rank or member first, in the middle and last (rotated).

Against references computed here (tests/reference.py, the rebalancing references of tests/test_rebalance.py and
tests/test_rebalance_unsized.py, with one "rank" per member): the weights, every sample once per epoch, every rank
of a TP group training the same ids at every step, the report counting each member once. A TP group given different
batches (torch's ``DistributedSampler`` with its defaults; shards of different lengths) stops every rank with an
error naming the group, its ranks and what each holds; ``ExactDistributedSampler`` shards over members by itself.
A mid-join checkpoint resumes to the uninterrupted run's weights (under TP with plain SGD: stock Composer 0.32.1
does not restore optimizer state under TP x FSDP1, measured in ``test_stock_tp_resume_loses_optimizer_state``).
The stock column of docs/parallel-layouts.md is measured here too (``test_docs_stock_column_is_the_measured_one``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import test_rebalance
from composer_join.core.layout import Layout
from composer_join.rebalance.readahead import assign
from composer_join.rebalance.rebalance import schedule
from harness import launch
from rank_orders import with_rotations
from test_join_core import ok
from test_rebalance_unsized import observed, replay, simulate

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-6
RB = {'mode': 'rebalance'}
MB = dict(batch_size=8, microbatch=3, ids=True)
HSDP = ['hsdp1', 'hsdp1_zero2', 'hsdp2']

SCENARIOS: dict[str, dict] = {
    # every rank its own member: 24/21/9/0 samples, batches of 8 in microbatches of 3
    **{f'{w}_shadow': dict(MB, parallel=w, shards=[24, 21, 9, 0], epochs=2, join={}) for w in HSDP},
    'hsdp1_rebalance': dict(MB, parallel='hsdp1', shards=[37, 21, 9, 0], epochs=1, join=RB),
    # without len() on some ranks, Composer needs a duration in batches or samples (on every rank alike)
    'hsdp2_readahead': dict(
        MB, parallel='hsdp2', shards=[37, 21, 9, 0], epochs=1, join=RB, unsized=[0, 1, 2, 3], max_duration='67sp'
    ),
    # TP 2: two members of two ranks each
    'tp_shadow': dict(MB, parallel='tp', tp=2, shards=[24, 9], epochs=2, join={}),
    'tp_empty_member': dict(
        MB, parallel='tp', tp=2, shards=[24, 0], epochs=1, join={'divide_by_initial_world_size': False}
    ),
    'tp_rebalance': dict(MB, parallel='tp', tp=2, shards=[37, 0], epochs=1, join=RB),
    'tp_readahead': dict(MB, parallel='tp', tp=2, shards=[37, 9], epochs=1, join=RB, unsized=[0], max_duration='4ba'),
    'tp_throw': dict(
        MB, parallel='tp', tp=2, shards=[24, 9], epochs=1, join={'throw_on_early_termination': True}, expect_error=True
    ),
    # one dataset through a sampler: ExactDistributedSampler shards over members; torch's, over ranks (a mistake)
    'tp_exact_sampler': dict(parallel='tp', tp=2, data='exact', map_size=37, batch_size=8, epochs=2, join={}),
    'tp_torch_sampler': dict(parallel='tp', tp=2, data='torch', map_size=40, batch_size=8, join={}, expect_error=True),
    'tp_lengths_differ': dict(MB, parallel='tp', tp=2, shards=[24, 9], rank_shards={1: 16}, join={}, expect_error=True),
}
# the empty rank (or member) first, in the middle and last
SCENARIOS = with_rotations(SCENARIOS, ['hsdp1_shadow', 'tp_empty_member', 'tp_rebalance'])
# a mid-join checkpoint (after step 3: the short rank or member has run out), resumed
CHECKPOINTS = {
    'hsdp1_ckpt': dict(MB, parallel='hsdp1', shards=[40, 21, 9, 0], epochs=1, join={}),
    'tp_ckpt': dict(MB, parallel='tp', tp=2, shards=[40, 9], epochs=1, join={}, momentum=0.0),
}
# stock Composer on the same data, no microbatching (with it, stock hangs: test_stock_hangs_with_microbatching)
STOCK = {
    'hsdp1_stock': dict(parallel='hsdp1', shards=[24, 21, 9, 0], batch_size=8, ids=True, join=None),
    'hsdp1_stock_no_empty': dict(parallel='hsdp1', shards=[24, 21, 9, 5], batch_size=8, ids=True, join=None),
    'tp_stock': dict(parallel='tp', tp=2, shards=[24, 9], batch_size=8, ids=True, join=None),
    'tp_stock_empty_member': dict(parallel='tp', tp=2, shards=[24, 0], batch_size=8, ids=True, join=None),
}
# stock Composer 0.32.1 resuming TP x FSDP1 with momentum, even data: the optimizer state is not restored
STOCK_TP_RESUME = dict(parallel='tp', tp=2, shards=[40, 40], batch_size=8, epochs=1, ids=True, join=None)


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp('layouts')
    calls = [(n, 'scenarios_layouts:train', {'cfg': c}) for n, c in {**SCENARIOS, **STOCK}.items()]
    for name, cfg in {**CHECKPOINTS, 'stock_tp_resume': STOCK_TP_RESUME}.items():
        folder = str(root / name)
        calls.append(
            (f'{name}_save', 'scenarios_layouts:train', {'cfg': dict(cfg, save_folder=folder, save_interval='3ba')})
        )
        calls.append((f'{name}_resume', 'scenarios_layouts:train_resumed', {'cfg': cfg, 'folder': folder, 'batch': 3}))
    return launch(4, calls, timeout=600)


def members(cfg: dict, per_rank: list[dict]) -> list[dict]:
    """One result per data-parallel member (its first rank's), having checked that its ranks trained the same ids."""
    tp = cfg.get('tp', 1) if cfg['parallel'] == 'tp' else 1
    groups = [per_rank[m * tp : (m + 1) * tp] for m in range(len(per_rank) // tp)]
    for m, group in enumerate(groups):
        ids = [[s['ids'] for s in res['steps']] for res in group]
        assert all(i == ids[0] for i in ids), f'member {m}: its ranks trained different samples: {ids}'
    return [group[0] for group in groups]


def weights_match(name: str, per_rank: list[dict], ref: dict) -> None:
    for rank, res in enumerate(per_rank):
        diff = reference.max_abs_diff(res['params'], ref)
        assert diff < TOL, f'{name}: rank {rank} is {diff:.2e} from the reference'


def every_sample_once(cfg: dict, lead: list[dict]) -> None:
    for epoch in range(cfg.get('epochs', 1)):
        ids = sorted(i for res in lead for s in res['steps'] if s['epoch'] == epoch and s['ids'] for i in s['ids'])
        assert ids == sorted(m * 1000 + i for m, n in enumerate(cfg['shards']) for i in range(n)), f'epoch {epoch}'


SHADOW = [n for n in SCENARIOS if SCENARIOS[n]['join'].get('mode') != 'rebalance' and 'shards' in SCENARIOS[n]]
SHADOW = [n for n in SHADOW if not SCENARIOS[n].get('expect_error') and 'throw' not in n]


@pytest.mark.parametrize('name', SHADOW)
def test_shadow_is_exact_per_member(runs, name):
    cfg = SCENARIOS[name]
    per_rank = ok(runs, name)
    lead = members(cfg, per_rank)
    every_sample_once(cfg, lead)
    weights_match(
        name, per_rank, reference.train(cfg, divide=cfg['join'].get('divide_by_initial_world_size', True))['params']
    )
    steps = max(-(-n // cfg['batch_size']) for n in cfg['shards'])
    for res in per_rank:  # the report: one entry per member, each sample counted once
        report = res['reports'][0]
        assert report['real_samples'] == cfg['shards'] and report['world_size'] == len(cfg['shards'])
        assert report['tensor_parallel'] == cfg.get('tp', 1)
        assert report['shadow_steps'] == [steps - -(-n // cfg['batch_size']) for n in cfg['shards']]
    for res in per_rank:  # every step in three microbatches on every rank: partial and shadow batches padded
        assert all(len(mbs) == 3 for mbs in res['microbatch_sizes']), (name, res['microbatch_sizes'])


@pytest.mark.parametrize('name', [n for n in SCENARIOS if SCENARIOS[n]['join'].get('mode') == 'rebalance'])
def test_rebalancing_moves_batches_between_members_never_splitting_one(runs, name):
    cfg = SCENARIOS[name]
    per_rank = ok(runs, name)
    lead = members(cfg, per_rank)  # every rank of a receiving member trained the same received batch
    counts = [-(-n // cfg['batch_size']) for n in cfg['shards']]
    seen = observed(cfg, lead)
    if 'unsized' in cfg:  # read-ahead: the rule's assignment over members
        assert seen == [simulate(counts)] * cfg['epochs']
        ref = replay(cfg, seen)
    else:
        for steps in seen:
            assert [sorted(c for c in row if c is not None) for row in steps] == [
                sorted(s) for s in test_rebalance.expected_steps(counts)
            ]
        ref = test_rebalance.reference_train(cfg)
    every_sample_once(cfg, lead)
    weights_match(name, per_rank, ref)
    moved = [c for steps in seen for row in steps for m, c in enumerate(row) if c is not None and c[0] != m]
    assert moved, f'{name}: no batch moved between members'


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda tp: st.tuples(st.just(tp), st.lists(st.integers(0, 9), min_size=1, max_size=4), st.randoms())
    )
)
def test_no_schedule_splits_a_tensor_parallel_group(case):
    """Planned and read-ahead rebalancing over any layout: a member's ranks train the same batch (the same owner
    member, the same index) at every step, each received from the rank in its own TP position."""
    tp, member_counts, rnd = case
    ranks = list(range(len(member_counts) * tp))
    rnd.shuffle(ranks)  # TP groups need not be consecutive ranks: the layout names them
    layout = Layout(tuple(tuple(ranks[m * tp : (m + 1) * tp]) for m in range(len(member_counts))))
    counts = [member_counts[layout.member(r)] for r in range(layout.world_size)]
    rows = [(min(counts[r], 2), counts[r] <= 2) for r in range(layout.world_size)]  # a read-ahead row per rank
    for row, cells in [(row, row) for row in schedule(counts, layout)] + [(None, assign(rows, True, layout))]:
        if cells is None:
            continue
        for group in layout.groups:
            got = [cells[r] for r in group]
            owners = [None if c is None else (c[0] if isinstance(c, tuple) else c) for c in got]
            if owners[0] is None:
                assert all(o is None for o in owners), (layout, got)
                continue
            assert len({layout.member(o) for o in owners}) == 1, (layout, got)  # one giving member
            assert all(layout.counterpart(layout.member(o), r) == o for o, r in zip(owners, group)), (layout, got)
            if isinstance(got[0], tuple):
                assert len({c[1] for c in got}) == 1, (layout, got)  # the same batch of it
    assert sorted(c for row in schedule(counts, layout) for c in layout.leaders(row) if c is not None) == sorted(
        (layout.groups[m][0], i) for m, n in enumerate(member_counts) for i in range(n)
    )


def test_exact_sampler_shards_over_members(runs):
    cfg = SCENARIOS['tp_exact_sampler']
    lead = members(cfg, ok(runs, 'tp_exact_sampler'))  # both ranks of a TP group read the same shard
    for epoch in range(cfg['epochs']):
        ids = [[i for s in res['steps'] if s['epoch'] == epoch for i in s['ids']] for res in lead]
        assert sorted(ids[0] + ids[1]) == list(range(cfg['map_size'])) and [len(i) for i in ids] == [19, 18]


@pytest.mark.parametrize(
    ('name', 'expected'),
    [
        (
            'tp_torch_sampler',
            r'hold different train batches at step 0 of epoch 0 \(rank 0: a batch of 8 samples .*'
            r'contents CRC [0-9a-f]{8}; rank 1: a batch of 8 samples .*contents CRC [0-9a-f]{8}\)',
        ),
        ('tp_lengths_differ', r'have train dataloaders of different lengths \(rank 0: 3 batches; rank 1: 2 batches\)'),
    ],
)
def test_a_tensor_parallel_group_given_different_batches_stops_every_rank(runs, name, expected):
    for rank, res in enumerate(ok(runs, name)):
        error = res['error']
        assert error is not None and 'the ranks of tensor-parallel group 0 (ranks [0, 1])' in error, (rank, error)
        assert re.search(expected, error), (rank, error)
        assert 'ExactDistributedSampler' in error and 'num_replicas=<data-parallel size>' in error
        assert res['timestamp']['batch'] == 0


def test_throw_on_early_termination_names_the_member(runs):
    for res in ok(runs, 'tp_throw'):
        assert 'data-parallel rank 1 (tensor-parallel group of ranks [2, 3]): 2' in res['error'], res['error']


@pytest.mark.parametrize('name', list(CHECKPOINTS))
def test_mid_join_checkpoint_resumes_to_the_same_weights(runs, name):
    cfg = CHECKPOINTS[name]
    saved, resumed = ok(runs, f'{name}_save'), ok(runs, f'{name}_resume')
    weights_match(f'{name}_save', saved, reference.train(cfg)['params'])
    lead = members(cfg, saved)
    assert lead[-1]['steps'][2]['ids'] is None  # the short member shadowed step 3, saved after it
    for rank, res in enumerate(resumed):
        assert res['start_batch'] == 3
        diff = reference.max_abs_diff(res['params'], saved[rank]['params'])
        assert diff < TOL, f'{name}: resumed rank {rank} is {diff:.2e} from the uninterrupted run'


def test_stock_tp_resume_loses_optimizer_state(runs):
    """Why the TP checkpoint test uses plain SGD: stock Composer, even data, momentum 0.9."""
    saved, resumed = ok(runs, 'stock_tp_resume_save'), ok(runs, 'stock_tp_resume_resume')
    assert reference.max_abs_diff(saved[0]['params'], reference.train(STOCK_TP_RESUME)['params']) < TOL
    assert reference.max_abs_diff(resumed[0]['params'], saved[0]['params']) > 1e-2


def stock_outcome(runs: dict, name: str) -> str:
    """What stock Composer trained of the data, from the ids its members trained."""
    cfg = STOCK[name]
    lead = members(cfg, ok(runs, name))
    trained = sum(len(s['ids']) for res in lead for s in res['steps'] if s['ids'])
    return f'trains {trained} of {sum(cfg["shards"])}, no error'


def test_docs_stock_column_is_the_measured_one(runs):
    page = (ROOT / 'docs' / 'parallel-layouts.md').read_text()
    for name in STOCK:
        row = next((line for line in page.splitlines() if line.startswith(f'| `{name}`')), None)
        assert row is not None, f'docs/parallel-layouts.md has no row for {name}'
        assert stock_outcome(runs, name) in row, (name, stock_outcome(runs, name), row)


def test_stock_hangs_with_microbatching():
    """Stock Composer, microbatches of 3: a step where one member's batch splits into fewer microbatches than
    another's hangs in FSDP's collectives (cut short by a 10 s collective timeout, in a launch of its own, since a
    timed-out process group is unusable). The same data with UnevenJoin: ``hsdp1_shadow``, ``tp_shadow``."""
    cases = {
        'hsdp1': dict(MB, parallel='hsdp1', shards=[24, 21, 9, 9], join=None),
        'tp': dict(MB, parallel='tp', tp=2, shards=[24, 9], join=None),
    }
    calls = [(n, 'scenarios_layouts:train_until_timeout', {'cfg': c}) for n, c in cases.items()]
    results = launch(4, calls[:1], timeout=180, collective_timeout=10)
    results.update(launch(4, calls[1:], timeout=180, collective_timeout=10))
    for name, per_rank in results.items():
        assert all(isinstance(r, dict) and r['timed_out'] for r in per_rank), (name, per_rank)
        assert all(r['steps_completed'] == 1 for r in per_rank), (name, per_rank)  # step 1 (the second) hangs


@pytest.mark.parametrize(('batch', 'epoch_done', 'refused'), [(3, False, True), (0, False, False), (3, True, False)])
def test_a_tensor_parallel_checkpoint_resumes_mid_epoch_only_on_its_layout(batch, epoch_done, refused):
    """A checkpoint of 4 ranks in TP groups of 2, resumed here (one process, no TP): refused mid-epoch with the
    layouts named; an epoch boundary (batch 0, or the epoch's last batch) resumes as on another world size."""
    from types import SimpleNamespace

    from composer.core import Time, Timestamp

    from composer_join.core.errors import UnevenInputsError
    from composer_join.data.resume import Resumed, check_world_size

    saved = Resumed([], None, {}, None, 4, epoch_done, groups=((0, 1), (2, 3)))
    state = SimpleNamespace(timestamp=Timestamp(epoch=Time(1, 'ep'), batch_in_epoch=Time(batch, 'ba')))
    if not refused:
        assert check_world_size(saved, state, elastic=True, layout=Layout.flat(1)) is True
        return
    with pytest.raises(UnevenInputsError) as error:
        check_world_size(saved, state, elastic=True, layout=Layout.flat(1))
    message = str(error.value)
    assert 'saved by 4 ranks in 2 tensor-parallel groups of 2 in the middle of epoch 1 (after batch 3' in message
    assert 'this run has 1 ranks' in message
    assert 'a layout with tensor-parallel groups resumes mid-epoch only on the same layout' in message
