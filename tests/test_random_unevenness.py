"""Random uneven runs (hypothesis) against the single-process reference.

Each example draws a world size's worth of training configs: per-rank shard sizes from 0 to a few
batches (empty and one-sample shards drawn often), batch and microbatch sizes, the DDP sync
strategy, sized or unsized shards, 1 or 2 epochs, SGD with momentum or Adam, and both
``divide_by_initial_world_size`` values, DDP (half the draws), FSDP1 or FSDP2, and ``mode='rebalance'`` in a
third of the draws with ``len()``: with every rank's ``len()`` (against ``test_rebalance.reference_train``, written
from the README's rule), or with some ranks' shards unsized (against ``test_rebalance_unsized``'s replay of the
read-ahead rule; no evaluation there). In half of the others also per-rank eval shards (empty and
one-sample ones drawn often), an eval batch and microbatch size: every rank's last evaluation (after
``fit()``) must equal the accuracy and mean loss of its final weights on all ranks' eval samples at once,
computed here (``reference.evaluate``). Starting ranks is expensive, so one example is one
launch that trains all its configs in one process group; the reference is computed here, in the
test process (``tests/reference.py``), and every rank's weights must match it within 1e-5.

Profiles: the default (the suite's) runs one example of ``CI_CONFIGS`` configs per world size 2,
3 and 4; ``make fuzz`` (``COMPOSER_JOIN_FUZZ=1``) runs ``FUZZ_EXAMPLES`` examples of
``FUZZ_CONFIGS`` configs per world size (hundreds of draws). Shrinking is off (each try is a
launch); a failure names the config that failed, which reruns as a plain scenario.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import reference
import test_rebalance
import test_rebalance_unsized
from harness import RankError, launch

TOL = 1e-5
CI_CONFIGS, FUZZ_CONFIGS, FUZZ_EXAMPLES = 6, 25, 10
FUZZ = os.environ.get('COMPOSER_JOIN_FUZZ') == '1'
CONFIGS = FUZZ_CONFIGS if FUZZ else CI_CONFIGS

settings.register_profile(
    'composer_join_ci',
    max_examples=1,
    deadline=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
    database=None,
)
settings.register_profile(
    'composer_join_fuzz', parent=settings.get_profile('composer_join_ci'), max_examples=FUZZ_EXAMPLES
)
PROFILE = settings.get_profile('composer_join_fuzz' if FUZZ else 'composer_join_ci')

pytestmark = pytest.mark.timeout(3600 if FUZZ else 600)

SYNCS = ['single_auto_sync', 'multi_auto_sync', 'forced_sync']
WRAPPERS = ['ddp', 'ddp', 'fsdp1', 'fsdp2']  # DDP half the time (FSDP has no sync strategies to draw)
# the rank side of each wrapper: tests/rank_scenarios.py (DDP, every sync strategy), tests/scenarios_fsdp.py
RANK_SIDE = {'ddp': 'train', 'fsdp1': 'scenarios_fsdp:train', 'fsdp2': 'scenarios_fsdp:train'}


def rank_side(cfg: dict) -> str:
    """The rank-side function for ``cfg``: by wrapper; DDP rebalancing without ``len()`` in tests/scenarios_readahead.py."""
    return 'scenarios_readahead:fit' if cfg.get('unsized') and cfg['wrapper'] == 'ddp' else RANK_SIDE[cfg['wrapper']]


@st.composite
def configs(draw, world: int) -> dict:
    batch = draw(st.integers(1, 5))
    size = st.one_of(st.just(0), st.just(1), st.integers(0, 3 * batch + 1))
    shards = draw(st.lists(size, min_size=world, max_size=world).filter(lambda s: sum(s) > 0))
    microbatch = draw(st.one_of(st.none(), st.integers(1, batch)))
    cfg = dict(
        shards=shards,
        batch_size=batch,
        microbatch=microbatch,
        sync=draw(st.sampled_from(SYNCS)),
        dataset=draw(st.sampled_from(['iterable', 'iterable_nolen'])),
        epochs=draw(st.integers(1, 2)),
        optimizer=draw(st.sampled_from(['sgd', 'adam'])),
        join={'divide_by_initial_world_size': draw(st.booleans())},
        wrapper=draw(st.sampled_from(WRAPPERS)),
    )
    if cfg['dataset'] == 'iterable' and draw(st.integers(0, 2)) == 0:  # a third of the sized draws rebalance
        cfg['join']['mode'] = 'rebalance'
        unsized = draw(st.lists(st.integers(0, world - 1), max_size=world, unique=True))
        if unsized:  # these ranks' shards have no len(): the read-ahead rule (docs/rebalancing-without-len.md)
            cfg.update(unsized=sorted(unsized), ids=True, max_duration=f'{sum(shards) * cfg["epochs"]}sp')
            return cfg  # its rank side (tests/scenarios_readahead.py) has no evaluator
    if cfg['dataset'] == 'iterable_nolen':  # Composer needs a duration in batches without len(): cut anywhere
        steps = draw(st.integers(1, 2 * max(-(-n // batch) for n in shards)))
        cfg.update(epochs=2, max_duration=f'{steps}ba', max_steps=steps)
    if draw(st.booleans()):  # per-rank eval shards, evaluated after each epoch and once more after fit()
        eval_batch = draw(st.integers(1, 5))
        eval_size = st.one_of(st.just(0), st.just(1), st.integers(0, 3 * eval_batch + 1))
        cfg.update(
            eval_shards=draw(st.lists(eval_size, min_size=world, max_size=world).filter(lambda s: sum(s) > 0)),
            eval_batch_size=eval_batch,
            eval_microbatch=draw(st.one_of(st.none(), st.integers(1, eval_batch))),
            eval_after=True,
        )
    return cfg


def real_samples(cfg: dict) -> tuple[int, int]:
    """(steps, real samples) the run trains: in shadow mode every epoch as long as the longest shard, cut at
    ``max_steps``; rebalancing, every epoch's steps as the README's rule forms them (tests/test_rebalance.py)."""
    b = cfg['batch_size']
    if cfg.get('unsized'):
        steps = len(test_rebalance_unsized.simulate(test_rebalance_unsized.counts_of(cfg)))
        return steps * cfg['epochs'], sum(cfg['shards']) * cfg['epochs']
    if cfg['join'].get('mode') == 'rebalance':
        counts = [-(-n // b) for n in cfg['shards']]
        return len(test_rebalance.expected_steps(counts)) * cfg['epochs'], sum(cfg['shards']) * cfg['epochs']
    per_step = [
        sum(max(0, min(b, n - t * b)) for n in cfg['shards']) for t in range(max(-(-n // b) for n in cfg['shards']))
    ]
    steps = (per_step * cfg['epochs'])[: cfg.get('max_steps')]
    return len(steps), sum(steps)


def reference_params(cfg: dict) -> dict:
    """The single-process reference's weights: ``reference.train`` (shadow), ``test_rebalance.reference_train``
    (rebalancing with every ``len()``), ``test_rebalance_unsized.replay`` of its rule's steps (without)."""
    if cfg.get('unsized'):
        steps = test_rebalance_unsized.simulate(test_rebalance_unsized.counts_of(cfg))
        return test_rebalance_unsized.replay(cfg, [steps] * cfg['epochs'])
    if cfg['join'].get('mode') == 'rebalance':
        return test_rebalance.reference_train(cfg)
    return reference.train(cfg, divide=cfg['join']['divide_by_initial_world_size'])['params']


def check(world: int, cfgs: list[dict]) -> None:
    calls = [(f'draw{i}', rank_side(cfg), {'cfg': cfg}) for i, cfg in enumerate(cfgs)]
    results = launch(world, calls, timeout=120 + 15 * len(cfgs))
    for i, cfg in enumerate(cfgs):
        ref = reference_params(cfg)
        steps, samples = real_samples(cfg)
        for rank, res in enumerate(results[f'draw{i}']):
            assert not isinstance(res, RankError), f'config {cfg}: rank {rank} raised {res}'
            diff = reference.max_abs_diff(res['params'], ref)
            assert diff < TOL, f'config {cfg}: rank {rank} is {diff:.2e} from the reference'
            assert res['timestamp']['sample'] == samples, f'config {cfg}: rank {rank}'
            assert res['timestamp']['batch'] == steps, f'config {cfg}: rank {rank}'
        if cfg.get('eval_shards') is not None:  # every eval sample of every rank counted once, on every rank
            reference.assert_evaluation_like_reference(results[f'draw{i}'], cfg)


@pytest.mark.parametrize('world', [2, 3, 4])
def test_random_uneven_runs_match_the_reference(world):
    @PROFILE
    @given(st.lists(configs(world), min_size=CONFIGS, max_size=CONFIGS))
    def run(cfgs):
        check(world, cfgs)

    run()
