"""Rank-side scenarios for tests/test_event_cost.py: which of Composer's events UnevenJoin matches, per step.

:func:`fit` runs ``rank_scenarios.train`` with ``UnevenJoin.match`` counted (the Engine asks every algorithm at
every event; what it matches, it runs, with Composer's per-algorithm bookkeeping: a trace, ``log_traces``, a
debug-log string). Events are attributed to the training step they belong to: ``BATCH_END`` and
``BATCH_CHECKPOINT`` come after Composer moved the timestamp on, so they count for the step before. Not a test
module.
"""

from __future__ import annotations

from typing import Any

from composer.core import Event

import rank_scenarios
from composer_join import UnevenJoin

# the events of one training step: Composer's, but a fit's, an epoch's, an evaluation's and predict()'s own
_NOT_A_STEP = ('init', 'before_load', 'after_load', 'fit_', 'epoch_', 'iteration_', 'eval_', 'predict_')
STEP_EVENTS = frozenset(e for e in Event if not e.value.startswith(_NOT_A_STEP))
_AFTER_THE_STEP = (Event.BATCH_END, Event.BATCH_CHECKPOINT)


def fit(cfg: dict) -> dict[str, Any]:
    """``rank_scenarios.train(cfg)``, and per global step the events UnevenJoin matched (their names, in order)."""
    matched: dict[int, list[str]] = {}
    original = UnevenJoin.match

    def counted(self, event, state):
        result = original(self, event, state)
        if result and event in STEP_EVENTS:
            step = int(state.timestamp.batch) - (1 if event in _AFTER_THE_STEP else 0)
            matched.setdefault(step, []).append(event.value)
        return result

    UnevenJoin.match = counted  # this rank's process only (a fork of the harness's server)
    try:
        result = rank_scenarios.train(cfg)
    finally:
        UnevenJoin.match = original
    return {**result, 'matched': matched}
