"""A shadow step's gradients as views of the stand-in's kept buckets (issue 52): bit-equal to the copies they replaced.

Each case runs the same Composer fit with UnevenJoin twice in the same ranks: with ``DDPShadow`` as it is (the
reduced buckets kept from step to step, zero-filled in place, the gradients bound to views of them) and with the
``match_backward`` before issue 52 (fresh zero buckets every step, each reduced gradient cloned or copied out,
``scenarios_bucket_views.copied_match_backward``). Two epochs, so real steps follow shadow steps on the short rank;
DDP's ``gradient_as_bucket_view`` on and off; ``zero_grad(set_to_none=False)``, and a ``zero_grad`` that does nothing (with
``find_unused_parameters``, a head no rank uses in a step keeps the gradient it had); ``find_unused_parameters`` with
one sample per synced microbatch;
gradient clipping (in place, on the views); 3 ranks (DDP divides by 3, not exact in binary). Parameters, final
gradients and momentum buffers must be bit-equal on every rank.
"""

from __future__ import annotations

import pytest
import torch

from harness import launch

CASES = {
    'mlp': dict(model='mlp', shards=[32, 16]),
    'mlp_as_view': dict(model='mlp', shards=[32, 16], as_view=True),
    'mlp_keep_grads': dict(model='mlp', shards=[32, 16], zero_grad='keep'),
    'mlp_as_view_keep_grads': dict(model='mlp', shards=[16, 32], as_view=True, zero_grad='keep'),
    'mlp_clip_multi_mb4': dict(model='mlp', shards=[32, 16], clip=True, microbatch=4, sync='multi_auto_sync'),
    'unused_multi_mb3': dict(model='unused', shards=[8, 24], microbatch=3, sync='multi_auto_sync', find_unused=True),
    'unused_multi_mb3_keep_grads': dict(
        model='unused', shards=[8, 24], microbatch=3, sync='multi_auto_sync', find_unused=True, zero_grad='keep'
    ),
    # one sample per microbatch, each synced: a head used in one microbatch is used by no rank in the next
    'heads_multi_mb1_unused': dict(
        model='heads', shards=[16, 8], microbatch=1, sync='multi_auto_sync', find_unused=True
    ),
    'heads_multi_mb1_unused_as_view': dict(
        model='heads', shards=[16, 8], microbatch=1, sync='multi_auto_sync', find_unused=True, as_view=True
    ),
    # gradients never zeroed: a head no rank uses in a step keeps what it had, also on the shadowing rank
    'heads_unused_never_zeroed': dict(model='heads', shards=[16, 8], find_unused=True, zero_grad='never'),
    'heads_unused_never_zeroed_as_view': dict(
        model='heads', shards=[8, 16], find_unused=True, zero_grad='never', as_view=True
    ),
    'mlp_3_as_view_keep_grads': dict(model='mlp', shards=[32, 16, 8], as_view=True, zero_grad='keep'),
    'unused_3_clip': dict(model='unused', shards=[8, 24, 16], find_unused=True, clip=True),
}
for _cfg in CASES.values():
    _cfg.setdefault('batch_size', 8)


@pytest.fixture(scope='module')
def runs() -> dict:
    results = {}
    for world in (2, 3):
        calls = [
            (name, 'scenarios_bucket_views:views_and_copies', {'cfg': cfg})
            for name, cfg in CASES.items()
            if len(cfg['shards']) == world
        ]
        results.update(launch(world, calls, timeout=600))
    return results


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize('name', sorted(CASES))
def test_weights_gradients_and_momenta_bit_equal_to_the_copies(runs, name):
    for rank, result in enumerate(runs[name]):
        assert not isinstance(result, Exception), result
        new, old = result['new'], result['old']
        assert new['shadow_syncs'] == old['shadow_syncs']
        for key in new['params']:
            assert torch.equal(new['params'][key], old['params'][key]), (rank, key)
            assert _equal(new['grads'][key], old['grads'][key]), (rank, key)
        assert all(_equal(a, b) for a, b in zip(new['momenta'], old['momenta'])), rank
    assert any(r['new']['shadow_syncs'] > 0 for r in runs[name]), 'no shadow microbatch synced: nothing compared'
