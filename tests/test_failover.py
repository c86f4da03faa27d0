"""Failover by relaunch (issue 42): a run killed with SIGKILL mid-epoch, relaunched with ``autoresume=True`` on fewer
ranks or more, trains every sample once per epoch, equal to a single-process replay of the steps that count.

Each case trains 2 epochs with a checkpoint after every batch (``tests/scenarios_failover.py``); one rank kills
itself with SIGKILL at a chosen step of epoch 0, the others stop with gloo's error (``Connection closed by peer`` /
``reset by peer``), re-raised as it is; then the same training is launched again on another number of ranks, and
Composer's ``autoresume`` loads the latest checkpoint. Against references computed here (the samplers' shards from
their definitions, ``tests/test_elastic.py``), across both launches, from what every process recorded as it went
(the killed one included):

* epoch 0 trained every id exactly as often as the old shards hold it (torch's sampler pads), epoch 1 the new world
  size's shards (each rank its own, in the sampler's order; rebalancing: the same ids in all);
* the replicas are identical and equal a single-process replay of the steps that reached a checkpoint (each step's
  mean loss over its real samples times its ``A_t / W_t``), within 1e-5;
* the survivors' errors are the backend's, and where they were waiting in one of UnevenJoin's own collectives
  (a rank killed before it asked for the first agreed step's batch), they name that collective, the step and the
  ranks waited for (``composer_join/core/peers.py``).

Cases: the killed rank shadowing and not, rank 0 (which writes the checkpoints) and the last rank, shadow and
rebalance, ``ExactDistributedSampler`` and torch's ``DistributedSampler`` (also in a batch-yielding subclass as
``batch_sampler=``), fewer ranks and more. Their short rank is the last one: these samplers give ranks below
``len % world`` one sample more. A data library that keeps its own position (torchdata's ``StatefulDataLoader`` over
each rank's own ids, its short rank first and last) resumes exactly on the same world size and is refused on another,
on every rank, naming both world sizes. Stock Composer runs three of the cases the same way (the docs' stock column,
docs/reliability.md). One launch per kill (a killed rank ends its launch), one per world size to relaunch.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from harness import launch
from pipeline_data import replay
from reference import max_abs_diff
from scenarios_failover import merged, read_records, shard_sizes
from test_elastic import shard
from test_join_core import ok

TOL = 1e-5
# 37 ids on 3 ranks: 13/12/12, batches of 4: 4/3/3 (steps 0-1 planned from the lengths, 2 the first agreed, ranks 1
# and 2 shadow at 3); 41 on 2: 21/20, 6/5 batches (rank 1 shadows at 5); torch's sampler pads 41 to 21/21
EXACT37 = dict(sampler='exact', size=37, batch_size=4)
EXACT41 = dict(sampler='exact', size=41, batch_size=4)
CASES: dict[str, dict[str, Any]] = {
    # the short rank killed while it shadows
    '3to2_exact_shadowing_killed': dict(old=3, new=2, cfg=EXACT37, kill=dict(rank=2, at=(0, 3))),
    # rank 0 killed before it asks for the first agreed step's batch: the others wait in UnevenJoin's agreement
    '3to2_exact_rank0_killed': dict(old=3, new=2, cfg=EXACT37, kill=dict(rank=0, at=(0, 2), event='before_dataloader')),
    '3to2_rebalance': dict(old=3, new=2, cfg=dict(EXACT37, mode='rebalance'), kill=dict(rank=1, at=(0, 1))),
    '2to3_exact_shadowing_killed': dict(old=2, new=3, cfg=EXACT41, kill=dict(rank=1, at=(0, 5))),
    '2to1_torch': dict(old=2, new=1, cfg=dict(EXACT41, sampler='torch'), kill=dict(rank=0, at=(0, 2))),
    '2to3_torch_batch_sampler': dict(
        old=2, new=3, cfg=dict(sampler='torch', batched=True, size=14, batch_size=3), kill=dict(rank=1, at=(0, 1))
    ),
}
# torchdata's StatefulDataLoader over each rank's own ids (it keeps its own position): the same world size resumes it,
# another is refused. Shards of 5 and 10 ids, batches of 4: the short rank shadows from step 2, killed there.
OWN: dict[str, dict[str, Any]] = {
    'own_position_short_first': dict(
        old=2, new=2, other=3, cfg=dict(sampler='stateful', sizes=[5, 10], batch_size=4), kill=dict(rank=0, at=(0, 2))
    ),
    'own_position_short_last': dict(
        old=2, new=2, other=1, cfg=dict(sampler='stateful', sizes=[10, 5], batch_size=4), kill=dict(rank=1, at=(0, 2))
    ),
}
# stock Composer ends every epoch at its shortest rank's last batch: the cases whose kill step it reaches
STOCK = ['3to2_exact_rank0_killed', '2to1_torch', '2to3_torch_batch_sampler']


def _folder(root: Path, name: str, stock: bool = False) -> str:
    return str(root / (('stock-' if stock else '') + name))


def _fit(name: str, case: dict, folder: str, join: bool = True, kill: bool = False) -> tuple[str, str, dict]:
    cfg = dict(case['cfg'], join=join)
    kwargs: dict[str, Any] = dict(cfg=cfg, folder=folder)
    if kill:
        kwargs['kill'] = case['kill']
    return (f'{"kill" if kill else "relaunch"}:{"" if join else "stock-"}{name}', 'scenarios_failover:fit', kwargs)


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp('failover')
    out: dict = {}
    everything = {**CASES, **OWN}
    for name, case in everything.items():  # one launch per kill
        out.update(
            launch(
                case['old'],
                [_fit(name, case, _folder(root, name), kill=True)],
                300,
                may_be_killed=(case['kill']['rank'],),
            )
        )
    for name in STOCK:
        case = CASES[name]
        out.update(
            launch(
                case['old'],
                [_fit(name, case, _folder(root, name, True), join=False, kill=True)],
                300,
                may_be_killed=(case['kill']['rank'],),
            )
        )
    for name, case in OWN.items():  # the refused relaunch reads a copy: the same world size's comes after it
        shutil.copytree(_folder(root, name), _folder(root, f'{name}-other'), symlinks=True)
    for world in (1, 2, 3):  # the relaunches
        calls = [_fit(name, case, _folder(root, name)) for name, case in everything.items() if case['new'] == world]
        calls += [_fit(n, CASES[n], _folder(root, n, True), join=False) for n in STOCK if CASES[n]['new'] == world]
        calls += [
            (f'refused:{name}', 'scenarios_failover:fit', dict(cfg=case['cfg'], folder=_folder(root, f'{name}-other')))
            for name, case in OWN.items()
            if case['other'] == world
        ]
        out.update(launch(world, calls, 300))
    out['root'] = root
    return out


def own_shard(cfg: dict, world: int, rank: int) -> list[int]:
    """Rank ``rank``'s ids of a data library's own shards (``scenarios_failover.make_loader``, ``'stateful'``)."""
    sizes = shard_sizes(cfg, world)
    return list(range(sum(sizes[:rank]), sum(sizes[: rank + 1])))


def expected_ids(cfg: dict, world: int, rank: int, epoch: int) -> list[int]:
    return own_shard(cfg, world, rank) if cfg['sampler'] == 'stateful' else shard(cfg, world, rank, epoch)


def check_killed_launch(runs: dict, name: str, case: dict, join: bool = True) -> list:
    """The killed rank died by SIGKILL; every other rank stopped with the backend's error, re-raised as it is."""
    per_rank = runs[f'kill:{"" if join else "stock-"}{name}']
    killed = case['kill']['rank']
    assert per_rank[killed].type == 'Killed', (name, per_rank[killed])
    errors = []
    for rank, res in enumerate(per_rank):
        if rank != killed:
            assert isinstance(res, dict) and res['error'] is not None, f'{name}: rank {rank} trained on: {res}'
            kind, message = res['error']
            assert kind == 'RuntimeError' and ('Connection' in message or 'peer' in message), (name, rank, message)
            errors.append(message)
    return errors


def steps_of(runs: dict, name: str, join: bool = True) -> list[tuple[int, list[list[int]]]]:
    return merged(read_records(_folder(runs['root'], name, not join)))


@pytest.mark.parametrize('name', [*CASES, *OWN])
def test_a_rank_killed_mid_epoch_then_a_relaunch_trains_every_sample_once(runs, name):
    case = {**CASES, **OWN}[name]
    cfg = case['cfg']
    check_killed_launch(runs, name, case)
    relaunched = ok(runs, f'relaunch:{name}')
    assert all(res['error'] is None for res in relaunched), [res['error'] for res in relaunched]
    steps = steps_of(runs, name)
    old, new = case['old'], case['new']
    interrupted = Counter(i for epoch, parts in steps if epoch == 0 for part in parts for i in part)
    expected = Counter(i for r in range(old) for i in expected_ids(cfg, old, r, 0))
    assert interrupted == expected, (
        f'{name}: epoch 0 trained {interrupted - expected} too often, missed {expected - interrupted}'
    )
    later = [[i for epoch, parts in steps if epoch == 1 for i in parts[k]] for k in range(new)]
    if cfg.get('mode') == 'rebalance':
        assert Counter(i for part in later for i in part) == Counter(
            i for k in range(new) for i in expected_ids(cfg, new, k, 1)
        )
    else:
        assert later == [expected_ids(cfg, new, k, 1) for k in range(new)], f'{name}: epoch 1 is not the new shards'
    reference = replay([parts for _, parts in steps])
    for rank, res in enumerate(relaunched):
        diff = max_abs_diff(res['params'], reference)
        assert diff < TOL, f'{name}: rank {rank} is {diff:.2e} from the single-process replay'


def test_the_ranks_waiting_in_the_agreement_say_which_step_and_which_ranks(runs):
    # rank 0 was killed before asking for batch 2, the first agreed step: ranks 1 and 2 waited in UnevenJoin's agreement
    errors = check_killed_launch(runs, '3to2_exact_rank0_killed', CASES['3to2_exact_rank0_killed'])
    for rank, message in zip((1, 2), errors):
        others = [r for r in range(3) if r != rank]
        assert message.splitlines()[0].startswith('[/pytorch/third_party/gloo/'), message  # the original error first
        assert (
            f'UnevenJoin on rank {rank} of 3: the agreement on batch 2 of epoch 0 failed while waiting for ranks '
            f'{others}' in message
        ), message
        assert 'most likely gone (killed, out of memory, its node lost' in message, message


@pytest.mark.parametrize('name', list(OWN))
def test_data_that_keeps_its_own_position_is_refused_on_another_world_size(runs, name):
    case = OWN[name]
    for rank, res in enumerate(ok(runs, f'refused:{name}')):
        assert res['error'] is not None, f'{name}: rank {rank} trained on {case["other"]} ranks'
        kind, message = res['error']
        assert kind == 'UnevenInputsError', (rank, kind, message)
        assert f'{case["old"]} ranks' in message and f'this run has {case["other"]}' in message, message
    attempts = read_records(_folder(runs['root'], f'{name}-other'))
    assert len(attempts) == 1, f'{name}: the refused relaunch trained'  # only the killed launch's records


def stock_outcome(runs: dict, name: str) -> str:
    """Stock Composer on a case: the ids of the interrupted epoch trained across both launches (of all), or the error."""
    case = CASES[name]
    check_killed_launch(runs, name, case, join=False)
    relaunched = ok(runs, f'relaunch:stock-{name}')
    errors = sorted({f'{r["error"][0]}: {r["error"][1].splitlines()[0]}' for r in relaunched if r['error']})
    if errors:
        return f'raises `{" / ".join(errors)}`'
    steps = steps_of(runs, name, join=False)
    trained = Counter(i for epoch, parts in steps if epoch == 0 for part in parts for i in part)
    expected = Counter(i for r in range(case['old']) for i in shard(case['cfg'], case['old'], r, 0))
    twice, never = sum((trained - expected).values()), sum((expected - trained).values())
    details = [f'{twice} twice'] * bool(twice) + [f'{never} never'] * bool(never)
    return f'trains {sum(trained.values())} of {sum(expected.values())}' + (
        f' ({", ".join(details)})' if details else ''
    )


DOCS = Path(__file__).parent.parent / 'docs' / 'reliability.md'
STOCK_COLUMN = 'stock Composer (measured)'


def test_docs_stock_column_is_the_measured_one(runs):
    from test_pipelines import docs_column

    measured = {name: stock_outcome(runs, name) for name in STOCK}
    documented = docs_column(DOCS.read_text(), STOCK_COLUMN)
    wrong = {k: (documented.get(k), v) for k, v in measured.items() if documented.get(k) != v}
    assert not wrong, 'docs/reliability.md disagrees (documented, measured):\n' + '\n'.join(
        f'{k}: {d!r} != {m!r}' for k, (d, m) in wrong.items()
    )
