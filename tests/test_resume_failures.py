"""Resumption failures of issue 33: what UnevenJoin must do, each against a reference computed here.

1. A litdata 0.2.76 ``StreamingDataset`` (``drop_last=False``: litdata splits 17 ids over 2 ranks itself, 8 and 9)
   in litdata's ``StreamingDataLoader`` or a torch ``DataLoader``, in both modes: trains every id once per epoch,
   the replicas equal a single-process replay of the recorded steps, and a run resumed from a mid-epoch checkpoint
   (after the short rank ran out) trains the same ids at every later step and ends with the same weights.
2. A Hugging Face ``IterableDataset`` (``to_iterable_dataset`` + ``split_dataset_by_node``: 9 and 8 ids) read
   before ``fit()``, one example peeked or every row counted: resumed from the checkpoint of epoch 0's last batch,
   it trains what the uninterrupted run trains after that checkpoint, step by step (a hard bound stops a run whose
   duration is never reached).
3. Checkpoints of 2 ranks (17 and 10 ids per epoch, or ``ExactDistributedSampler``'s 14 and 13) resumed on 1: the
   mid-epoch one stops with ``UnevenInputsError`` naming both world sizes, before any step; the one of the epoch's
   last batch (saved before ``EPOCH_END``) is an epoch boundary: the next epoch is the 1-rank shard, every id once,
   and nothing of the finished epoch is trained again.
4. The same between 2 and 3 ranks (3 ranks: 15, 12 and an empty rank), both ways: the last batch's checkpoint
   resumes, each rank trains its new shard of the next epoch, the replicas are equal and equal the replay; the
   mid-epoch one still stops every rank with an error naming both world sizes.

Every scenario runs again with its ranks rotated (the short or empty rank first and last). The ranks run in four
launches with a hard timeout: 3 ranks (the checkpoints 3 -> 2 resumes), 2 ranks (everything else of 2 ranks), then
3 ranks and 1 rank (resuming the 2-rank checkpoints); a checkpoint must exist before the launch that resumes it.
The rank side is tests/scenarios_resume_failures.py.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from harness import RankError, launch
from pipeline_data import replay
from reference import max_abs_diff

TOL = 1e-6
TIMEOUT, COLLECTIVE_TIMEOUT = 120, 20
M = 'scenarios_resume_failures'

# 1. litdata: 17 ids in chunks of 4, batches of 4; the checkpoint after batch 2 (of 3 per epoch)
LITDATA = dict(size=17, batch_size=4, epochs=2, resume_at='ep0-ba2')
LITDATA_CASES = {
    f'{loader}-{mode}{"@1" if rotate else ""}': dict(LITDATA, loader=loader, mode=mode, rotate=rotate)
    for loader in ('litdata', 'torch')
    for mode in ('shadow', 'rebalance')
    for rotate in (0, 1)
}

# 2. Hugging Face: 17 ids in 4 shards of 5, 4, 4, 4, i.e. 9 and 8 ids (3 and 2 batches); 3 epochs
HF = dict(size=17, num_shards=4, batch_size=4, epochs=3, resume_from=['ep0-ba3'])
HF_CASES = {
    f'{read}{"@1" if rotate else ""}': dict(
        HF, read=read, rotate=rotate, max_duration='9ba' if read == 'peek' else '51sp'
    )  # duration in batches (peek) or in samples (count), under a hard bound (scenarios_resume_failures.EpochLimit)
    for read in ('peek', 'count')
    for rotate in (0, 1)
}

# 3, 4. 27 ids reshuffled every epoch, in batches of 4; 'uneven': per world size the parts of UnevenShuffled
UNEVEN = dict(sampler='uneven', size=27, batch_size=4, parts={1: [27], 2: [17, 10], 3: [15, 12, 0]})
RESIZE = {
    'exact': dict(sampler='exact', size=27, batch_size=4, rotate=0),  # ExactDistributedSampler: 14, 13 on 2 ranks
    'uneven': dict(UNEVEN, rotate=0),  # the short (2 ranks) and empty (3 ranks) rank last
    'uneven@1': dict(UNEVEN, rotate=1),  # ... first
}
MID = 'ep0-ba2'
RESIZED = ('uneven', 'uneven@1')  # the scenarios resumed between 2 and 3 ranks
CHECKPOINTS = ('mid', 'last')


def write_litdata(folder: str, size: int) -> str:
    """``size`` rows ``{'id': i}`` in litdata's format (chunks of 4), written by this process.

    Not by a rank: litdata's ``BinaryWriter.merge()`` in a process group of 2 waits for the other rank's index
    file, forever.
    """
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(folder, chunk_size=4)
    for i in range(size):
        writer[i] = {'id': i}
    writer.done()
    writer.merge()
    return folder


def steps_per_epoch(cfg: dict, world: int) -> int:
    """The longest rank's batches per epoch on ``world`` ranks."""
    return max(-(-n // cfg['batch_size']) for n in sizes(cfg, world))


def sizes(cfg: dict, world: int) -> list[int]:
    if cfg['sampler'] == 'exact':
        return [len(s) for s in expected_shards(cfg, world, 0)]
    return cfg['parts'][world]


def last(cfg: dict, world: int) -> str:
    """The checkpoint of epoch 0's last batch (Composer saves it at BATCH_CHECKPOINT, before EPOCH_END)."""
    return f'ep0-ba{steps_per_epoch(cfg, world)}'


def checkpoint_name(cfg: dict, world: int, which: str) -> str:
    return MID if which == 'mid' else last(cfg, world)


def expected_shards(cfg: dict, world: int, epoch: int) -> list[list[int]]:
    """Per rank, in order, the ids its sampler gives it in ``epoch`` on ``world`` ranks (computed here)."""
    from composer_join import ExactDistributedSampler  # the public name (composer_join.data is being rewritten)

    ids = list(range(cfg['size']))
    if cfg['sampler'] == 'exact':
        out = []
        for rank in range(world):
            sampler = ExactDistributedSampler(ids, num_replicas=world, rank=rank, shuffle=True, seed=3)
            sampler.set_epoch(epoch)
            out.append(list(sampler))
        return out
    perm = torch.randperm(cfg['size'], generator=torch.Generator().manual_seed(5 + epoch)).tolist()
    moved = [cfg['parts'][world][(i - cfg['rotate']) % world] for i in range(world)]
    cuts = [sum(moved[:r]) for r in range(world + 1)]
    return [perm[cuts[r] : cuts[r + 1]] for r in range(world)]


# -- the launches ------------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp('resume_failures')
    return {
        'litdata': write_litdata(str(root / 'litdata'), LITDATA['size']),
        'runs': str(root / 'runs'),
    }


@pytest.fixture(scope='module')
def three_saved(folders) -> dict:
    """3 ranks: one epoch of each resized scenario, a checkpoint after every batch (resumed on 2)."""
    calls = [
        (f'save:{name}', f'{M}:save_for_resize', dict(cfg=RESIZE[name], folder=saved(folders, name, 3)))
        for name in RESIZED
    ]
    return launch(3, calls, timeout=TIMEOUT, collective_timeout=COLLECTIVE_TIMEOUT)


def saved(folders: dict, name: str, world: int) -> str:
    return os.path.join(folders['runs'], f'saved{world}-{name.replace("@", "_")}')


@pytest.fixture(scope='module')
def two(folders, three_saved) -> dict:
    """2 ranks: litdata, Hugging Face, one epoch of each resized scenario (checkpoints), the 3-rank ones resumed."""
    runs = folders['runs']
    calls = [
        (
            f'litdata:{name}',
            f'{M}:litdata_case',
            dict(cfg=cfg, folder=os.path.join(runs, 'litdata-' + name.replace('@', '_')), data=folders['litdata']),
        )
        for name, cfg in LITDATA_CASES.items()
    ]
    calls += [
        (
            f'hf:{name}',
            f'{M}:hf_read_before_fit',
            dict(cfg=cfg, folder=os.path.join(runs, 'hf-' + name.replace('@', '_'))),
        )
        for name, cfg in HF_CASES.items()
    ]
    calls += [
        (f'save:{name}', f'{M}:save_for_resize', dict(cfg=cfg, folder=saved(folders, name, 2)))
        for name, cfg in RESIZE.items()
    ]
    calls += [
        (
            f'resume3:{name}:{which}',
            f'{M}:resume_resized',
            dict(cfg=RESIZE[name], folder=saved(folders, name, 3), name=checkpoint_name(RESIZE[name], 3, which)),
        )
        for name in RESIZED
        for which in CHECKPOINTS
    ]
    return launch(2, calls, timeout=TIMEOUT, collective_timeout=COLLECTIVE_TIMEOUT)


def resumes_of_two(folders: dict, names, world: int) -> list[tuple[str, str, dict]]:
    return [
        (
            f'resume2:{name}:{which}',
            f'{M}:resume_resized',
            dict(cfg=RESIZE[name], folder=saved(folders, name, 2), name=checkpoint_name(RESIZE[name], 2, which)),
        )
        for name in names
        for which in CHECKPOINTS
    ]


@pytest.fixture(scope='module')
def three_resumed(folders, two) -> dict:
    """3 ranks: the 2-rank checkpoints resumed."""
    return launch(3, resumes_of_two(folders, RESIZED, 3), timeout=TIMEOUT, collective_timeout=COLLECTIVE_TIMEOUT)


@pytest.fixture(scope='module')
def one(folders, two) -> dict:
    """1 rank: the 2-rank checkpoints resumed."""
    return launch(1, resumes_of_two(folders, RESIZE, 1), timeout=TIMEOUT, collective_timeout=COLLECTIVE_TIMEOUT)


# -- checks ------------------------------------------------------------------------------------------------------


def ok(runs: dict, key: str) -> list:
    errors = [f'rank {r}: {e}' for r, e in enumerate(runs[key]) if isinstance(e, RankError)]
    assert not errors, f'{key} failed: ' + '; '.join(errors)
    return runs[key]


def per_epoch(runs: list[dict]) -> dict[int, list[int]]:
    """Every id trained in each epoch, over all ranks, sorted."""
    out: dict[int, list[int]] = {}
    for run in runs:
        for epoch, ids in run['steps'].values():
            out.setdefault(epoch, []).extend(ids)
    return {e: sorted(ids) for e, ids in sorted(out.items())}


def steps(runs: list[dict], before: int | None = None) -> list[list[list[int]]]:
    """The steps the ranks ran together (``before``: only those before that global step), each the ids per rank."""
    keys = sorted(runs[0]['steps'])
    assert all(sorted(run['steps']) == keys for run in runs), [sorted(run['steps']) for run in runs]
    return [[run['steps'][s][1] for run in runs] for s in keys if before is None or s < before]


def same_replicas(runs: list[dict], what: str) -> None:
    for rank, run in enumerate(runs):
        assert max_abs_diff(run['params'], runs[0]['params']) == 0.0, f'{what}: rank {rank} differs from rank 0'


def trained_once_per_epoch(runs: list[dict], ids: list[int], epochs: int, what: str) -> None:
    got = per_epoch(runs)
    wrong = {
        e: {
            'twice': sorted({i for i in got.get(e, []) if got[e].count(i) > 1}),
            'never': sorted(set(ids) - set(got.get(e, []))),
        }
        for e in range(epochs)
        if got.get(e) != ids
    }
    assert not wrong and len(got) == epochs, f'{what}: not every id once per epoch: {wrong} (epochs {sorted(got)})'


def resumed_like_uninterrupted(full: list[dict], resumed: list[dict], at: int, what: str) -> None:
    """From global step ``at`` on, the resumed run trains the same ids at every step and ends with the same weights."""
    for rank, (f, r) in enumerate(zip(full, resumed)):
        assert r['error'] is None, f'{what}: rank {rank} stopped: {r["error"]}'
        later = {s: v for s, v in f['steps'].items() if s >= at}
        if r['steps'] != later:
            mine = [i for _, ids in r['steps'].values() for i in ids]
            theirs = [i for _, ids in later.values() for i in ids]
            raise AssertionError(
                f'{what}: rank {rank} resumed at step {at} and trained {len(mine)} samples where the uninterrupted '
                f'run trained {len(theirs)}: never {sorted(set(theirs) - set(mine))}, more often '
                f'{sorted({i for i in mine if mine.count(i) > theirs.count(i)})}; per step (epoch, ids) '
                f'{r["steps"]} instead of {later}'
            )
        diff = max_abs_diff(r['params'], f['params'])
        assert diff < TOL, f'{what}: rank {rank} ends {diff:.2e} from the uninterrupted run'


def names_both_world_sizes(message: str, saved_by: int, world: int) -> bool:
    return all(re.search(rf'\b{n} ranks?\b', message) for n in (saved_by, world))


def check_refused_mid_epoch(saving: list[dict], resumed: list, cfg: dict, at: int, what: str) -> None:
    """Resumed from mid-epoch 0 (global step ``at``): every rank stops with an UnevenInputsError naming both world
    sizes, before any step."""
    saved_by, world = len(saving), len(resumed)
    for rank, run in enumerate(resumed):
        assert not isinstance(run, RankError), f'{what}: rank {rank} crashed: {run}'
        if run['error'] is None:
            before = sum(len(ids) for step in steps(saving, before=at) for ids in step)
            after = sum(len(ids) for r in resumed for _, ids in r['steps'].values())
            raise AssertionError(
                f'{what}: rank {rank} trained on: {after} samples after the checkpoint ({before} before it), '
                f'{before + after} in the 2 epochs where they hold {2 * cfg["size"]}; per step (epoch, ids) '
                f'{run["steps"]}'
            )
        assert names_both_world_sizes(run['error'], saved_by, world), f'{what}: rank {rank}: {run["error"]}'
        assert run['steps'] == {}, f'{what}: rank {rank} trained before stopping: {run["steps"]}'


def check_next_epoch_on_new_world(saving: list[dict], resumed: list, cfg: dict, at: int, what: str) -> None:
    """Resumed from the last batch of epoch 0 (global step ``at``): epoch 1 exactly, as the new world size shards it."""
    world = len(resumed)
    for rank, run in enumerate(resumed):
        assert not isinstance(run, RankError), f'{what}: rank {rank} crashed: {run}'
        assert run['error'] is None, f'{what}: rank {rank} refused an epoch boundary: {run["error"]}'
    old = [i for run in resumed for e, ids in run['steps'].values() if e == 0 for i in ids]
    assert not old, (
        f'{what}: {len(old)} samples of the finished epoch 0 trained again after the resume (ids {sorted(old)}); '
        f'{sum(len(ids) for run in resumed for _, ids in run["steps"].values())} samples trained in all where '
        f'epoch 1 holds {cfg["size"]}'
    )
    shards = expected_shards(cfg, world, 1)
    for rank, run in enumerate(resumed):
        got = [i for _, ids in run['steps'].values() for i in ids]
        assert got == shards[rank], (
            f'{what}: rank {rank} trained {got}, its {world}-rank shard of epoch 1 is {shards[rank]}'
        )
    assert min(resumed[0]['steps']) == at, f'{what}: the first step resumed is {min(resumed[0]["steps"])}, not {at}'
    n = steps_per_epoch(cfg, world)
    assert [run['timestamp']['epoch'] for run in resumed] == [2] * world
    assert [run['timestamp']['batch'] for run in resumed] == [at + n] * world, 'one epoch of the new world size'
    same_replicas(resumed, what)
    expected = replay(steps(saving, before=at) + steps(resumed))
    diff = max_abs_diff(resumed[0]['params'], expected)
    assert diff < TOL, f'{what}: {diff:.2e} from the replay of the steps before and after the checkpoint'


def check_elastic_mid_epoch(saving: list[dict], resumed: list, cfg: dict, at: int, what: str) -> None:
    """Resumed from mid-epoch 0 (global step ``at``) of data whose sampler names every shard in one index space
    (``ExactDistributedSampler``: issue 35): every id of epoch 0 once across both runs, then epoch 1 as the new world
    size shards it, replicas identical, and the weights of a replay of both runs' steps."""
    world = len(resumed)
    for rank, run in enumerate(resumed):
        assert not isinstance(run, RankError), f'{what}: rank {rank} crashed: {run}'
        assert run['error'] is None, f'{what}: rank {rank} refused: {run["error"]}'
    before = [i for step in steps(saving, before=at) for ids in step for i in ids]
    later = [(e, i) for run in resumed for e, ids in run['steps'].values() for i in ids]
    first = sorted(before + [i for e, i in later if e == 0])
    assert first == list(range(cfg['size'])), f'{what}: epoch 0 across both runs is {first}'
    shards = expected_shards(cfg, world, 1)
    for rank, run in enumerate(resumed):
        got = [i for e, ids in run['steps'].values() if e == 1 for i in ids]
        assert got == shards[rank], f'{what}: rank {rank} trained {got} in epoch 1, its shard is {shards[rank]}'
    same_replicas(resumed, what)
    expected = replay(steps(saving, before=at) + steps(resumed))
    diff = max_abs_diff(resumed[0]['params'], expected)
    assert diff < TOL, f'{what}: {diff:.2e} from the replay of the steps before and after the checkpoint'


# -- the tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', list(LITDATA_CASES))
def test_litdata_streaming_dataset_trains_every_id_once_and_resumes_mid_epoch(two, name):
    cfg = LITDATA_CASES[name]
    per_rank = ok(two, f'litdata:{name}')
    ids = list(range(cfg['size']))
    parts = [res['part'] for res in per_rank]
    # litdata's own split (drop_last=False): every id on one rank, and uneven (8 and 9 ids)
    assert sorted(i for p in parts for i in p) == ids and len({len(p) for p in parts}) > 1, parts
    full = [res['full'] for res in per_rank]
    assert all(f['error'] is None for f in full), [f['error'] for f in full]
    trained_once_per_epoch(full, ids, cfg['epochs'], name)
    same_replicas(full, name)
    diff = max_abs_diff(full[0]['params'], replay(steps(full)))
    assert diff < TOL, f'{name}: {diff:.2e} from the single-process replay'
    at = int(cfg['resume_at'].split('-ba')[1])
    resumed_like_uninterrupted(full, [res['resumed'] for res in per_rank], at, name)


@pytest.mark.parametrize('resumed_from', HF['resume_from'])
@pytest.mark.parametrize('name', list(HF_CASES))
def test_hf_iterable_dataset_read_before_fit_resumes_where_it_stopped(two, name, resumed_from):
    cfg = HF_CASES[name]
    per_rank = ok(two, f'hf:{name}')
    ids = list(range(cfg['size']))
    parts = [res['part'] for res in per_rank]
    assert sorted(i for p in parts for i in p) == ids and len({len(p) for p in parts}) > 1, parts
    full = [res['full'] for res in per_rank]
    assert all(f['error'] is None for f in full), [f['error'] for f in full]
    trained_once_per_epoch(full, ids, cfg['epochs'], f'{name} uninterrupted')
    diff = max_abs_diff(full[0]['params'], replay(steps(full)))
    assert diff < TOL, f'{name}: {diff:.2e} from the single-process replay'
    at = int(resumed_from.split('-ba')[1])
    resumed_like_uninterrupted(full, [res[resumed_from] for res in per_rank], at, f'{name} from {resumed_from}')


@pytest.mark.parametrize('which', CHECKPOINTS)
@pytest.mark.parametrize('name', list(RESIZE))
def test_checkpoint_of_2_ranks_resumed_on_1(two, one, name, which):
    cfg = RESIZE[name]
    saving = ok(two, f'save:{name}')
    ckpt = checkpoint_name(cfg, 2, which)
    assert f'{ckpt}-rank0.pt' in saving[0]['checkpoints'], saving[0]['checkpoints']
    trained_once_per_epoch(saving, list(range(cfg['size'])), 1, f'{name} on 2 ranks')
    resumed = one[f'resume2:{name}:{which}']
    what = f'{name} {ckpt} of 2 ranks on 1'
    check = check_next_epoch_on_new_world
    if which == 'mid':  # ExactDistributedSampler resumes elastically (issue 35); UnevenShuffled, a subclass, cannot
        check = check_elastic_mid_epoch if cfg['sampler'] == 'exact' else check_refused_mid_epoch
    check(saving, resumed, cfg, int(ckpt.split('-ba')[1]), what)


@pytest.mark.parametrize('which', CHECKPOINTS)
@pytest.mark.parametrize('name', RESIZED)
@pytest.mark.parametrize('saved_by,world', [(2, 3), (3, 2)], ids=['2to3', '3to2'])
def test_checkpoint_of_the_last_batch_resumes_on_another_world_size(
    two, three_saved, three_resumed, saved_by, world, name, which
):
    cfg = RESIZE[name]
    saving = ok(two if saved_by == 2 else three_saved, f'save:{name}')
    ckpt = checkpoint_name(cfg, saved_by, which)
    assert f'{ckpt}-rank0.pt' in saving[0]['checkpoints'], saving[0]['checkpoints']
    trained_once_per_epoch(saving, list(range(cfg['size'])), 1, f'{name} on {saved_by} ranks')
    resumed = (three_resumed if world == 3 else two)[f'resume{saved_by}:{name}:{which}']
    what = f'{name} {ckpt} of {saved_by} ranks on {world}'
    check = check_refused_mid_epoch if which == 'mid' else check_next_epoch_on_new_world
    check(saving, resumed, cfg, int(ckpt.split('-ba')[1]), what)
