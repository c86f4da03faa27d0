"""tests/rank_orders.py itself: a rotated scenario is the same scenario with other ranks in each role."""

from __future__ import annotations

from rank_orders import expand, rotate, rotations, with_rotations


def test_rotate_moves_every_per_rank_field_together():
    cfg = dict(
        shards=[40, 21, 0],
        eval_shards=[9, 4, 0],
        batch_sizes=[4, 3, 2],
        batch_plan=[[8, 8], [5], []],
        layout=['a', 'b', 'c'],
        claimed_len={1: 16},
        fail_at={0: 20},
        eval_fail_at={2: 6},
        unsized=[0, 2],
        oom=[dict(ranks=[0, 2], steps=[3], point='loss', limit=1)],
        batch_size=8,
    )
    out = rotate(cfg, 1)  # rank r's part goes to rank r + 1 (mod 3)
    assert out['shards'] == [0, 40, 21] and out['eval_shards'] == [0, 9, 4]
    assert (
        out['batch_sizes'] == [2, 4, 3] and out['batch_plan'] == [[], [8, 8], [5]] and out['layout'] == ['c', 'a', 'b']
    )
    assert out['claimed_len'] == {2: 16} and out['fail_at'] == {1: 20} and out['eval_fail_at'] == {0: 6}
    assert out['unsized'] == [0, 1]
    assert out['oom'] == [dict(ranks=[0, 1], steps=[3], point='loss', limit=1)]
    assert out['batch_size'] == 8 and cfg['shards'] == [40, 21, 0]  # the rest as it was, the original untouched
    assert rotate(dict(shards=[12, 6], unsized=True), 1)['unsized'] is True  # a flag, not a list of ranks


def test_batch_formats_and_claimed_lengths_move_with_their_ranks():
    cfg = dict(formats=[['tuple'] * 3, ['dict'], []], claimed=[None, 5, None])
    out = rotate(cfg, 2)  # rank r's part goes to rank r + 2 (mod 3)
    assert out['formats'] == [['dict'], [], ['tuple'] * 3] and out['claimed'] == [5, None, None]
    assert rotations(cfg) == [1, 2]  # the rank without batches to the middle and the first place
    assert rotations(dict(formats=[['tuple'], ['tuple']])) == []  # nothing would change
    settings = dict(per_rank=[{}, {'mode': 'rebalance'}, {}], shards=[16, 8, 4])
    assert rotate(settings, 1) == dict(per_rank=[{}, {}, {'mode': 'rebalance'}], shards=[4, 16, 8])


def test_cut_points_move_with_their_ranks():
    # rank r gets perm[cuts[r]:cuts[r + 1]]: 17, 2 and 8 samples
    assert rotate(dict(cuts=[0, 17, 19, 27]), 1)['cuts'] == [0, 8, 25, 27]  # 8, 17, 2
    assert rotations(dict(cuts=[0, 17, 19, 27])) == [2, 1]  # the 2-sample rank to the first and the last place


def test_rotations_put_the_shortest_rank_first_in_the_middle_and_last():
    for shards in ([20, 0, 13], [0, 13, 20], [13, 20, 0], [16, 9, 8, 1]):
        cfg = dict(shards=shards)
        short = shards.index(min(shards))
        places = {short} | {(short + k) % len(shards) for k in rotations(cfg)}
        assert {0, len(shards) - 1} <= places and places & set(range(1, len(shards) - 1))
    assert rotations(dict(shards=[8, 8, 8])) == []  # nothing would change
    # a tie on train data: the eval shards decide
    assert rotations(dict(shards=[8, 8], eval_shards=[8, 4])) == [1]


def test_expand_lists_each_scenario_before_its_rotations():
    scenarios = with_rotations({'a': dict(shards=[4, 2]), 'b': dict(shards=[3, 3]), 'ab': dict(shards=[1, 5])}, ['a'])
    assert expand(['a', 'b', 'ab'], scenarios) == ['a', 'a@1', 'b', 'ab']
