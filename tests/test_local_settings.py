"""Ranks whose own settings differ: every collective UnevenJoin issues is gated by facts every rank agreed on.

Issue 40, part 4. Which of UnevenJoin's collectives run was decided on some paths by a rank's own objects: the
per-rank positions were gathered at a checkpoint where this rank's position adapter resumes itself (chosen from its
``num_workers``, its shuffle buffer, its sampler, its dataset's class), the length agreement of an evaluation or a
``predict()`` was skipped where this rank's sampler repeats samples, the counts were re-gathered at
``AFTER_DATALOADER`` where another algorithm matched on this rank, and ``UnevenJoin.state_dict()`` gathered the
positions wherever it was called. Measured on 0.x before the fix (``TORCH_DISTRIBUTED_DEBUG=DETAIL``): each
scenario below hangs until the collective timeout, or stops with torch's "Detected mismatch between collectives".

Now (docs/how-it-works.md, "The collectives, and what decides them"):

* **the position adapter** is agreed in the fit's first agreement: where the ranks' kinds differ, every rank's data
  is replayed (Composer spins the epoch, its rank-0 ``dataset_state`` is left out) and rank 0 warns; the runs are
  exact, resumed or not (rows ``workers``, ``shuffle``, ``sampler``, ``composer_state``; ``persistent``, persistent
  workers on one rank only, decides nothing and was exact before too);
* **an evaluation or a ``predict()``** whose dataloader repeats samples on some ranks only stops every rank at its
  start with an :class:`~composer_join.UnevenInputsError` naming those ranks (``repeats``);
* **the counts at ``AFTER_DATALOADER``** are re-gathered on every step where some rank's trainer has another
  algorithm (agreed in the first agreement), whatever each matches (``others_on_odd_rank``,
  ``others_match_on_odd_rank``);
* **shadow microbatches** that would run differently (a module marked ``shadow_forward = True`` on one rank: its
  shadow microbatches run the forward on zero samples, the others' run no model code) stop every rank at
  ``FIT_START`` naming the ranks and ways (``marked``);
* **``UnevenJoin.state_dict()``** is not collective: the positions are gathered at Composer's checkpoint events and
  at ``FIT_END``, on every rank; called alone, it holds none and says so (``state_dict_alone``); a checkpoint saved
  elsewhere mid-epoch does not resume silently wrong: every rank stops with the cause (``saved_elsewhere``).

And an error that names the real cause (``left_to_composer``): a per-rank dataset of Composer's protocol that is
not registered is left to Composer, which loads rank 0's position into every rank; the resumed ranks run short,
and every rank's error now says that the position was left to Composer and names ``register_position``.

Every scenario runs twice, the odd rank first and last (``@0``, ``@1``), in one 2-rank launch under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` with a short collective timeout, so that a hang fails fast. The exact rows are
checked by the data-pipeline matrix's own check (``test_pipelines.check_exact``: every id once per epoch, replicas
identical, weights equal to a single-process replay of the recorded steps, evaluations, ``predict()``, and the
resumed run equal to the uninterrupted one).
"""

from __future__ import annotations

import pytest

from harness import RankError, launch
from test_join_core import ok
from test_pipelines import BASE, HF_EVAL_FILES, HF_FILES, W2, check_exact

WORLD = 2
HF = dict(BASE, data='hf_iterable', sizes=HF_FILES, eval_sizes=HF_EVAL_FILES, resume_at=2, max_duration='6ba')
IDS = dict(BASE, data='iterable_exact', sizes=[10, 5], resume_at=2)
EXACT: dict[str, dict] = {
    # Hugging Face IterableDataset: its own position with num_workers=0, replayed with workers (the case)
    'workers': dict(HF, odd=W2),
    # ... replayed with a shuffle buffer
    'shuffle': dict(HF, odd=dict(shuffle_buffer=4)),
    # persistent workers on one rank: replayed on both (decides no collective)
    'persistent': dict(HF, **W2, odd=dict(persistent=True, prefetch=4)),
    # a DistributedSampler of its own on one rank (a global order, gathered for elastic resumption); none elsewhere
    'sampler': dict(IDS, odd=dict(data='own_sampler')),
    # a dataset of Composer's protocol, not registered (Composer's rank-0 dataset_state), on one rank
    'composer_state': dict(IDS, odd=dict(data='composer_protocol')),
    # an algorithm at AFTER_DATALOADER in one rank's trainer only; one in every trainer, matching on one rank
    'others_on_odd_rank': dict(IDS, others='odd_rank'),
    'others_match_on_odd_rank': dict(IDS, others='odd_match'),
    # one rank calls State.state_dict() alone after every batch; data that keeps its own position
    'state_dict_alone': dict(HF, state_dict_alone=True),
}
LEFT_TO_COMPOSER = dict(BASE, data='composer_protocol', sizes=[8, 12], resume_at=1)
SAVED_ELSEWHERE = dict(HF, resume_at=None)
ODD = (0, WORLD - 1)


@pytest.fixture(scope='module')
def runs(tmp_path_factory, monkeypatch_module) -> dict:
    folder = str(tmp_path_factory.mktemp('local'))
    monkeypatch_module.setenv('TORCH_DISTRIBUTED_DEBUG', 'DETAIL')
    calls = [('debug_level', 'scenarios_detail:debug_level', {})]
    calls += [
        (
            'left_to_composer',
            'scenarios_local_settings:left_to_composer',
            dict(name='ltc', cfg=LEFT_TO_COMPOSER, folder=folder),
        ),
        (
            'saved_elsewhere',
            'scenarios_local_settings:saved_elsewhere',
            dict(name='se', cfg=SAVED_ELSEWHERE, folder=folder),
        ),
    ]
    calls += [(f'repeats@{odd}', 'scenarios_local_settings:repeats', dict(odd=odd)) for odd in ODD]
    calls += [(f'marked@{odd}', 'scenarios_local_settings:marked', dict(odd=odd, cfg=IDS)) for odd in ODD]
    calls += [
        (f'{name}@{odd}', 'scenarios_local_settings:case', dict(name=f'{name}{odd}', cfg=cfg, folder=folder, odd=odd))
        for name, cfg in EXACT.items()
        for odd in ODD
    ]
    return launch(WORLD, calls, timeout=900, collective_timeout=20)


@pytest.fixture(scope='module')
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_launch_ran_under_detail(runs):
    assert runs['debug_level'] == ['DETAIL'] * WORLD


@pytest.mark.parametrize('odd', ODD)
@pytest.mark.parametrize('name', list(EXACT))
def test_ranks_with_different_local_settings_train_exactly(runs, name, odd):
    cfg = EXACT[name]
    results = [r['case'] for r in ok(runs, f'{name}@{odd}')]
    check_exact(f'{name}@{odd}', cfg, results)
    if 'odd' in cfg and name != 'persistent':  # the ranks' kinds differ: every rank replays
        assert [r['full']['position'] for r in results] == ['Replay'] * WORLD, name
    if cfg.get('others'):  # the other algorithm ran where it matched (and only there)
        applied = [r['applied'] for r in ok(runs, f'{name}@{odd}')]
        assert applied[odd] > 0 and sum(applied) == applied[odd], applied


@pytest.mark.parametrize('odd', ODD)
def test_state_dict_called_on_one_rank_alone_holds_no_positions_and_says_so(runs, odd):
    entries = ok(runs, f'state_dict_alone@{odd}')[odd]['state_dict_alone']
    assert entries and all(e == {'ranks': None, 'positions_unsaved': True} for e in entries), entries


@pytest.mark.parametrize('odd', ODD)
def test_a_sampler_that_repeats_samples_on_some_ranks_only_stops_every_rank(runs, odd):
    for what in ('eval', 'predict'):
        for rank, res in enumerate(runs[f'repeats@{odd}']):
            message = res[what] if isinstance(res, dict) else res
            assert isinstance(message, str), (what, rank, message)
            assert f'rank(s) [{odd}]' in message and 'ExactDistributedSampler' in message, (what, rank, message)


@pytest.mark.parametrize('odd', ODD)
def test_a_model_whose_shadow_microbatches_run_differently_on_some_ranks_stops_every_rank(runs, odd):
    for rank, message in enumerate(ok(runs, f'marked@{odd}')):
        assert message is not None and 'shadow_forward' in message, (rank, message)
        assert f"'zero' on rank(s) [{odd}]" in message and f"'skip' on rank(s) [{1 - odd}]" in message, message


def test_data_left_to_composer_that_runs_short_names_register_position(runs):
    results = ok(runs, 'left_to_composer')
    for rank, res in enumerate(results):
        assert res['error'] is not None, rank
        assert 'left to Composer' in res['error'] and 'register_position' in res['error'], (rank, res['error'])
    [warning] = results[0]['warnings']  # the start's warning, on rank 0
    assert 'register_position' in warning and "rank 0's" in warning, warning
    assert results[1]['warnings'] == []


def test_a_checkpoint_saved_outside_the_checkpoint_events_does_not_resume_silently(runs):
    for rank, res in enumerate(ok(runs, 'saved_elsewhere')):
        assert res['error'] is not None and 'state_dict()' in res['error'], (rank, res)
        assert res['warnings'], rank


def test_errors_are_rank_errors_not_hangs(runs):
    # every call of the launch came back (a hang would have failed the launch); none as a torch error
    for name, per_rank in runs.items():
        for rank, res in enumerate(per_rank):
            assert not (isinstance(res, RankError) and 'mismatch' in res.message.lower()), (name, rank, res)


def test_the_agreement_replays_every_rank_where_the_kinds_differ(recwarn):
    # in one process (rank 0): the adapter as it is where every rank's kind is the same, a Replay of the same target
    # where they differ (rank 0 warns, naming each rank's kind), an error for the rest of an elastic epoch on some
    # ranks only; rebalancing without len() replays what would resume itself
    from composer_join import UnevenInputsError
    from composer_join.data.positions import Kind, Replay, SampleCountPosition, agreed_position

    data = object()
    own = SampleCountPosition(data, None)
    assert agreed_position(own, [Kind.OWN, Kind.OWN], None, data) is own
    assert not recwarn.list
    replayed = agreed_position(own, [Kind.OWN, Kind.REPLAY], None, data)
    assert isinstance(replayed, Replay) and replayed.target is data
    [warning] = recwarn.list
    assert 'rank(s) [0]: its own position; rank(s) [1]: replayed' in str(warning.message), warning
    none = agreed_position(None, [Kind.NONE, Kind.GLOBAL_ORDER], None, data)  # dataset_state left out on every rank
    assert isinstance(none, Replay) and none.target is data
    with pytest.raises(UnevenInputsError, match='another world size'):
        agreed_position(None, [Kind.REST, Kind.NONE], None, data)
    assert isinstance(agreed_position(own, [Kind.OWN] * 2, None, data, replay=True), Replay)


def test_the_first_agreement_returns_every_ranks_facts_and_stops_on_those_that_cannot_differ():
    from composer_join import UnevenInputsError
    from composer_join.core.settings import Facts, check, row

    settings = row(True, 'shadow', False, True)
    facts = [Facts(others=1, position=2), Facts(others=0, position=3)]
    assert check([settings + f.row() for f in facts]) == facts  # others and position: for the caller to decide
    repeats = [Facts(repeats=True), Facts()]
    with pytest.raises(UnevenInputsError, match=r"eval dataloader of rank\(s\) \[0\] shards with torch's"):
        check([settings + f.row() for f in repeats], 'eval')
    assert check([settings + Facts(repeats=True).row()] * 2, 'eval') == [Facts(repeats=True)] * 2
    with pytest.raises(UnevenInputsError, match=r"'template' on rank\(s\) \[1\]"):
        check([settings + Facts(shadow=1).row(), settings + Facts(shadow=3).row()])
