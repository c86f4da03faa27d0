"""The wrappers' contract (``composer_join.wrappers.wrapper``), in one process: a microbatch is a context whose exit
undoes its stand-ins, the gradient sync DDP's microbatch turned off included; which even steps DDP still needs.

Before issue 41 a sync turned off for a microbatch was turned on again at its ``AFTER_BACKWARD`` or at the next
step's start; now that a step where no rank shadows runs no hook of UnevenJoin's, the microbatch's exit (after its
backward, or when the step or iteration ends, also on a raise) must do it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from composer_join.core.plan import RankStatus, StepPlan, plan_from_lengths
from composer_join.wrappers.ddp import MicrobatchSync
from composer_join.wrappers.wrapper import Microbatch, Wrapper


def planned(samples: int = 8, microbatches: int = 2) -> StepPlan:
    """A step planned from the lengths on rank 0 of 2: the other rank's counts unknown."""
    return plan_from_lengths(0, 0, RankStatus(True, samples, microbatches), 2)


def agreed(counts: list[int]) -> StepPlan:
    return StepPlan(0, tuple(RankStatus(True, 4 * n, n) for n in counts))


class Model:
    def loss(self, outputs, batch):
        return 'real'


def test_a_microbatch_exit_undoes_its_stand_ins():
    model = Model()
    with Microbatch() as mb:
        mb.stand_ins.set(model, 'loss', lambda outputs, batch: 'zero')
        assert model.loss(None, None) == 'zero'
    assert model.loss(None, None) == 'real' and 'loss' not in vars(model)


def test_a_sync_turned_off_is_on_again_when_the_microbatch_exits():
    # multi_auto_sync: Composer syncs every microbatch; only this rank's last one may (the others' counts unknown)
    ddp = SimpleNamespace(require_backward_grad_sync=True, find_unused_parameters=False)
    sync, plan = MicrobatchSync(), planned(samples=8)
    sync.start_step()
    first = Microbatch()
    with first:
        sync.before_forward(ddp, plan, 0, 4, first.stand_ins)
        assert ddp.require_backward_grad_sync is False and not sync.last
    assert ddp.require_backward_grad_sync is True
    with pytest.raises(RuntimeError), Microbatch() as second:  # a raise inside the microbatch: still undone
        sync.before_forward(ddp, plan, 0, 4, second.stand_ins)
        assert sync.last and ddp.require_backward_grad_sync is True  # the last one syncs
        ddp.require_backward_grad_sync = True
        raise RuntimeError('the forward raised')
    assert ddp.require_backward_grad_sync is True


def test_a_microbatch_left_unexited_is_undone_by_its_exit_alone():
    ddp = SimpleNamespace(require_backward_grad_sync=True, find_unused_parameters=False)
    sync, mb = MicrobatchSync(), Microbatch()
    sync.start_step()
    mb.__enter__()
    sync.before_forward(ddp, planned(samples=8), 0, 2, mb.stand_ins)
    assert ddp.require_backward_grad_sync is False
    sync.start_step()  # a retried step starts: the sync stays off until the microbatch exits (the session exits it)
    assert ddp.require_backward_grad_sync is False
    mb.__exit__(None, None, None)
    assert ddp.require_backward_grad_sync is True


@pytest.mark.parametrize(
    ('strategy', 'find_unused', 'plan', 'needed'),
    [
        ('single_auto_sync', False, planned(), False),  # Composer's default: one sync per rank per step
        ('single_auto_sync', True, planned(), False),
        ('multi_auto_sync', False, planned(), True),  # others' counts unknown: only each rank's last may sync
        ('multi_auto_sync', False, agreed([2, 1]), True),
        ('multi_auto_sync', False, agreed([2, 2]), False),  # the same known count everywhere
        ('forced_sync', False, planned(), False),
        ('forced_sync', True, planned(), True),  # gradients present on some rank only: shared
        (None, False, agreed([2, 2]), True),  # not found: every step
    ],
)
def test_which_steps_without_a_shadowing_rank_ddp_syncs_need(strategy, find_unused, plan, needed):
    ddp = SimpleNamespace(require_backward_grad_sync=True, find_unused_parameters=find_unused)
    assert bool(MicrobatchSync.needed(strategy, ddp, plan)) is needed


def test_no_wrapper_needs_no_step_and_its_microbatch_is_not_inert():
    wrapper = Wrapper()
    assert not wrapper.watches(None, planned())  # type: ignore[arg-type]  # it reads nothing
    mb = wrapper.microbatch(None, planned(), shadow=True, samples=0)  # type: ignore[arg-type]
    assert isinstance(mb, Microbatch) and not mb.inert
