"""The checkpoint entries of a global-order sampler's positions (issue 48), in process: the compact form and the old.

A checkpoint holds the sampler's description once, in rank 0's entry (with the layout of an epoch resumed
elastically), and ``{'order_of': 0}`` in every other rank's; each rank gives the gather its description as a tuple
and no layout (``all_gather_object`` pads every entry to the largest). Checked without ranks:

* the entries kept after a simulated gather of 4 ranks are the compact form, and through ``snapshot`` and
  ``restore`` (pickled as a checkpoint) resume the rest of the epoch on 2, 3 and 5 ranks with the same indices as
  the entries the code before this form made (every rank's description, the layout in rank 0's), which are the
  samples no old rank had used;
* ranks whose samplers differ keep each its own description, and the rest of the epoch is refused (None), in both
  forms; ``rest_of_epoch`` takes the compact form up (a state of the resumed run, simulated);
* ``RankPositions.gather`` on one rank keeps the compact form, and what the adapter gives the gather is small.
"""

from __future__ import annotations

import pickle
from dataclasses import asdict, astuple, replace
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from torch.utils.data import DataLoader

from composer_join import ExactDistributedSampler
from composer_join.core.layout import Layout
from composer_join.data import elastic
from composer_join.data.elastic import GlobalOrder, GlobalOrderPosition, layout_of, orders_of, remaining_for
from composer_join.data.resume import Progress, RankPositions, restore, snapshot
from composer_join.join.fitdata import rest_of_epoch

ORDER = GlobalOrder('exact', 29, True, 5, False, 0)
OLD, EPOCH = 4, 1


def gathered(order_of: Any, used: list[int], layout: Any = None) -> list[dict[str, Any]]:
    """Every rank's entry as ``RankPositions.gather`` gathers it (pickled as ``all_gather_object`` does), then kept."""
    positions = [GlobalOrderPosition(None, None, order_of(r), layout) for r in range(len(used))]
    entries = [
        pickle.loads(pickle.dumps({'trained': u, 'used': u, 'sent': 0, 'ended': False, 'dataset': p.save(u)}))
        for p, u in zip(positions, used)
    ]
    return positions[0].kept(entries)


def old_form(used: list[int], layout: Any = None) -> list[dict[str, Any]]:
    """The entries as the code before the compact form kept them: every rank's description, the layout in rank 0's."""
    return [
        {
            'trained': u,
            'used': u,
            'sent': 0,
            'ended': False,
            'dataset': {'order': asdict(ORDER), **({'layout': layout} if r == 0 else {})},
        }
        for r, u in enumerate(used)
    ]


def through_checkpoint(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    state = snapshot([], None, {}, ranks=entries)
    ranks = restore(pickle.loads(pickle.dumps(state, protocol=2))).ranks
    assert ranks is not None
    return ranks


USED = [3, 0, 7, 5]


def test_the_checkpoint_holds_the_description_once_and_resumes_as_the_old_form_did():
    kept = gathered(lambda r: ORDER, USED)
    assert kept[0]['dataset'] == {'order': asdict(ORDER), 'layout': None}
    assert [e['dataset'] for e in kept[1:]] == [{'order_of': 0}] * (OLD - 1)
    assert [e['used'] for e in kept] == USED
    compact, old = through_checkpoint(kept), through_checkpoint(old_form(USED))
    assert orders_of(compact) == orders_of(old) == [asdict(ORDER)] * OLD
    left = [i for r in range(OLD) for i in ORDER.shard(OLD, r, EPOCH)[USED[r] :]]
    for world in (2, 3, 5):
        shares = [remaining_for(compact, ORDER, EPOCH, world, r) for r in range(world)]
        assert shares == [remaining_for(old, ORDER, EPOCH, world, r) for r in range(world)]
        assert sorted(i for s in shares for i in s) == sorted(left)


def test_an_epoch_resumed_elastically_keeps_its_layout_in_rank_0s_entry_only_and_resumes_again():
    layout = layout_of(old_form(USED))  # the rest of the epoch resumed on 3 ranks from 4
    kept = gathered(lambda r: ORDER, [2, 1, 0], layout)
    assert GlobalOrderPosition(None, None, ORDER, layout).save(2) == astuple(ORDER)  # no layout in the gather
    assert kept[0]['dataset'] == {'order': asdict(ORDER), 'layout': layout}
    assert [e['dataset'] for e in kept[1:]] == [{'order_of': 0}] * 2
    compact, old = through_checkpoint(kept), through_checkpoint(old_form([2, 1, 0], layout))
    assert layout_of(compact) == layout_of(old)
    for world in (2, 3, 4):
        shares = [remaining_for(compact, ORDER, EPOCH, world, r) for r in range(world)]
        assert shares == [remaining_for(old, ORDER, EPOCH, world, r) for r in range(world)]
        rest = [elastic.shard_of(ORDER, layout, 3, r, EPOCH)[u:] for r, u in enumerate([2, 1, 0])]
        assert sorted(i for s in shares for i in s) == sorted(i for part in rest for i in part)


@pytest.mark.parametrize('form', ['compact', 'old'])
def test_ranks_whose_samplers_differ_are_refused(form):
    other = replace(ORDER, seed=6)
    if form == 'compact':
        entries = gathered(lambda r: other if r == 2 else ORDER, USED)
        assert entries[2]['dataset'] == {'order': asdict(other)}
        assert entries[1]['dataset'] == {'order': asdict(ORDER)}  # no rank's entry says "rank 0's"
    else:
        entries = old_form(USED)
        entries[2]['dataset'] = {'order': asdict(other)}
    entries = through_checkpoint(entries)
    for order in (ORDER, other):
        assert remaining_for(entries, order, EPOCH, 3, 0) is None
    # an entry naming no entry, or naming one that names another, describes nothing
    for bad in ({'order_of': OLD}, {'order_of': 1}):
        compact = gathered(lambda r: ORDER, USED)
        compact[2]['dataset'] = bad
        if bad == {'order_of': 1}:
            compact[1]['dataset'] = {'order_of': 2}
        assert remaining_for(compact, ORDER, EPOCH, 3, 0) is None


def _resumed_state(world: int, rank: int, batch_in_epoch: int) -> Any:
    sampler = ExactDistributedSampler(range(ORDER.size), num_replicas=world, rank=rank, shuffle=True, seed=5)
    timestamp = SimpleNamespace(epoch=EPOCH, batch=10, batch_in_epoch=batch_in_epoch, sample_in_epoch=7)
    return SimpleNamespace(
        train_dataloader=DataLoader(range(ORDER.size), sampler=sampler, batch_size=2),
        timestamp=timestamp,
        dataloader_len=None,
        dataset_resumption={},
        serialized_attributes=['dataset_state'],
    )


@pytest.mark.parametrize('form', ['compact', 'old'])
def test_rest_of_epoch_takes_both_forms_up(form):
    entries = gathered(lambda r: ORDER, USED) if form == 'compact' else old_form(USED)
    resumed = restore(pickle.loads(pickle.dumps(snapshot([], None, {}, ranks=entries), protocol=2)))
    resumed.world_size = OLD
    shares: list[list[int]] = []
    for rank in range(3):
        state = _resumed_state(3, rank, batch_in_epoch=2)
        with (
            mock.patch('composer.utils.dist.get_world_size', return_value=3),
            mock.patch('composer.utils.dist.get_global_rank', return_value=rank),
        ):
            rest = rest_of_epoch(state, resumed, Layout.flat(3), range(ORDER.size))
        assert rest is not None and rest.indices is not None
        assert rest.order == ORDER and rest.layout == layout_of(old_form(USED))
        shares.append(rest.indices)
    left = [i for r in range(OLD) for i in ORDER.shard(OLD, r, EPOCH)[USED[r] :]]
    assert sorted(i for s in shares for i in s) == sorted(left)


def test_rank_positions_gather_keeps_the_compact_form():
    state = _resumed_state(1, 0, batch_in_epoch=2)
    layout = layout_of(old_form(USED))
    positions = RankPositions(state, GlobalOrderPosition(None, None, ORDER, layout))
    positions.gather(Progress(trained=4, used=4, sent=0, ended=False))
    entries, unsaved = positions.entries()
    assert not unsaved and entries == [
        {'trained': 4, 'used': 4, 'sent': 0, 'ended': False, 'dataset': {'order': asdict(ORDER), 'layout': layout}}
    ]
    sent = {'trained': 4, 'used': 4, 'sent': 0, 'ended': False, 'dataset': positions.position.save(4)}
    assert len(pickle.dumps(sent)) < 100  # the layout is not gathered: every rank's entry is a few values
