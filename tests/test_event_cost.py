"""Even steps cost nothing in Composer's event loop: where no rank shadows, UnevenJoin matches at most two events.

Composer's engine asks every algorithm's ``match`` at every event, and for each one matched it runs ``apply`` and
its own bookkeeping (a trace, ``log_traces``, a debug-log string): about 60 us of CPU per matched event on this
machine. Before issue 41 UnevenJoin matched every event of every step (16 per step with two microbatches). The
count is taken on real ranks (``scenarios_events.fit``: ``UnevenJoin.match`` counted), default DDP (Composer's
``single_auto_sync``), two microbatches per step, two epochs of 6 steps where one rank has 4 batches, the short
rank first and last. The fit still matches the single-process reference, and on every shadow step UnevenJoin
matches every microbatch event, so the algorithm pass can keep the other algorithms off its stand-ins.
"""

from __future__ import annotations

import pytest

import reference
from harness import launch
from rank_orders import with_rotations
from test_join_core import DIVIDE, TOL, ok

MICROBATCH_EVENTS = [
    'before_forward',
    'after_forward',
    'before_loss',
    'after_loss',
    'before_backward',
    'after_backward',
]
SCENARIOS = with_rotations({'default_ddp': dict(shards=[48, 32], batch_size=8, microbatch=4, epochs=2, join=DIVIDE)})


@pytest.fixture(scope='module')
def runs() -> dict:
    return launch(2, [(name, 'scenarios_events:fit', {'cfg': cfg}) for name, cfg in SCENARIOS.items()], timeout=240)


def steps(per_rank: list[dict]) -> tuple[list[int], list[int]]:
    """The fit's global steps where no rank shadows, and those where some rank does."""
    shadow = [any(res['shadow'][step] for res in per_rank) for step in range(len(per_rank[0]['shadow']))]
    return [s for s, sh in enumerate(shadow) if not sh], [s for s, sh in enumerate(shadow) if sh]


@pytest.mark.parametrize('name', list(SCENARIOS))
def test_even_steps_match_at_most_two_events(runs, name):
    per_rank = ok(runs, name)
    reference.assert_like_reference(name, per_rank, reference.train(SCENARIOS[name])['params'], TOL)
    even, shadowed = steps(per_rank)
    assert len(even) == 8 and len(shadowed) == 4, (even, shadowed)
    for rank, res in enumerate(per_rank):
        counts = {step: len(res['matched'].get(step, [])) for step in even}
        print(f'{name} rank {rank}: matched events per even step {counts}')
        # the fit's first step learns the stand-in input and the loss's structure from a real microbatch
        later = {step: res['matched'].get(step, []) for step in even if step > 0}
        assert all(len(events) <= 2 for events in later.values()), f'rank {rank}: {later}'


@pytest.mark.parametrize('name', list(SCENARIOS))
def test_shadow_steps_match_every_microbatch_event(runs, name):
    per_rank = ok(runs, name)
    _, shadowed = steps(per_rank)
    for rank, res in enumerate(per_rank):
        for step in shadowed:
            events = res['matched'].get(step, [])
            for event in MICROBATCH_EVENTS:
                assert event in events, f'rank {rank}, step {step}: {event} not matched ({events})'
