"""Elastic resumption (issue 35): a checkpoint saved mid-epoch resumes on any number of ranks.

Each case saves 2 epochs on ``old`` ranks with a checkpoint after every batch, then resumes from some of them on
``new`` ranks, to the same 2 epochs: mid-epoch before the short rank ran out, after it (its own data ended, the
long rank still has a batch), and from the checkpoint of the epoch's last batch. Shadow and rebalance, shuffled
and not, ``ExactDistributedSampler`` and torch's ``DistributedSampler`` (also a batch-yielding subclass given as
``batch_sampler=``), DataLoader workers, a local mosaicml-streaming ``StreamingDataset`` (resumed by Composer); 2 -> 3, 3 -> 2, 2 -> 1, 1 -> 2, 4 -> 2, a resumed run fitted one batch per ``fit()`` (``pieces``), and a chain: resumed again, on 2
ranks, from a checkpoint taken inside an epoch already resumed on 3. For every resume, against references computed
here (the samplers' shards from their definitions):

* every id of the interrupted epoch trained exactly as often as the old shards hold it, across the two runs;
* the next epoch trains the new world size's shards (each rank its own, in the sampler's order; rebalancing: the
  same ids in all);
* the replicas are identical and equal a single-process replay of the steps both runs recorded (each step's mean
  loss over its real samples, times its ``A_t / W_t``), within 1e-5.

Stock Composer runs the same saves and resumes (the docs' stock column, docs/reliability.md). One launch per world
size and role, in the order the chain needs.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from harness import launch
from pipeline_data import replay
from reference import max_abs_diff
from test_join_core import ok

TOL, SEED = 1e-5, 3
CASES: dict[str, dict[str, Any]] = {
    # 13 ids on 2 ranks: 7/6, batches of 3: 3/2 batches; batch 1 before, 2 after the short rank ran out, 3 the last
    '2to3_exact_shadow': dict(old=2, new=3, sampler='exact', size=13, batch_size=3, resume_at=[1, 2, 3]),
    # 19 ids on 3 ranks: 7/6/6, 3/2/2 batches, not shuffled, rebalancing
    '3to2_exact_plain_rebalance': dict(
        old=3, new=2, sampler='exact', shuffle=False, size=19, batch_size=3, mode='rebalance', resume_at=[1, 2]
    ),
    # torch's DistributedSampler pads 13 ids to 7/7; 2 workers
    '2to1_torch_workers': dict(old=2, new=1, sampler='torch', size=13, batch_size=3, workers=True, resume_at=[1, 2]),
    '1to2_exact': dict(old=1, new=2, sampler='exact', size=13, batch_size=3, resume_at=[2]),
    # 9 ids on 4 ranks: 3/2/2/2, batches of 2: 2/1/1/1; batch 1: three ranks have run out
    '4to2_exact_rebalance': dict(old=4, new=2, sampler='exact', size=9, batch_size=2, mode='rebalance', resume_at=[1]),
    '2to3_batched_torch': dict(old=2, new=3, sampler='torch', batched=True, size=12, batch_size=3, resume_at=[2]),
    # 31 ids on 2 ranks, resumed at batch 1 on 3 (25 left: 3 steps), its checkpoints kept for the chain
    '2to3_long': dict(old=2, new=3, sampler='exact', size=31, batch_size=3, resume_at=[1]),
    # the same resumed by fit(duration='1ba') after fit(): each next fit takes up the rest of the epoch (3 -> 2: one
    # rank's rest is one batch shorter)
    '2to3_pieces': dict(old=2, new=3, sampler='exact', size=31, batch_size=3, resume_at=[1], pieces=True),
    '3to2_pieces_rebalance': dict(
        old=3, new=2, sampler='exact', size=19, batch_size=2, mode='rebalance', resume_at=[2], pieces=True
    ),
    # train_subset_num_batches=2 (of 6/5 batches on 2 ranks, 4/4/4 on 3): the rest of epoch 0 trains in full (25
    # ids: 3 steps on 3 ranks), epoch 1 the first 2 batches of each new shard
    '2to3_subset': dict(old=2, new=3, sampler='exact', size=31, batch_size=3, subset=2, resume_at=[1]),
    # mosaicml-streaming: Composer and the dataset resume its global sample space; UnevenJoin lets them
    '2to1_streaming': dict(old=2, new=1, sampler='streaming', size=16, batch_size=4, resume_at=[1]),
}
# cannot be resumed on another world size mid-epoch: every rank stops at FIT_START naming both world sizes
REFUSED: dict[str, dict[str, Any]] = {
    # a batch-yielding DistributedSampler that drops its last partial batch: not its base class's order
    '2to3_batched_drop_tail': dict(
        old=2, new=3, sampler='torch', batched='drop_tail', size=14, batch_size=3, resume_at=[1], expect_error=True
    ),
    '2to1_batched_drop_tail': dict(
        old=2, new=1, sampler='torch', batched='drop_tail', size=14, batch_size=3, resume_at=[1], expect_error=True
    ),
}
# resumed again on 2 ranks from the 2 -> 3 run resumed at batch 1, at its batch 2 (inside the resumed epoch)
CHAIN = dict(CASES['2to3_long'], old=3, new=2, after=('2to3_long', 1), resume_at=[2])
STOCK = ['2to3_exact_shadow', '3to2_exact_plain_rebalance', '2to1_torch_workers', '1to2_exact', '4to2_exact_rebalance']


def _folder(root, name: str, stock: bool = False) -> str:
    return str(root / (('stock-' if stock else '') + name))


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp('elastic')
    out: dict = {}
    for cfg in (*CASES.values(), *REFUSED.values()):
        if cfg['sampler'] == 'streaming':
            cfg['data'] = str(root / 'mds')
    for world in (1, 2, 3, 4):  # the saves
        calls = [
            (f'save:{name}', 'scenarios_elastic:save', dict(cfg=cfg, folder=_folder(root, name)))
            for name, cfg in {**CASES, **REFUSED}.items()
            if cfg['old'] == world
        ]
        calls += [
            (
                f'stock_save:{name}',
                'scenarios_elastic:save',
                dict(cfg=CASES[name], folder=_folder(root, name, True), join=False),
            )
            for name in STOCK
            if CASES[name]['old'] == world
        ]
        out.update(launch(world, calls, timeout=300))
    for world in (3, 2, 1):  # the resumes (3 first: the chain resumes one of its runs on 2)
        calls = []
        for name, cfg in {**CASES, **REFUSED, 'chain': CHAIN}.items():
            if cfg['new'] != world:
                continue
            for b in cfg['resume_at']:
                if name == 'chain':
                    source, at = cfg['after']
                    folder = _folder(root, f'{source}-resumed@{at}')
                else:
                    folder = _folder(root, name)
                kwargs = dict(cfg=cfg, folder=folder, batch=b)
                if name == '2to3_long':  # the chain resumes from its checkpoints
                    kwargs['save_folder'] = _folder(root, f'{name}-resumed@{b}')
                calls.append((f'resume:{name}@{b}', 'scenarios_elastic:resume', kwargs))
        for name in STOCK:
            cfg = CASES[name]
            if cfg['new'] == world:
                for b in cfg['resume_at']:
                    kwargs = dict(cfg=cfg, folder=_folder(root, name, True), batch=b, join=False)
                    calls.append((f'stock_resume:{name}@{b}', 'scenarios_elastic:resume', kwargs))
        out.update(launch(world, calls, timeout=300))
    return out


def shard(cfg: dict, world: int, rank: int, epoch: int) -> list[int]:
    """Rank ``rank``'s ids of ``epoch``, from the samplers' definitions (streaming: rank 0 all of them)."""
    n = cfg['size']
    if cfg['sampler'] == 'streaming':
        return list(range(n)) if rank == 0 else []
    if cfg['sampler'] == 'torch':  # torch's own sampler, padding included
        sampler = DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=cfg.get('shuffle', True), seed=SEED
        )
        sampler.set_epoch(epoch)
        return list(sampler)
    if cfg.get('shuffle', True):  # ExactDistributedSampler: perm[rank::world], perm = randperm(seed + epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    else:
        perm = list(range(n))
    return perm[rank::world]


def merged(*runs: tuple[list[dict], int]) -> list[tuple[int, int, list[list[int]]]]:
    """Every step the runs trained, in order: ``(epoch, world, ids per rank)``; each run ``(per rank, first global
    batch)`` from its first batch on (a later run resumed there)."""
    steps: dict[int, tuple[int, int, list[list[int]]]] = {}
    for per_rank, first in runs:
        steps = {s: v for s, v in steps.items() if s < first}  # what a later run resumed from replaces
        for step in per_rank[0]['steps']:
            if step >= first:
                steps[step] = (per_rank[0]['steps'][step][0], len(per_rank), [r['steps'][step][2] for r in per_rank])
    return [steps[s] for s in sorted(steps)]


RESUMES = [(name, b) for name, cfg in CASES.items() for b in cfg['resume_at']]


@pytest.mark.parametrize(('name', 'batch'), RESUMES + [('chain', 2)])
def test_a_mid_epoch_checkpoint_resumes_on_another_world_size_exactly(runs, name, batch):
    cfg = CHAIN if name == 'chain' else CASES[name]
    resumed = ok(runs, f'resume:{name}@{batch}')
    if name == 'chain':  # the save, the first resumed run, then this one
        source, at = cfg['after']
        old_cfg = CASES[source]
        steps = merged((ok(runs, f'save:{source}'), 0), (ok(runs, f'resume:{source}@{at}'), at), (resumed, batch))
    else:
        old_cfg = cfg
        steps = merged((ok(runs, f'save:{name}'), 0), (resumed, batch))
    interrupted = Counter(i for epoch, _, parts in steps if epoch == 0 for part in parts for i in part)
    expected = Counter(i for r in range(old_cfg['old']) for i in shard(cfg, old_cfg['old'], r, 0))
    assert interrupted == expected, (
        f'{name}@{batch}: epoch 0 trained {interrupted - expected} too often, missed {expected - interrupted}'
    )
    new = cfg['new']
    later = [[i for epoch, _, parts in steps if epoch == 1 for i in parts[k]] for k in range(new)]
    if cfg.get('subset'):  # the rest of the epoch in full, with a warning; then the subset again
        assert all('train_subset_num_batches=2' in ' '.join(r['warnings']) for r in resumed), resumed[0]['warnings']
        taken = cfg['subset'] * cfg['batch_size']
        assert later == [shard(cfg, new, k, 1)[:taken] for k in range(new)], f'{name}@{batch}: epoch 1 not the subset'
    elif cfg.get('mode') == 'rebalance':
        assert Counter(i for part in later for i in part) == Counter(
            i for k in range(new) for i in shard(cfg, new, k, 1)
        )
    else:
        assert later == [shard(cfg, new, k, 1) for k in range(new)], f'{name}@{batch}: epoch 1 not the new shards'
    expected_params = replay([parts for _, _, parts in steps])
    for rank, res in enumerate(resumed):
        diff = max_abs_diff(res['params'], expected_params)
        assert diff < TOL, f'{name}@{batch}: rank {rank} is {diff:.2e} from the single-process replay'


@pytest.mark.parametrize('name', list(REFUSED))
def test_data_without_one_global_index_space_stops_every_rank_naming_both_world_sizes(runs, name):
    cfg = REFUSED[name]
    for b in cfg['resume_at']:
        for rank, res in enumerate(ok(runs, f'resume:{name}@{b}')):
            assert res['error'] is not None, f'{name}@{b}: rank {rank} trained on'
            kind, message = res['error']
            assert kind == 'UnevenInputsError', (rank, kind, message)
            assert f'saved by {cfg["old"]} ranks' in message and f'this run has {cfg["new"]} ranks' in message, message
            assert 'one global index space' in message and 'epoch boundary' in message, message
            assert res['steps'] == {}, f'{name}@{b}: rank {rank} trained before stopping'


def stock_outcome(runs: dict, name: str, batch: int) -> str:
    """Stock Composer on a case: the ids of the interrupted epoch trained across both runs (of all), or the error."""
    cfg = CASES[name]
    saved, resumed = ok(runs, f'stock_save:{name}'), ok(runs, f'stock_resume:{name}@{batch}')
    errors = sorted({f'{r["error"][0]}: {r["error"][1].splitlines()[0]}' for r in resumed if r['error']})
    if errors:
        return f'raises `{" / ".join(errors)}`'
    steps = merged((saved, 0), (resumed, batch))
    trained = [i for epoch, _, parts in steps if epoch == 0 for part in parts for i in part]
    expected = Counter(i for r in range(cfg['old']) for i in shard(cfg, cfg['old'], r, 0))
    counted = Counter(trained)
    twice = sum((counted - expected).values())
    never = sum((expected - counted).values())
    out = f'trains {len(trained)} of {sum(expected.values())}'
    details = [f'{twice} twice' for _ in [0] if twice] + [f'{never} never' for _ in [0] if never]
    return out + (f' ({", ".join(details)})' if details else '')


DOCS = Path(__file__).parent.parent / 'docs' / 'reliability.md'
STOCK_COLUMN = 'stock Composer (measured)'


def test_docs_stock_column_is_the_measured_one(runs):
    from test_pipelines import docs_column

    measured = {f'{name}@{b}': stock_outcome(runs, name, b) for name in STOCK for b in CASES[name]['resume_at']}
    documented = docs_column(DOCS.read_text(), STOCK_COLUMN)
    wrong = {k: (documented.get(k), v) for k, v in measured.items() if documented.get(k) != v}
    assert not wrong, 'docs/reliability.md disagrees (documented, measured):\n' + '\n'.join(
        f'{k}: {d!r} != {m!r}' for k, (d, m) in wrong.items()
    )
