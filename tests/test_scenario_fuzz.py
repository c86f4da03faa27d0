"""The scenario fuzzer (``tests/scenario_fuzz.py``) in the suite: its reference validated against stock Composer on
even shards for every drawn feature, a slice of fresh seeds per run (the first seed printed), every seed that ever
failed (``tests/fuzz_regressions.json``), and the generator's and shrinker's own contracts.

``COMPOSER_JOIN_FUZZ_SEED`` fixes the slice's first seed (else it comes from the clock), ``COMPOSER_JOIN_FUZZ_SLICE``
its size. Long runs: ``make fuzz N=500 SEED=...``.
"""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

import pytest

import fuzz_reference as ref
import scenario_fuzz as fuzz

HERE = Path(__file__).parent
REGRESSIONS = json.loads((HERE / 'fuzz_regressions.json').read_text())
SLICE = int(os.environ.get('COMPOSER_JOIN_FUZZ_SLICE', '6'))

pytestmark = pytest.mark.timeout(900)

BASE = {'world': 2, 'batch': 3, 'source': 'len', 'shards': [6, 6], 'duration': [2, 'ep'], 'stock': True}
# One even scenario per drawn feature value: stock Composer (no UnevenJoin) must match the reference there.
FEATURES: list[dict] = [
    {},
    {'source': 'nolen', 'duration': [3, 'ba']},
    {'source': 'exact', 'map_size': 12, 'shuffle': True},
    {'source': 'exact', 'map_size': 12},
    {'source': 'torch', 'map_size': 11, 'shuffle': True},
    {'workers': 2},
    {'workers': 1, 'source': 'exact', 'map_size': 12},
    {'fmt': 'dict'},
    {'transform': 'float'},
    {'transform': 'drop'},
    {'transform': 'views', 'microbatch': 4},
    # Composer's default microbatch (the dataloader's batch size) splits a 'views' batch in two: BatchNorm sees each
    {'transform': 'views', 'model': 'bn', 'shards': [8, 8], 'batch': 4},
    {'model': 'bn', 'shards': [8, 8], 'batch': 4, 'transform': 'views', 'mb_transform': True},
    {'mb_transform': True, 'microbatch': 2},
    {'model': 'branch', 'find_unused': True, 'microbatch': 2},
    {'model': 'bn', 'shards': [8, 8], 'batch': 4, 'microbatch': 2},
    {'model': 'deep', 'ckpt': 'reentrant'},
    {'model': 'deep', 'ckpt': 'non_reentrant', 'microbatch': 2},
    {'model': 'deep'},
    {'model': 'frozen'},
    {'model': 'sparse', 'optimizer': 'sparseadam'},
    {'model': 'sync'},
    {'model': 'sync', 'microbatch': 2, 'sync': 'multi_auto_sync', 'transform': 'views'},
    {'model': 'sync', 'microbatch': 1, 'sync': 'forced_sync', 'transform': 'views'},
    {'sync': 'single_auto_sync', 'microbatch': 1},
    {'sync': 'multi_auto_sync', 'microbatch': 2},
    {'sync': 'forced_sync', 'microbatch': 2},
    {'static_graph': True, 'sync': 'multi_auto_sync'},
    {'optimizer': 'adam'},
    {'clip': True},
    {'mode': 'rebalance'},
    {'divide': False},
    {'duration': [3, 'ba']},
    {'duration': [7, 'sp']},
    {'duration': [20, 'tok']},
    {'duration': [13, 'tok'], 'transform': 'views'},
    {'twin': True, 'refit': True, 'eval': 'own', 'eval_batch': 2, 'eval_shards': [2, 2]},
    # automatic microbatching, an out-of-memory error on one rank (Composer's retry with half the microbatch size).
    # Stock Composer survives few of these on CPU ranks: gloo aborts (or times out) for an OOM in the loss, in a
    # backward, in a forward of a batch's only microbatch, at step 0 under multi_auto_sync, with BatchNorm (measured,
    # 2026-12-07), which UnevenJoin's own OOM path handles (tests/test_auto_microbatching.py); the halved size's
    # effect on a BatchNorm model is checked by UnevenJoin's runs agreeing with the reference there
    {'oom': [1, 2, 'forward'], 'microbatch': 2, 'refit': True},
    {'duration': [1, 'ep'], 'refit': True},
    {'eval': 'both', 'eval_batch': 2, 'eval_shards': [5, 5], 'eval_microbatch': 1},
    {'eval': 'own', 'eval_batch': 4, 'eval_shards': [3, 3]},
    {'predict_shards': [4, 4]},
    # evaluations before the first fit (the initial weights), then the scenario as before
    {'eval_first': [2, 'both'], 'eval_batch': 2, 'eval_shards': [3, 3], 'eval_microbatch': 1},
    {'eval_first': [1, 'passed'], 'raise_at': ['batch_start', 1], 'eval_batch': 2, 'eval_shards': [3, 3]},
    {'eval_first': [1, 'own'], 'wrapper': 'fsdp2', 'resume_at': 2, 'eval_batch': 2, 'eval_shards': [2, 2]},
    {'resume_at': 3},
    {'resume_at': 2, 'source': 'exact', 'map_size': 12, 'shuffle': True, 'optimizer': 'adam'},
    {'wrapper': 'fsdp1', 'microbatch': 2},
    {'wrapper': 'fsdp2', 'microbatch': 2, 'eval': 'own', 'eval_batch': 2, 'eval_shards': [4, 4]},
    {'wrapper': 'fsdp2', 'model': 'deep', 'ckpt': 'non_reentrant', 'clip': True, 'predict_shards': [2, 2]},
    {'wrapper': 'fsdp1', 'model': 'deep', 'optimizer': 'adam', 'resume_at': 2},
    {'raise_at': ['batch_start', 3]},
    {'raise_at': ['before_forward', 2], 'microbatch': 2, 'sync': 'multi_auto_sync'},
    {'raise_at': ['epoch_start', 2], 'source': 'exact', 'map_size': 12, 'shuffle': True},
    {'raise_at': ['fit_start', 0], 'optimizer': 'adam'},
    {'raise_at': ['after_dataloader', 1], 'transform': 'views'},
    {'raise_at': ['eval_start', 0], 'eval': 'passed', 'eval_batch': 2, 'eval_shards': [3, 3]},
    {'raise_at': ['predict_start', 0], 'predict_shards': [2, 2]},
    {'world': 3, 'shards': [6, 6, 6], 'mode': 'rebalance', 'eval': 'passed', 'eval_batch': 2, 'eval_shards': [2, 2, 2]},
    # resumed on another world size from the checkpoint of an epoch's last batch: stock Composer is exact there where
    # the new world's epoch has no more batches than the old one's (it spins the new loader past the old position:
    # 2 -> 1 with 2 batches per rank retrains epoch 0, and mid-epoch it trains some samples twice and skips others,
    # docs/reliability.md); eval and predict shards of the new world size
    {
        **dict(source='exact', map_size=12, shuffle=True, resume_at=2, resume_world=3),
        **dict(eval='both', eval_batch=2, eval_shards=[3, 3, 3], predict_shards=[2, 2, 2]),
    },
    {'world': 3, 'source': 'torch', 'map_size': 11, 'shuffle': True, 'resume_at': 2, 'resume_world': 2}
    | {'eval_first': [1, 'own'], 'eval_batch': 2, 'eval_shards': [2, 2, 2]},  # the resumed launch evaluates first
    {'batch': 4, 'source': 'exact', 'map_size': 4, 'resume_at': 1, 'resume_world': 1, 'optimizer': 'adam'},
    {'shards': [6, 6, 6], 'resume_at': 2, 'resume_world': 3, 'workers': 1},
    {'wrapper': 'fsdp2', 'microbatch': 2, 'source': 'exact', 'map_size': 12, 'resume_at': 2, 'resume_world': 3},
    dict(wrapper='fsdp1', world=3, source='exact', map_size=12, resume_at=2, resume_world=2, clip=True),
]
# Resumed on another world size with UnevenJoin, uneven: mid-epoch (map-style), from an epoch's last batch, refused.
ELASTIC: list[dict] = [
    # 2 -> 3 mid-epoch (7/6 ids, before the short rank ran out), shuffled; evaluations and predictions on 3 ranks
    {
        **dict(world=2, resume_world=3, batch=3, source='exact', map_size=13, shuffle=True, duration=[2, 'ep']),
        **dict(resume_at=1, eval='both', eval_batch=2, eval_shards=[3, 0, 2], predict_shards=[1, 2, 3]),
    },
    # 3 -> 2 mid-epoch: a later step has 1 of 2 ranks active, its gradient times 1/2 (the new world size's); both
    # launches evaluate before fitting (the first the initial weights, the second the checkpoint it loaded)
    dict(world=3, resume_world=2, batch=3, source='exact', map_size=13, duration=[2, 'ep'], resume_at=1)
    | dict(eval_first=[2, 'passed'], eval_batch=2, eval_shards=[2, 1, 3]),
    # 3 -> 2 rebalancing, torch's padding sampler, Adam, DataLoader workers
    {
        **dict(world=3, resume_world=2, batch=2, source='torch', map_size=13, mode='rebalance', optimizer='adam'),
        **dict(duration=[2, 'ep'], resume_at=2, workers=1),
    },
    # 2 -> 1 in the second epoch, a duration in batches, a batch transform that drops a sample
    {'world': 2, 'resume_world': 1, 'batch': 3, 'source': 'exact', 'map_size': 11, 'shuffle': True, 'transform': 'drop'}
    | {'duration': [6, 'ba'], 'resume_at': 3},
    # 2 -> 3 from the checkpoint of epoch 0's last batch of per-rank shards: the next epochs on 3 ranks' own shards
    {'world': 2, 'resume_world': 3, 'batch': 2, 'source': 'len', 'shards': [5, 2, 3], 'duration': [2, 'ep']}
    | {'resume_at': 3, 'refit': True},
    # FSDP2 2 -> 1 mid-epoch
    {'world': 2, 'resume_world': 1, 'batch': 2, 'source': 'exact', 'map_size': 9, 'duration': [2, 'ep'], 'resume_at': 1}
    | {'wrapper': 'fsdp2'},
    # chained, 2 -> 3 -> 2: the resumed run's checkpoint inside the rest of epoch 0 resumed again (three launches)
    {'world': 2, 'resume_world': 3, 'chain_world': 2, 'batch': 2, 'source': 'exact', 'map_size': 13, 'shuffle': True}
    | {'duration': [2, 'ep'], 'resume_at': 1, 'chain_at': 2, 'eval': 'own', 'eval_batch': 2, 'eval_shards': [1, 2, 3]},
    # refused: per-rank shards mid-epoch, 2 -> 1 and 3 -> 2 (UnevenInputsError on every rank of the second launch)
    {
        'world': 2,
        'resume_world': 1,
        'batch': 2,
        'source': 'len',
        'shards': [5, 2],
        'duration': [2, 'ep'],
        'resume_at': 1,
    },
    {'world': 3, 'resume_world': 2, 'batch': 2, 'source': 'nolen', 'shards': [3, 1, 4], 'duration': [5, 'ba']}
    | {'resume_at': 1},
]


def even(features: dict) -> dict:
    sc = fuzz.normalize({**BASE, **features})
    assert all(sc.get(k) == v for k, v in features.items() if k != 'mode' or v != 'shadow'), (features, sc)
    return sc


def test_reference_imports_no_composer_join():
    tree = ast.parse((HERE / 'fuzz_reference.py').read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or '' for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names and all(n.split('.')[0] in {'__future__', 'math', 'collections', 'typing', 'torch'} for n in names)


def test_draws_are_deterministic_json_and_normal():
    for seed in range(200):
        sc = fuzz.draw(seed)
        assert fuzz.draw(seed) == sc == fuzz.normalize(sc) == json.loads(json.dumps(sc))
        assert fuzz.reproduce(sc).endswith(f'--seed {seed}')
    drawn = [fuzz.draw(seed) for seed in range(400)]
    for key, values in {
        'source': {'len', 'nolen', 'exact', 'torch', 'over', 'under'},
        'model': {'mlp', 'branch', 'bn', 'deep', 'frozen', 'sparse', 'sync'},
        'transform': {'float', 'drop', 'views'},
        'eval': {'own', 'passed', 'both'},
    }.items():
        assert {sc.get(key, 'mlp' if key == 'model' else None) for sc in drawn} >= values, key
    assert {sc['duration'][1] for sc in drawn} == {'ep', 'ba', 'sp', 'tok'}
    assert any(sc.get('twin') for sc in drawn)
    firsts = [sc['eval_first'] for sc in drawn if sc.get('eval_first')]
    assert {c for c, _ in firsts} == {1, 2} and {k for _, k in firsts} == {'own', 'passed', 'both'}
    # stock Composer trains a fit() on the eval loader after a passed eval() raised at EVAL_START and retried (seed
    # 623337, docs/reliability.md): no raise there beside an evaluation before the first fit
    raised = {**BASE, 'eval': 'passed', 'raise_at': ['eval_start', 0], 'eval_batch': 1, 'eval_shards': [1, 1]}
    assert 'raise_at' in fuzz.normalize(raised) and 'raise_at' not in fuzz.normalize({**raised, 'eval_first': 1})
    assert any(sc.get('oom') for sc in drawn)
    assert any(0 in sc.get('shards', []) for sc in drawn) and any(sc['world'] == 3 for sc in drawn)
    resumed = [sc for sc in drawn if sc.get('resume_world')]
    assert {sc['resume_world'] for sc in resumed} == {1, 2, 3} and any(fuzz.predicted_error(sc) for sc in resumed)
    assert all(sc['resume_world'] != sc['world'] and sc.get('resume_at') for sc in resumed)
    assert any(not ref.mid_epoch(sc) for sc in resumed) and any(ref.mid_epoch(sc) for sc in resumed)


def test_shrinker_drops_what_does_not_matter():
    sc = fuzz.draw(next(s for s in range(100) if fuzz.draw(s)['world'] == 3 and fuzz.draw(s).get('transform')))
    # a pretend bug: any scenario with a batch transform and a rank of more than 2 samples fails
    fails = lambda cands: [c.get('transform') is not None and max(c.get('shards') or [9]) > 2 for c in cands]  # noqa: E731
    small = fuzz.shrink(sc, fails=fails, rounds=100, log=lambda *a, **k: None)
    assert small.get('transform') is not None and small['world'] == 2
    assert not any(k in small for k in ('eval', 'clip', 'microbatch', 'predict_shards', 'workers', 'refit'))
    # resumed on another world size: dropped where it does not matter, kept (on fewer ranks) where it does
    sc = next(sc for sc in map(fuzz.draw, range(2000)) if sc.get('resume_world') == 3)
    quiet = dict(rounds=100, log=lambda *a, **k: None)
    assert 'resume_world' not in fuzz.shrink(sc, fails=lambda cands: [True] * len(cands), **quiet)
    small = fuzz.shrink(sc, fails=lambda cands: [bool(c.get('resume_world')) for c in cands], **quiet)
    assert small['resume_world'] == 1 and small['world'] == 2, small


def test_reference_matches_stock_composer_on_even_shards():
    """Every feature, stock Composer on even shards (where uneven training is plain DDP) against the reference."""
    scs = [even(f) for f in FEATURES]
    problems = fuzz.run_many(scs, chunk=len(scs), confirm=False)
    failed = {json.dumps(sc): p for sc, p in zip(scs, problems) if p}
    assert not failed, json.dumps(failed, indent=1)


def test_elastic_scenarios_resume_on_another_world_size():
    """Fixed scenarios resumed on another world size (2 -> 3, 3 -> 2, 2 -> 1; FSDP2; refused; 2 -> 3 -> 2) with
    UnevenJoin pass: two launches each (three chained), the reference replaying every run (docs/reliability.md,
    "Elastic resumption")."""
    scs = [fuzz.normalize(sc) for sc in ELASTIC]
    for given, sc in zip(ELASTIC, scs):
        assert all(sc.get(k) == v for k, v in given.items()), (given, sc)
    refused = [sc for sc in scs if fuzz.predicted_error(sc)]
    assert [sc['source'] for sc in refused] == ['len', 'nolen'], refused
    assert {(sc['world'], sc['resume_world']) for sc in scs} == {(2, 3), (3, 2), (2, 1)}
    problems = fuzz.run_many(scs, confirm=False)
    failed = {json.dumps(sc): p for sc, p in zip(scs, problems) if p}
    assert not failed, json.dumps(failed, indent=1)


def test_a_slice_of_fresh_seeds():
    seed = int(os.environ.get('COMPOSER_JOIN_FUZZ_SEED', str(int(time.time()) % 10**6)))
    print(f'scenario fuzz slice: seeds {seed}..{seed + SLICE - 1} ({fuzz.COMMAND} --seed {seed} --n {SLICE})')
    scs = [fuzz.draw(s) for s in range(seed, seed + SLICE)]
    scs = [sc for sc in scs if not fuzz.known_failure(sc)]  # each is a strict xfail below
    problems = fuzz.run_many(scs)
    failed = [f'{fuzz.reproduce(sc)}\n  {p[:3]}' for sc, p in zip(scs, problems) if p]
    assert not failed, 'failing seeds (add each to tests/fuzz_regressions.json):\n' + '\n'.join(failed)


def _regression(entry: dict):
    marks = [pytest.mark.xfail(strict=True, reason=entry['known_failure'])] if entry.get('known_failure') else []
    return pytest.param(entry, marks=marks, id=str(entry.get('seed', entry.get('name'))))


PASSING = [e for e in REGRESSIONS if not e.get('known_failure')]
KNOWN = [e for e in REGRESSIONS if e.get('known_failure')]


def scenario_of(entry: dict) -> dict:
    return fuzz.normalize(entry['scenario']) if 'scenario' in entry else fuzz.draw(entry['seed'])


@pytest.mark.skipif(not PASSING, reason='no fixed failures yet')
def test_fixed_failures_stay_fixed():
    scs = [scenario_of(e) for e in PASSING]
    problems = fuzz.run_many(scs)
    failed = [f'{fuzz.reproduce(sc)}: {p[:3]}' for sc, p in zip(scs, problems) if p]
    assert not failed, '\n'.join(failed)


@pytest.mark.parametrize('entry', [_regression(e) for e in KNOWN])
def test_known_failures(entry):
    sc = scenario_of(entry)
    problems = fuzz.run_many([sc])[0]
    assert not problems, f'{fuzz.reproduce(sc)}: {problems[:3]}'


def test_known_failures_are_recognised():
    for entry in KNOWN:
        assert fuzz.known_failure(scenario_of(entry)) == entry['name']


def test_reference_epochs_cover_the_data():
    """The reference's own schedules (shadow and rebalance; resumed on another world size too) load every id of an
    epoch once as the data holds it and train it as often as the transform leaves the data's batches (an epoch whose
    rest was batched anew with 'drop': at most as often as loaded)."""
    scs = [fuzz.draw(seed) for seed in range(100)] + [fuzz.draw(seed) for seed in fuzz.elastic_seeds(400000, 40)]
    for sc in scs:
        if sc['duration'][1] == 'ep' and not fuzz.predicted_error(sc):
            want = ref.train(sc)
            for epoch in range(sc['duration'][0]):
                loaded, trained = want['loaded'].get(epoch, {}), want['trained'].get(epoch, {})
                assert loaded == ref.expected_loaded(sc, epoch), sc
                if ref.regrouped(sc, epoch):
                    assert all(n <= loaded.get(i, 0) for i, n in trained.items()), sc
                else:
                    assert trained == ref.expected_counts(sc, epoch), sc


def test_reference_batches_the_rest_of_a_resumed_epoch_anew():
    """Resumed on another world size mid-epoch, the used samples are counted as the loader yielded them (before the
    batch transform), the rest is batched anew on the new world size, then transformed (docs/reliability.md,
    "Elastic resumption"): with 'drop' (a batch's last sample) other samples are dropped than the old batches would
    have (seed 401498 shrunk: 2 ranks resumed on 1 after epoch 1's first step; what the ranks trained, measured)."""
    sc = fuzz.normalize(next(e for e in REGRESSIONS if e['name'] == 'elastic-drop-transform-shrunk')['scenario'])
    assert ref.resumed_in(sc) == (1, 1) and ref.regrouped(sc, 1) and not ref.regrouped(sc, 0)
    old = [ref.rank_ids(sc, r, 1) for r in range(2)]
    assert old == [[7000, 7002, 7004, 7006], [7001, 7003, 7005, 7007]]
    assert ref.rest_ids(sc, 1, 1) == [[7006, 7007]]  # 3 used of each old shard, one rank
    want = ref.train(sc)
    assert want['steps'][2:] == [[[7000, 7002], [7001, 7003]], [[7006]]]  # [7006, 7007] through 'drop'
    assert want['loaded'][1] == ref.expected_loaded(sc, 1) == dict.fromkeys(old[0] + old[1], 1)
    assert 7007 in ref.expected_counts(sc, 1) and 7007 not in want['trained'][1]  # the old batch [7007] kept it


def test_reference_deals_a_chained_resumptions_rest_anew():
    """Chained (2 -> 3 -> 2): the resumed run's checkpoint inside the rest of the epoch it resumed is resumed again,
    what no rank of the second run had used of its share dealt over the third run's ranks (docs/reliability.md,
    "Elastic resumption": the layout is kept); by hand: 13 ids not shuffled, batches of 2."""
    sc = fuzz.normalize(
        dict(world=2, batch=2, source='exact', map_size=13, resume_at=1, resume_world=3, chain_at=2, chain_world=2)
    )
    assert (sc['resume_at'], sc['chain_at'], sc['chain_world']) == (1, 2, 2)
    assert ref.resumptions_in(sc) == [(0, 1, True), (0, 2, True)] and ref.final_world(sc) == 2
    # step 0 on 2 ranks; the rest [4, 6, 8, 10, 12, 5, 7, 9, 11] over 3; its first step used 2 of each share; the
    # rest of those shares [7], [9], [11] over 2
    steps = [[[i - 7000 for i in part] for part in step] for step in ref.train(sc)['steps']]
    assert steps == [[[0, 2], [1, 3]], [[4, 10], [6, 12], [5, 8]], [[7, 11], [9]]]
    # per-rank shard data: a chain from an epoch's last batch, the third run refused mid-epoch
    sc = dict(world=2, batch=1, shards=[2, 2, 1], duration=[2, 'ep'], resume_at=2, resume_world=3, chain_world=1)
    assert 'chain_world' not in fuzz.normalize(sc)  # no chain_at: no chain
    sc = fuzz.normalize({**sc, 'chain_at': 3})
    assert sc['chain_at'] == 3 and fuzz.predicted_error(sc) == 'UnevenInputsError'
    assert 'chain_world' not in fuzz.normalize({**sc, 'resume_at': 1})  # the second run refused: nothing to chain
    drawn = [fuzz.draw(s) for s in fuzz.chosen_seeds(610000, 20, {'chain_world': fuzz.ANY})]
    assert all(len(ref.resumptions_in(sc)) == 2 and fuzz.normalize(sc) == sc for sc in drawn)
    assert any(sc['chain_world'] == sc['world'] for sc in drawn) and any(fuzz.predicted_error(sc) for sc in drawn)
    small = fuzz.shrink(
        drawn[0], fails=lambda cands: [bool(c.get('chain_world')) for c in cands], rounds=100, log=lambda *a, **k: None
    )
    assert small['chain_world'] and small['resume_world'] and small['world'] == 2, small


def _head_model(use_extra: bool):
    """A stock ComposerModel whose ``extra`` head runs only with ``use_extra`` (Composer imported here: slowly)."""
    import torch
    from composer.models import ComposerModel

    class Model(ComposerModel):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Linear(4, 2)
            self.extra = torch.nn.Linear(4, 2)

        def forward(self, batch):
            return self.body(batch[0]) + (self.extra(batch[0]) if use_extra else 0)

        def loss(self, out, batch):
            return torch.nn.functional.cross_entropy(out, batch[1])

    return Model()


def _stock_fit(folder: Path, optimizer: str, use_extra: bool, load: bool) -> None:
    import torch
    from composer import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(1)
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    model = _head_model(use_extra)
    opt = (
        torch.optim.Adam(model.parameters(), lr=0.01)
        if optimizer == 'adam'
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=2),
        optimizers=opt,
        max_duration='2ba',
        device='cpu',
        save_folder=None if load else str(folder),
        save_interval='1ba',
        load_path=str(folder / 'ep0-ba1-rank0.pt') if load else None,
        progress_bar=False,
        log_to_console=False,
    )
    trainer.fit()
    trainer.close()


@pytest.mark.parametrize('optimizer', ['adam', 'sgd'])
def test_stock_cannot_load_a_checkpoint_before_a_parameters_first_gradient(tmp_path, optimizer):
    """Why the generator takes no checkpoint of the 'branch' model before its head's first gradient (seed 403094):
    stock Composer with torch.distributed.checkpoint, one process, no UnevenJoin, cannot load such a checkpoint
    (docs/limits.md). When this starts to pass, draw those checkpoints again."""
    import torch

    _stock_fit(tmp_path / 'unused', optimizer, use_extra=False, load=False)
    state = torch.load(tmp_path / 'unused' / 'ep0-ba1-rank0.pt', weights_only=False)['state']['optimizers']
    assert set(next(iter(state.values()))['state']) == {'body.weight', 'body.bias'}
    with pytest.raises(KeyError, match=r"'extra\.weight'"):
        _stock_fit(tmp_path / 'unused', optimizer, use_extra=False, load=True)
    _stock_fit(tmp_path / 'used', optimizer, use_extra=True, load=False)
    _stock_fit(tmp_path / 'used', optimizer, use_extra=False, load=True)  # its state saved: loads


def test_no_checkpoint_of_the_branch_model_before_its_heads_first_gradient():
    for seed in [*range(300), 403094]:
        sc = fuzz.draw(seed)
        if sc['model'] == 'branch' and sc.get('resume_at'):
            steps = ref.planned_steps({**sc, 'refit': False, 'resume_world': None, 'resume_at': None})
            labels = [int(ref.sample(i)[1]) for _, step in steps[: sc['resume_at']] for p in step if p for i, _ in p]
            assert 0 in labels, sc
    entry = next(e for e in REGRESSIONS if e['name'] == 'elastic-unused-adam-state')
    assert 'resume_at' not in scenario_of(entry) and 'resume_world' not in scenario_of(entry)
    assert 'resume_at' in fuzz.normalize({**entry['scenario'], 'map_size': 6})  # a label-0 sample in step 0 or 1
