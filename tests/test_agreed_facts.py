"""Facts one rank learned decide collectives and take-backs on every rank alike (issue 46, cases 4 and 5).

* **Whether the forward communicates, learned once per trainer.** Under DDP a shadow microbatch runs no model code,
  so a forward that issues collectives (a module not marked ``shadow_forward``) is found by probing the first
  training forward of a fit. In a second ``fit()`` on a new loader where one rank has no sample, that rank runs no
  forward in this fit, so it cannot probe: what every rank learned in the first fit travels in the second fit's
  first agreement (:class:`~composer_join.core.settings.Facts` ``forward``), and every rank stops at step 0 with the
  documented :class:`~composer_join.UnevenInputsError`. Measured on the code before: a gloo abort
  (``212 vs 16``: the shadowing rank's DDP bucket all-reduce against the forward's all-reduce), no clear error.
* **The shadow's way after a resume.** With ``find_unused_parameters`` and ``toy.Branchy`` (``extra`` used by the
  short rank's label-0 samples only), a run resumed from a checkpoint saved after the short rank's data ended: that
  rank has seen no loss of the model in this process, so its first shadow microbatch runs the model on the template,
  which reaches ``extra``; every rank knows it from the fit's first agreement (``Facts`` ``fresh``) and takes the
  unused gradients back on that step. Measured on the code before: ``extra`` got a zero gradient, and momentum moved
  it 2.6e-3 away from the uninterrupted run, silently.

Both with the short (or empty) rank first and last; the resumed run must equal the uninterrupted one and a
single-process replay of the steps (``test_unused_parameters.replay``, no composer_join) to 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import RankError, launch
from reference import max_abs_diff
from test_unused_parameters import replay

TOL = 1e-6
# a first fit on even shards (no rank shadows: it trains), then one where the empty rank shadows from step 0
SECOND_FIT = {f'second_fit@empty{e}': dict(first=[16, 16], second=[16, 0] if e == 1 else [0, 16]) for e in (0, 1)}
# 4 steps per epoch; the short rank's 6 samples end at step 1: batch 3's checkpoint is after that
RESUME = {
    'resume@short1': dict(shards=[16, 6], short=1, resume_at=3),
    'resume@short0': dict(shards=[6, 16], short=0, resume_at=3),
    'resume@short1_epoch1': dict(shards=[16, 6], short=1, resume_at=7),
}


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    calls = [
        (name, 'scenarios_agreed_facts:resume', {'cfg': cfg, 'folder': str(tmp_path_factory.mktemp(name))})
        for name, cfg in RESUME.items()
    ]
    calls += [('stock_branchy', 'scenarios_agreed_facts:stock', {'cfg': RESUME['resume@short1']})]
    stock = {**SECOND_FIT['second_fit@empty1'], 'join': False}
    calls += [('stock_second_fit', 'scenarios_agreed_facts:second_fit', {'cfg': stock})]
    calls += [(name, 'scenarios_agreed_facts:second_fit', {'cfg': cfg}) for name, cfg in SECOND_FIT.items()]
    return launch(2, calls, timeout=300)


def ok(runs: dict, name: str) -> list[dict]:
    per_rank = runs[name]
    errors = [f'rank {r}: {e}' for r, e in enumerate(per_rank) if isinstance(e, RankError)]
    assert not errors, f'{name} failed: ' + '; '.join(errors)
    package = str(ROOT / 'composer_join')
    for res in per_rank:  # composer_join from this checkout in the ranks too (a stock run says nothing)
        assert res.get('module', package).startswith(package), res.get('module')
    return per_rank


@pytest.mark.parametrize('name', list(SECOND_FIT))
def test_a_rank_that_cannot_probe_uses_what_the_others_learned(runs, name):
    per_rank = ok(runs, name)
    for rank, res in enumerate(per_rank):
        first, second = res['errors']
        assert first is None, f'{name}: rank {rank}: the first fit (even shards) raised: {first}'
        assert second is not None and not second.startswith('not UnevenInputsError'), (
            f'{name}: rank {rank}: the second fit ended with {second!r}, not the UnevenInputsError'
        )
        assert 'issues collectives' in second and 'all_reduce' in second, second
        steps, seconds = res['steps'][1]  # (reset_time: the second fit counts from 0)
        assert steps == 0, f'{name}: rank {rank} trained {steps} steps'
        assert seconds < 30, f'{name}: rank {rank} took {seconds:.0f} s to stop'


def test_stock_second_fit(runs):
    """The stock column: Composer alone stops every epoch at the shortest rank, so the second fit trains none of the
    16 samples, silently (measured: no error, 0 steps)."""
    per_rank = ok(runs, 'stock_second_fit')
    print('stock second fit:', [(res['errors'], res['steps']) for res in per_rank])
    assert all(res['errors'] == [None, None] and res['steps'][1][0] == 0 for res in per_rank)


@pytest.mark.parametrize('name', list(RESUME))
def test_a_resumed_run_equals_the_uninterrupted_one_and_one_process(runs, name):
    cfg = RESUME[name]
    per_rank = ok(runs, name)
    full_steps = [res['full']['steps'] for res in per_rank]
    assert any(not s[cfg['resume_at']] for s in full_steps), f'{name}: no rank shadows at the resumed step'
    expected = replay(cfg, full_steps)
    for rank, res in enumerate(per_rank):
        full = max_abs_diff(res['full']['params'], expected)
        assert full < TOL, f'{name}: rank {rank}: the uninterrupted run is {full:.2e} from one process'
        resumed = max_abs_diff(res['resumed']['params'], res['full']['params'])
        gap = max_abs_diff(res['resumed']['params'], expected)
        assert resumed < TOL and gap < TOL, (
            f'{name}: rank {rank}: the resumed run is {resumed:.2e} from the uninterrupted one, {gap:.2e} from one '
            f'process'
        )


def test_stock_branchy(runs):
    """The stock column: Composer alone stops every epoch at the short rank (12 of 44 samples of 2 epochs)."""
    per_rank = ok(runs, 'stock_branchy')
    cfg = RESUME['resume@short1']
    expected = replay(cfg, [res['steps'] for res in per_rank])  # the steps it did train, in one process
    gap = max_abs_diff(per_rank[0]['params'], expected)
    print(f'stock: {per_rank[0]["samples"]} of {2 * sum(cfg["shards"])} samples trained; {gap:.2e} from its replay')
    assert per_rank[0]['samples'] < 2 * sum(cfg['shards'])


def test_the_facts_round_trip_and_decide_alike_in_one_process():
    """No ranks: a probe's finding encodes into the row and back; fresh ranks count at the fit's first step only."""
    import torch

    from composer_join.core.plan import RankStatus, StepPlan
    from composer_join.core.settings import Facts, check, row
    from composer_join.shadow.shadow import ForwardProbe
    from composer_join.wrappers.ddp import FreshRanks

    probe, other = ForwardProbe(torch.nn.Linear(2, 2)), ForwardProbe(torch.nn.Linear(2, 2))
    assert probe.fact() == 0  # never probed
    probe.learned, other.learned = frozenset({'all_reduce', 'broadcast'}), frozenset()
    facts = [Facts(forward=probe.fact()), Facts(forward=other.fact(), fresh=True)]
    settings = row(True, 'shadow', False, True)
    every = check([settings + f.row() for f in facts])
    assert every == facts
    other.arm()
    other.agree([f.forward for f in every])
    assert other.communicates == ['all_reduce', 'broadcast'] and other.fact() == 1  # probed, found nothing itself
    fresh = FreshRanks()
    fresh.agree(every, step=3)
    shadow1 = StepPlan(0, (RankStatus(True, 4, 1), RankStatus(False, 0, 1)))
    fresh.start_step(shadow1, 3)
    assert fresh.now
    fresh.start_step(shadow1, 4)  # after the fit's first step every rank has seen a loss
    assert not fresh.now
