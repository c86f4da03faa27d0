"""Evaluators and trainers are told apart by identity, never by label or first match (issue 46, cases 2 and 6).

2 ranks, the short (or empty) rank first and last, one launch (:mod:`scenarios_identity`), every result compared with
the single-process reference :func:`toy_seq.reference` (which does not import composer_join) to 1e-6:

* **An evaluation's DataSpec found by label** (``evals``): a Trainer built with its own ``eval_dataloader`` X fits,
  then ``trainer.eval(eval_dataloader=Y)`` evaluates Y, on which the short rank has no sample; both evaluators are
  labelled ``'eval'`` and Composer appends Y's after X's. Measured on the code before: UnevenJoin took X's
  evaluator and ``DataSpec`` for Y, so its shadow split was on X's and Y's zero-sample batch reached Composer's own
  ``split_batch``: ``ValueError: range() arg 3 must not be zero`` on the empty rank, the other waiting in a collective until gloo's
  timeout. ``evals_sizes``: the two
  evaluators with different ``device_eval_microbatch_size``. Stock Composer (``stock_evals``): no error, but it
  trains 8 of the 14 samples of A (the shortest rank's one batch per rank), evaluates 7 of X's 12 and none of Y's
  7 (``MeanLoss`` nan).
* **One UnevenJoin in two Trainers** (``trainers``): calls on two Trainers that share one ``UnevenJoin`` object,
  interleaved (fit, fit, eval, fit). Measured on the code before: the run was bound to the first Trainer's ``State``;
  the second trained unjoined and raised ``UnevenInputsError: rank(s) [] could not form batch of epoch 0``. Each
  Trainer must equal a fresh single-process reference of its own calls, its checkpoint entry (its own
  ``State.state_dict()``) hold its own epochs' reports, and ``is_shadow_step(state)`` say what its own rank did.
  Stock (``stock_trainers``): each fit trains only the shortest rank's batches (8 of 14 samples of A, 6 of 11 of B,
  none of B0's 9), and evaluates 7 of X's 12.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness import launch
from scenarios_learned import BATCH, DATA, per_rank
from test_join_core import ok
from toy_seq import reference

TOL = 1e-6
EVALS = {'train': 'A', 'own': 'X', 'other': 'Y'}
CALLS = [(0, 'fit A'), (1, 'fit B'), (1, 'eval X'), (0, 'fit B0')]
SCENARIOS = {
    **{f'evals@short{s}': ('two_evals', {**EVALS, 'short': s, 'join': True}) for s in (0, 1)},
    **{f'evals_sizes@short{s}': ('two_evals', {**EVALS, 'short': s, 'join': True, 'sizes': (1, 3)}) for s in (0, 1)},
    **{f'trainers@short{s}': ('two_trainers', {'calls': CALLS, 'short': s, 'join': True}) for s in (0, 1)},
    'stock_evals@short0': ('two_evals', {**EVALS, 'short': 0, 'join': False}),
    'stock_trainers@short0': ('two_trainers', {'calls': CALLS, 'short': 0, 'join': False}),
}
WORKTREE = str(Path(__file__).resolve().parent.parent / 'composer_join')


@pytest.fixture(scope='module')
def runs() -> dict:
    calls = [(name, f'scenarios_identity:{fn}', {'cfg': cfg}) for name, (fn, cfg) in SCENARIOS.items()]
    return launch(2, calls, timeout=400)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _compare(where: str, got: dict, want: dict) -> float:
    """Assert one call's result equals the reference's; return the largest difference."""
    if 'params' in want:
        assert len(got['train_tokens']) == len(want['train_tokens']), where
        diffs = [_diff(a, b) for a, b in zip(got['train_tokens'], want['train_tokens'])]
        diffs += [_diff(got['params'][k], want['params'][k]) for k in want['params']]
    else:
        diffs = [_diff(got['Tokens'], want['Tokens']), abs(got['MeanLoss'] - want['MeanLoss'])]
    assert max(diffs) < TOL, f'{where}: {max(diffs):.2e} from the reference'
    print(f'{where}: max |diff| {max(diffs):.1e}')
    return max(diffs)


def _check(name: str, plans: list[list[tuple[str, str]]], order: list[int], res: dict, rank: int) -> float:
    """The results of ``res`` (calls of the trainers ``order``) against each trainer's reference ``plans``."""
    short = SCENARIOS[name][1]['short']
    expected = [iter(reference([(k, per_rank(d, short)) for k, d in plan], BATCH)) for plan in plans]
    assert res['error'] is None, f'{name}: rank {rank}, call {res["error"][0]}: {res["error"][1]}'
    assert res['composer_join'].startswith(WORKTREE), res['composer_join']
    assert len(res['results']) == len(order)
    return max(
        _compare(f'{name}: rank {rank}, call {i}', got, next(expected[t]))
        for i, (t, got) in enumerate(zip(order, res['results']))
    )


@pytest.mark.parametrize('name', [n for n in SCENARIOS if n.startswith('evals')])
def test_an_evaluation_uses_the_evaluator_that_holds_its_dataloader(runs, name):
    cfg = SCENARIOS[name][1]
    plan = [('fit', 'A'), ('eval', 'X'), ('eval', 'Y'), ('eval', 'X')]
    for rank, res in enumerate(ok(runs, name)):
        assert _check(name, [plan], [0] * len(plan), res, rank) < TOL
        assert res['results'][0]['samples'] == sum(DATA[cfg['train']][2])  # every sample of A trained


@pytest.mark.parametrize('name', [n for n in SCENARIOS if n.startswith('trainers')])
def test_two_trainers_sharing_one_uneven_join_each_equal_a_fresh_reference(runs, name):
    cfg = SCENARIOS[name][1]
    plans: list[list[tuple[str, str]]] = [[], []]
    for t, call in cfg['calls']:
        kind, data = call.split()
        plans[t].append((kind, data))
    order = [t for t, _ in cfg['calls']]
    for rank, res in enumerate(ok(runs, name)):
        assert _check(name, plans, order, res, rank) < TOL
        # each Trainer's own checkpoint entry: its own epochs, every rank's real samples
        for t, plan in enumerate(plans):
            fits = [data for kind, data in plan if kind == 'fit']
            want = [[len(s) for s in per_rank(data, cfg['short'])] for data in fits]
            assert res['reports'][t] == want, f'{name}: rank {rank}, trainer {t}'
        # is_shadow_step(state): this rank shadows exactly the steps after its own last batch
        fits = [(t, call.split()[1]) for t, call in cfg['calls'] if call.startswith('fit')]
        for (t, data), got in zip(fits, [r for r in res['results'] if 'shadow' in r]):
            mine, steps = (
                -(-len(s) // BATCH)
                for s in (per_rank(data, cfg['short'])[rank], max(per_rank(data, cfg['short']), key=len))
            )
            assert got['shadow'] == [step >= mine for step in range(steps)], f'{name}: rank {rank}, fit {data}'


def test_the_stock_column(runs):
    """What stock Composer does in the same scenarios (no UnevenJoin): it runs, and drops data silently."""
    for res in ok(runs, 'stock_evals@short0'):
        assert res['error'] is None, res['error']
        assert res['results'][0]['samples'] == 8  # of 14: one batch per rank, the short rank's only one
        assert res['results'][1]['Tokens'].shape[0] == 7  # X at the fit's end: 7 of 12 samples
        assert res['results'][2]['Tokens'].shape[0] == 0  # Y: none of its 7 samples (MeanLoss nan)
    for res in ok(runs, 'stock_trainers@short0'):
        assert res['error'] is None, res['error']
        assert [r['samples'] for r in res['results'] if 'samples' in r] == [
            8,
            6,
            0,
        ]  # A: 8 of 14, B: 6 of 11, B0: 0 of 9
        assert res['results'][2]['Tokens'].shape[0] == 7  # X: 7 of 12 samples evaluated


def test_a_checkpoint_goes_to_the_trainer_whose_state_loads_it():
    """:class:`composer_join.join.runs.Runs` alone (no ranks): a checkpoint loaded by one Trainer's ``State`` waits for
    that Trainer's first start, never goes to another Trainer's run; saved entries are per ``State``."""
    from composer_join.data.resume import restore
    from composer_join.join.runs import Runs

    first, second, run = object(), object(), SimpleNamespace(reports=['first epoch'])
    runs = Runs()
    runs.add(first, run, None)  # the first Trainer started (active)
    resumed = restore({'reports': []})
    assert runs.load(second, resumed) is None  # the second Trainer's checkpoint: not the first's run
    assert runs.saved_by(first) == (run, None) and runs.reports(first) == ['first epoch']
    assert runs.take_pending(first) is None  # the first Trainer does not take it
    assert runs.saved_by(second) == (None, resumed)  # its own checkpoint entry, before it starts
    assert runs.take_pending(second) is resumed
    runs.add(second, None, resumed)  # inactive for it: its entry stays what the checkpoint gave
    assert runs.of(second) is None and runs.saved_by(second) == (None, resumed)
    assert runs.load(first, resumed) is run  # the first Trainer's run takes its own
    assert runs.current is None and runs.of(first) is run and runs.current is run
