"""Every change UnevenJoin makes to an object it does not own is undone, also when the run raises (issue 34).

A ``fit()`` with UnevenJoin on 2 ranks stops half-way: a rank's dataset raises on a step where the other rank
shadows (under DDP with SAM's optimizer, whose ``step`` UnevenJoin wraps, and under FSDP1, whose microbatch
padding wraps the ``DataSpec``'s split), or every rank raises from a callback in the middle of a step, after the
shadowing rank's stand-in forward and loss were put on the model and before they come off. Then:

* nothing of UnevenJoin is left on the user's ``DataSpec`` (its ``split_batch`` is the very function it was
  made with), model (no stand-in ``loss`` or ``forward``, no hook of UnevenJoin's), optimizer (no wrapped
  ``step``), nor in ``torch.distributed``'s functions or the process's warning filters;
* stock Composer, one epoch on the same ``DataSpec``, model and optimizer, ends with the same weights as on
  fresh copies of them (same weights and optimizer state): as if UnevenJoin had never run.

Each scenario also runs with its ranks swapped (the failing or shadowing rank first, then last), in one launch.
"""

from __future__ import annotations

import pytest

from harness import launch
from rank_orders import with_rotations
from reference import max_abs_diff
from test_join_core import ok

SCENARIOS = with_rotations(
    {
        # rank 1 has 2 batches, rank 0 fails reading its 3rd batch (step 2, where rank 1 shadows)
        'ddp_sam_loader_raises': dict(shards=[14, 6], fail_at={0: 9}, sam=True),
        # every rank raises after the step-2 loss: rank 1's stand-in loss and DDP forward are on the model then
        'ddp_raises_mid_shadow_step': dict(shards=[14, 6], raise_at=(2, 'after_loss')),
        'fsdp1_loader_raises': dict(shards=[14, 6], fail_at={0: 9}, wrapper='fsdp1'),
    }
)


@pytest.fixture(scope='module')
def runs() -> dict:
    return launch(
        2, [(name, 'scenarios_undo:fail_then_stock', {'cfg': cfg}) for name, cfg in SCENARIOS.items()], timeout=300
    )


@pytest.mark.parametrize('name', list(SCENARIOS))
def test_a_run_that_raises_leaves_nothing_behind(runs, name):
    cfg = SCENARIOS[name]
    for rank, res in enumerate(ok(runs, name)):
        assert res['error'] is not None, f'{name}: rank {rank} did not raise'
        if cfg.get('raise_at'):
            assert res['error'] == ('RuntimeError', 'raised at after_loss of step 2'), res['error']
        else:  # the failing rank its cause, the other the join's error naming it
            failing = next(iter(cfg['fail_at']))
            expected = 'RuntimeError' if rank == failing else 'UnevenInputsError'
            assert res['error'][0] == expected, (rank, res['error'])
        assert res['left'] == {}, f'{name}: rank {rank} left {res["left"]}'


@pytest.mark.parametrize('name', [n for n, cfg in SCENARIOS.items() if cfg.get('wrapper', 'ddp') == 'ddp'])
def test_stock_composer_on_the_same_objects_trains_as_on_fresh_ones(runs, name):
    for rank, res in enumerate(ok(runs, name)):
        assert res['stock_steps'] > 0
        assert max_abs_diff({'w': res['reused']}, {'w': res['fresh']}) == 0.0, f'{name}: rank {rank}'
