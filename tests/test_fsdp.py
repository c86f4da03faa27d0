"""UnevenJoin under Composer's FSDP1 and FSDP2, microbatching included, on real ranks (gloo, CPU).

Every scenario trains through Composer's ``Trainer`` (tests/scenarios_fsdp.py, which also holds the
two CPU-only workarounds for FSDP on gloo) and is compared with the single-process reference
(tests/reference.py; tests/reference_fsdp.py for BatchNorm, whose buffers FSDP does not broadcast)
and with the same run under DDP. ``mode='rebalance'``, with and without ``len()``, is compared with the
references of tests/test_rebalance.py (the planned schedule) and tests/test_rebalance_unsized.py (the
read-ahead rule's replay). All scenarios of one world size share one process group; the
stock-Composer hang runs in its own short launch, with a short collective timeout, since a hang
breaks the process group it happens in.

Which rank runs short must not matter: under both wrappers, the empty shard of three ranks
(``{w}_empty_shard``, empty rank first and last), the uneven evaluation (``{w}_eval``, the short train and
eval shards on rank 0) and rebalancing onto an empty rank with and without ``len()`` (``{w}_rebalance_empty``,
``{w}_readahead_empty``: the receiver on rank 0, the donor last) run again with their ranks rotated
(tests/rank_orders.py), in the launch of their world size, and ``fsdp1_throw`` with rank 0 running out
(the error names it). ``{w}_batchnorm_rank0_short`` was already ``{w}_batchnorm``'s short rank first. The
others assert per-rank microbatch sizes or collective counts of one layout, or are the same path with
another optimizer (suite time).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from packaging.version import Version

import devices
import reference
import reference_fsdp
import test_rebalance
from harness import RankError, launch
from rank_orders import expand, with_rotations
from test_join_core import DIVIDE, NO_DIVIDE, ok
from test_rebalance_unsized import observed, replay, simulate

TOL = 1e-6  # against the reference and against DDP, for models without BatchNorm
BN_TOL = 1e-5  # BatchNorm on 2-3 sample microbatches amplifies rounding: the float32 reference is 1.9e-6 from float64's
ALL_WRAPPERS = ['fsdp1', 'fsdp2']
# Composer 0.32.1's FSDP2 on CPU needs torch 2.7: under torch 2.6 (make test-torch26) it fails in stock Composer
# too, so its scenarios are not launched there and their tests are skipped with this reason (never under 2.7).
FSDP2_RUNS = Version(torch.__version__.split('+')[0]) >= Version('2.7')
FSDP2_SKIP = pytest.mark.skipif(
    not FSDP2_RUNS,
    reason="torch < 2.7: Composer 0.32.1's FSDP2 on CPU fails in stock Composer too "
    "('Stream' object has no attribute 'record_event'); docs/compatibility.md",
)
WRAPPERS = [w for w in ALL_WRAPPERS if w != 'fsdp2' or FSDP2_RUNS]  # launched
BASE = dict(shards=[40, 21], batch_size=8, epochs=2)


def by_wrapper(value: str, wrapper: str):
    """``value`` as a test parameter, skipped (with the reason) where ``wrapper`` is FSDP2 and FSDP2 cannot run."""
    return pytest.param(value, marks=FSDP2_SKIP) if wrapper == 'fsdp2' else value


WRAPPER_PARAMS = [by_wrapper(w, w) for w in ALL_WRAPPERS]

SCENARIOS: dict[str, dict] = {
    'ddp_sgd': dict(BASE, wrapper='ddp', join=DIVIDE),
    'ddp_microbatch': dict(BASE, wrapper='ddp', microbatch=3, optimizer='adam', join=NO_DIVIDE),
}
for w in ALL_WRAPPERS:
    SCENARIOS.update(
        {
            f'{w}_sgd': dict(BASE, wrapper=w, join=DIVIDE),
            # 40 = 5 x 8 and 21 = 8 + 8 + 5: with microbatches of 3, steps split 3/3, 3/2 and 3/1 (shadow)
            f'{w}_microbatch': dict(BASE, wrapper=w, microbatch=3, optimizer='adam', join=NO_DIVIDE),
            # the configuration on which stock Composer hangs (test_stock_composer_fsdp_hangs_on_uneven_microbatch_counts)
            f'{w}_fixes_stock_hang': dict(
                shards=[24, 21], batch_size=8, epochs=1, microbatch=3, wrapper=w, join=DIVIDE
            ),
            f'{w}_batchnorm': dict(BASE, wrapper=w, model='bn', microbatch=3, join=DIVIDE),
            f'{w}_batchnorm_rank0_short': dict(
                shards=[13, 40], batch_size=8, epochs=1, wrapper=w, model='bn', join=DIVIDE
            ),
            f'{w}_throw': dict(
                BASE, wrapper=w, microbatch=3, join={'throw_on_early_termination': True}, expect_error=True
            ),
            f'{w}_eval': dict(
                shards=[24, 13],
                batch_size=8,
                epochs=1,
                microbatch=3,
                wrapper=w,
                join=DIVIDE,
                eval_shards=[20, 7],
                eval_batch_size=4,
                eval_microbatch=3,
            ),
            f'{w}_eval_only': dict(
                shards=[8, 8],
                batch_size=8,
                wrapper=w,
                join=DIVIDE,
                eval_only=True,
                eval_shards=[20, 7],
                eval_batch_size=4,
                eval_microbatch=3,
            ),
            f'{w}_branch': dict(BASE, wrapper=w, model='branch', microbatch=3, join=DIVIDE, expect_error=w == 'fsdp2'),
        }
    )
    # the unit check's sum as from PAIRWISE_FROM ranks on (recursive doubling over isend/irecv), on 2 ranks
    SCENARIOS[f'{w}_branch_pairwise'] = dict(SCENARIOS[f'{w}_branch'], pairwise=True)
THREE: dict[str, dict] = {}
for w in ALL_WRAPPERS:
    THREE.update(
        {
            f'{w}_empty_shard': dict(shards=[20, 0, 13], batch_size=4, epochs=2, microbatch=3, wrapper=w, join=DIVIDE),
            f'{w}_three_ranks': dict(
                shards=[40, 21, 13], batch_size=8, epochs=2, microbatch=3, wrapper=w, optimizer='adam', join=NO_DIVIDE
            ),
        }
    )
    # 3 ranks: the pairwise sum's fold (rank 0 gives its flags to rank 1 and gets the sum back)
    THREE[f'{w}_three_ranks_pairwise'] = dict(THREE[f'{w}_three_ranks'], pairwise=True)

# mode='rebalance' under FSDP, with microbatches of 3: with every rank's len() (the planned schedule)
# and without (read-ahead). 43 = 5 x 8 + 3 and 21 = 2 x 8 + 5 samples: batches of 3, 2 and 1
# microbatches move between ranks, and the last step shadows; 37 and 0: rank 1 trains only received
# batches. Samples carry ids (tests/scenarios_readahead.py), so the test sees which batch each rank trains.
RB = {'mode': 'rebalance'}
REBALANCE: dict[str, dict] = {}
for w in ALL_WRAPPERS:
    common = dict(batch_size=8, microbatch=3, wrapper=w, ids=True, join=RB)
    REBALANCE.update(
        {
            f'{w}_rebalance': dict(common, shards=[43, 21], epochs=2, optimizer='adam', unsized=[]),
            f'{w}_rebalance_empty': dict(common, shards=[37, 0], epochs=1, unsized=[]),
            f'{w}_readahead': dict(common, shards=[43, 21], epochs=2, optimizer='adam', max_duration='128sp'),
            f'{w}_readahead_empty': dict(common, shards=[37, 0], epochs=1, unsized=[0], max_duration='37sp'),
            # three ranks, the middle one empty, batch 4: 5, 0 and 4 batches (the last of rank 2 has 1 sample)
            f'{w}_rebalance_three': dict(common, shards=[20, 0, 13], batch_size=4, epochs=1, unsized=[]),
            f'{w}_readahead_three': dict(
                common, shards=[20, 0, 13], batch_size=4, epochs=1, unsized=[0, 1], max_duration='33sp'
            ),
        }
    )

# the short, empty, receiving rank on the other side too (see the module docstring)
SCENARIOS = with_rotations(SCENARIOS, [f'{w}_eval' for w in ALL_WRAPPERS] + ['fsdp1_throw'])
THREE = with_rotations(THREE, [f'{w}_empty_shard' for w in ALL_WRAPPERS])
REBALANCE = with_rotations(
    REBALANCE, [f'{w}_{c}' for w in ALL_WRAPPERS for c in ('rebalance_empty', 'readahead_empty')]
)

# Collectives per step, 2 ranks, batch 8, microbatch 3 (3 microbatches on a full batch). Step 2 of
# 'uneven' has 8 and 4 samples (3 and 2 microbatches); step 2 of 'shadow' has a shadow rank.
COUNTED: dict[str, dict] = {}
for w in ALL_WRAPPERS:
    common = dict(batch_size=8, epochs=1, microbatch=3, wrapper=w, count_collectives=True)
    COUNTED[f'{w}_count_stock'] = dict(common, shards=[16, 16], join=None)
    COUNTED[f'{w}_count_uneven'] = dict(common, shards=[24, 20], join=DIVIDE)
    COUNTED[f'{w}_count_shadow'] = dict(common, shards=[24, 16], join=DIVIDE)
    COUNTED[f'{w}_count_uneven_pairwise'] = dict(common, shards=[24, 20], join=DIVIDE, pairwise=True)

# A sharded checkpoint taken mid-join (after step 4 of epoch 0, when rank 1 has run out), resumed.
CHECKPOINT = dict(BASE, microbatch=3, join=DIVIDE, save_interval='4ba', state_dict_type='sharded')


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    folders = {w: str(tmp_path_factory.mktemp(f'ckpt_{w}')) for w in WRAPPERS}
    two = [
        (name, 'scenarios_fsdp:train', {'cfg': cfg})
        for name, cfg in {**SCENARIOS, **COUNTED, **REBALANCE}.items()
        if len(cfg['shards']) == 2 and cfg['wrapper'] in ('ddp', *WRAPPERS)
    ]
    for w in WRAPPERS:
        save = dict(CHECKPOINT, wrapper=w, save_folder=folders[w])
        two.append((f'{w}_ckpt_save', 'scenarios_fsdp:train', {'cfg': save}))
        two.append(
            (
                f'{w}_ckpt_resume',
                'scenarios_fsdp:train_resumed',
                {'cfg': dict(CHECKPOINT, wrapper=w), 'folder': folders[w], 'batch': 4},
            )
        )
    results = launch(2, two, timeout=480)
    results.update(
        launch(
            3,
            [
                (name, 'scenarios_fsdp:train', {'cfg': cfg})
                for name, cfg in {**THREE, **REBALANCE}.items()
                if len(cfg['shards']) == 3 and cfg['wrapper'] in WRAPPERS
            ],
            timeout=300,
        )
    )
    return results


def check_reference(name: str, cfg: dict, per_rank: list[dict], tol: float = TOL) -> None:
    divide = cfg['join'].get('divide_by_initial_world_size', True)
    ref = reference.train(cfg, divide=divide)
    for rank, res in enumerate(per_rank):
        diff = reference.max_abs_diff(res['params'], ref['params'])
        assert diff < tol, f'{name}: rank {rank} is {diff:.2e} from the reference'
        assert res['timestamp']['sample'] == sum(cfg['shards']) * cfg['epochs'], f'{name}: samples counted'
        assert res['timestamp']['batch'] == ref['steps_per_epoch'] * cfg['epochs']


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
def test_every_sample_trained_and_equal_to_reference_and_ddp(runs, w):
    for case in ('sgd', 'microbatch'):
        name = f'{w}_{case}'
        per_rank = ok(runs, name)
        check_reference(name, SCENARIOS[name], per_rank)
        ddp = ok(runs, f'ddp_{case}')[0]['params']
        assert reference.max_abs_diff(per_rank[0]['params'], ddp) < TOL, f'{name} differs from the same run under DDP'
        report = per_rank[1]['reports'][0]
        assert report['real_batches'] == [5, 3] and report['shadow_steps'] == [0, 2]


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
def test_uneven_microbatch_counts_are_padded_with_shadow_microbatches(runs, w):
    name = f'{w}_microbatch'
    rank0, rank1 = ok(runs, name)
    # what each forward saw: rank 1's partial batch (5 samples: 3 + 2) gets one two-sample shadow
    # microbatch; its shadow steps run three of them, as rank 0 runs three real ones
    assert rank0['microbatch_sizes'][:5] == [[3, 3, 2]] * 5
    assert rank1['microbatch_sizes'][:5] == [[3, 3, 2], [3, 3, 2], [3, 2, 2], [2, 2, 2], [2, 2, 2]]
    check_reference(f'{w}_fixes_stock_hang', SCENARIOS[f'{w}_fixes_stock_hang'], ok(runs, f'{w}_fixes_stock_hang'))


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
def test_three_ranks_and_an_empty_shard(runs, w):
    for name in expand([f'{w}_empty_shard', f'{w}_three_ranks'], THREE):
        check_reference(name, THREE[name], ok(runs, name))


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
@pytest.mark.parametrize('case', ['batchnorm', 'batchnorm_rank0_short'])
def test_batchnorm_buffers_see_only_real_forwards(runs, w, case):
    name = f'{w}_{case}'
    cfg = SCENARIOS[name]
    ref = reference_fsdp.train(cfg)
    for rank, res in enumerate(ok(runs, name)):
        assert reference.max_abs_diff(res['params'], ref['params']) < BN_TOL, f'{name}: rank {rank} parameters'
        # under FSDP every rank keeps its own buffers: updated by its own real microbatches only
        diff = reference.max_abs_diff(res['buffers'], ref['buffers'][rank])
        assert diff < BN_TOL, f'{name}: rank {rank} buffers are {diff:.2e} from its own real forwards'


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
def test_throw_on_early_termination_stops_every_rank(runs, w):
    for name in expand([f'{w}_throw'], SCENARIOS):  # rank 1 runs out, or rank 0 when rotated
        short = SCENARIOS[name]['shards'].index(21)
        for res in ok(runs, name):
            assert f'rank(s) [{short}] ran out of data at step 3 of epoch 0' in res['error'], name


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
@pytest.mark.parametrize('case', ['eval', 'eval_only'])
def test_uneven_evaluation_is_exact(runs, w, case):
    # eval shards of 20 and 7 samples, batch 4, eval microbatch 3: a full batch is 2 microbatches, a
    # partial one (3 samples) 1, a shadow one 1 (padded to 2); after training, or in trainer.eval() alone
    for name in expand([f'{w}_{case}'], SCENARIOS):
        reference.assert_evaluation_like_reference(ok(runs, name), SCENARIOS[name])
        for rank, res in enumerate(ok(runs, name)):
            # a callback that skips is_shadow_step counts this rank's own eval samples only: not the template
            # samples of a microbatch that pads a real batch (a partial batch of 3: one microbatch, padded to 2)
            shard = SCENARIOS[name]['eval_shards'][rank]
            assert res['eval_samples'] and set(res['eval_samples']) == {shard}, (name, rank, res['eval_samples'])
            batches = -(-shard // 4)  # the batches of this rank's shard end real; the others shadow
            ends = res['eval_shadow_at_batch_end'][: -(-max(SCENARIOS[name]['eval_shards']) // 4)]
            assert ends == [False] * batches + [True] * (len(ends) - batches), (name, rank, ends)


def test_branch_unused_by_some_rank(runs):
    # FSDP1 reduce-scatters whole flat parameters (zeros where unused), so the branch trains as under DDP
    check_reference('fsdp1_branch', SCENARIOS['fsdp1_branch'], ok(runs, 'fsdp1_branch'))


@FSDP2_SKIP
def test_branch_unused_by_some_rank_is_refused_under_fsdp2(runs):
    # FSDP2 reduce-scatters only parameters with a gradient: ranks would disagree; every rank says so at once
    for res in ok(runs, 'fsdp2_branch'):
        assert res['error'].startswith("at step 0, ranks' microbatches give gradients to different parameters")
        assert 'module.extra.weight (used on 1 of 2 ranks)' in res['error']
        assert res['timestamp']['batch'] == 0


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
def test_sharded_checkpoint_taken_mid_join_resumes_to_the_same_weights(runs, w):
    saved, resumed = ok(runs, f'{w}_ckpt_save'), ok(runs, f'{w}_ckpt_resume')
    cfg = dict(CHECKPOINT, wrapper=w)
    check_reference(f'{w}_ckpt_save', cfg, saved)
    assert saved[1]['shadow'][3] and not saved[0]['shadow'][3]  # step 4 (saved after it) was a shadow step for rank 1
    for rank, res in enumerate(resumed):
        assert res['resumed_from'] == 4
        diff = reference.max_abs_diff(res['params'], saved[rank]['params'])
        assert diff < TOL, f'{w}: resumed rank {rank} is {diff:.2e} from the uninterrupted run'
        assert res['timestamp']['batch'] == 10


def counts(runs, name: str, step: int) -> dict[str, int]:
    per_rank = ok(runs, name)
    assert all(res['collectives'][step] == per_rank[0]['collectives'][step] for res in per_rank), (
        f'{name}: ranks issued different collectives at step {step}: {[r["collectives"][step] for r in per_rank]}'
    )
    return per_rank[0]['collectives'][step]


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
def test_collectives_per_step(runs, w):
    stock = counts(runs, f'{w}_count_stock', 1)
    microbatches = 3
    # one FSDP unit (the root, not resharded after forward): one all-gather and one reduce-scatter per
    # microbatch; FSDP1 on gloo all-gathers with all_gather (gloo has no all_gather_into_tensor), on NCCL with
    # all_gather_into_tensor
    gather = 'all_gather' if w == 'fsdp1' and devices.backend() == 'gloo' else 'all_gather_into_tensor'
    assert stock[gather] == stock['reduce_scatter_tensor'] == microbatches, stock
    for name in (f'{w}_count_uneven', f'{w}_count_shadow'):
        steps = [counts(runs, name, t) for t in range(3)]  # step 2: microbatch counts 3 and 2, or 3 and 1 (shadow)
        for c in steps:  # padded to three microbatches: FSDP's collectives are those of an even step
            assert {k: v for k, v in c.items() if k != 'all_reduce'} == {
                k: v for k, v in stock.items() if k != 'all_reduce'
            }, (name, steps)
        # UnevenJoin adds one small all-reduce per step (the agreement on who has data, started a step
        # ahead; or, on steps planned from the lengths alone, the agreement on microbatch counts) and
        # one per microbatch (the check that every rank's microbatch uses the same parameters)
        assert sum(c['all_reduce'] for c in steps) == len(steps) * (stock['all_reduce'] + 1 + microbatches), steps


@pytest.mark.parametrize('w', WRAPPER_PARAMS)
def test_the_unit_check_summed_pairwise_is_the_same_check(runs, w):
    """From ``PAIRWISE_FROM`` ranks on, the check's sum is recursive doubling over ``isend``/``irecv`` (log2 W rounds,
    not gloo's ring): forced here on 2 and 3 ranks, the same training, the same refusal, and no all-reduce per
    microbatch any more (gloo's point-to-point messages, which ``CollectiveCounter`` does not count)."""
    if w == 'fsdp1':
        check_reference('fsdp1_branch_pairwise', SCENARIOS['fsdp1_branch_pairwise'], ok(runs, 'fsdp1_branch_pairwise'))
    else:
        for res in ok(runs, 'fsdp2_branch_pairwise'):
            assert res['error'].startswith("at step 0, ranks' microbatches give gradients to different parameters")
            assert 'module.extra.weight (used on 1 of 2 ranks)' in res['error']
    check_reference(
        f'{w}_three_ranks_pairwise', THREE[f'{w}_three_ranks_pairwise'], ok(runs, f'{w}_three_ranks_pairwise')
    )
    stock = counts(runs, f'{w}_count_stock', 1)
    steps = [counts(runs, f'{w}_count_uneven_pairwise', t) for t in range(3)]
    for c in steps:
        assert {k: v for k, v in c.items() if k != 'all_reduce'} == {
            k: v for k, v in stock.items() if k != 'all_reduce'
        }
    assert sum(c['all_reduce'] for c in steps) == len(steps) * (stock['all_reduce'] + 1), steps


def test_host_sum_is_exact_both_ways_on_six_ranks():
    """``TorchExchange.host_sum`` on 6 ranks (4 double, ranks 0 and 2 fold into 1 and 3): gloo's all-reduce and the
    pairwise sum give every rank the exact sum of every rank's integers, in their dtype."""
    per_rank = launch(6, [('sums', 'scenarios_fsdp:host_sums', {})], timeout=120)['sums']
    assert not [r for r in per_rank if isinstance(r, RankError)], per_rank
    assert all(all(r['exact']) for r in per_rank), [r['exact'] for r in per_rank]
    assert all(r['sums'] == per_rank[0]['sums'] for r in per_rank)


def test_stock_composer_fsdp_hangs_on_uneven_microbatch_counts():
    """Stock Composer, FSDP1 and FSDP2, shards of 24 and 21 samples, batch 8, microbatch 3.

    Step 3 splits into 3 microbatches on rank 0 and 2 on rank 1: rank 0 all-gathers for its third
    microbatch while rank 1 has moved on. The hang is cut short by a 10 s collective timeout (its
    own launch, since a timed-out process group is unusable); the same runs with UnevenJoin are
    ``{w}_fixes_stock_hang`` above.
    """
    stock = {w: dict(SCENARIOS[f'{w}_fixes_stock_hang'], join=None) for w in WRAPPERS}
    if devices.backend() == 'nccl':  # NCCL's watchdog may abort a rank process on the timeout instead of raising
        if devices.too_few_gpus(2, 'this test') is not None:
            pytest.skip(devices.too_few_gpus(2, 'this test'))
        for w, cfg in stock.items():
            try:
                per_rank = launch(
                    2, [(w, 'scenarios_fsdp:train_until_timeout', {'cfg': cfg})], timeout=180, collective_timeout=10
                )[w]
            except AssertionError as e:  # a rank killed by the watchdog (or still hanging, killed by the harness)
                assert 'exited with' in str(e) or 'did not finish' in str(e), str(e)
                continue
            assert all(isinstance(res, dict) and res['timed_out'] and res['steps_completed'] == 2 for res in per_rank)
        return
    with ThreadPoolExecutor(len(WRAPPERS)) as pool:
        futures = {
            w: pool.submit(
                launch, 2, [(w, 'scenarios_fsdp:train_until_timeout', {'cfg': cfg})], timeout=120, collective_timeout=10
            )
            for w, cfg in stock.items()
        }
        results = {w: f.result()[w] for w, f in futures.items()}
    for w, per_rank in results.items():
        assert all(isinstance(res, dict) and res['timed_out'] for res in per_rank), f'{w}: {per_rank}'
        assert all(res['steps_completed'] == 2 for res in per_rank), f'{w}: {per_rank}'


@pytest.mark.parametrize(
    'name', [by_wrapper(n, REBALANCE[n]['wrapper']) for n in expand([n for n in REBALANCE if '@' not in n], REBALANCE)]
)
def test_rebalance_trains_every_batch_once_padded_and_equal_to_the_reference(runs, name):
    cfg = REBALANCE[name]
    per_rank = ok(runs, name)
    counts = [-(-n // cfg['batch_size']) for n in cfg['shards']]
    seen = observed(cfg, per_rank)  # per epoch, per step, per rank: (owner, index) of the batch trained
    assert len(seen) == cfg['epochs']
    if cfg.get('unsized', 'all') == []:  # every rank has a len(): the planned schedule (tests/test_rebalance.py)
        for steps in seen:
            assert [sorted(c for c in row if c is not None) for row in steps] == [
                sorted(s) for s in test_rebalance.expected_steps(counts)
            ]
        ref = test_rebalance.reference_train(cfg)
    else:  # read-ahead: the rule's assignment, replayed (tests/test_rebalance_unsized.py)
        assert seen == [simulate(counts)] * cfg['epochs']
        ref = replay(cfg, seen)
    for steps in seen:  # every batch once per epoch
        assert sorted(c for row in steps for c in row if c is not None) == [
            (r, i) for r, n in enumerate(counts) for i in range(n)
        ]
    for rank, res in enumerate(per_rank):
        diff = reference.max_abs_diff(res['params'], ref)
        assert diff < TOL, f'{name}: rank {rank} is {diff:.2e} from the reference'
        assert res['timestamp']['sample'] == sum(cfg['shards']) * cfg['epochs']
    # microbatches: each rank's real ones split its batch by 3, and every rank runs as many as the
    # rank with the most (the others padded with two-sample shadow microbatches)
    flat = [row for steps in seen for row in steps]
    for t, row in enumerate(flat):
        sizes = [res['microbatch_sizes'][t] for res in per_rank]
        assert len({len(m) for m in sizes}) == 1, f'{name}: step {t}: microbatches {sizes}'
        for r, cell in enumerate(row):
            if cell is None:
                continue
            n = len(per_rank[r]['steps'][t]['ids'])
            real = [3] * (n // 3) + ([n % 3] if n % 3 else [])
            assert sizes[r][: len(real)] == real and all(m == 2 for m in sizes[r][len(real) :]), (t, r, sizes)
