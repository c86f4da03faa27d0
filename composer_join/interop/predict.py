"""``Trainer.predict()`` on uneven shards: every rank predicts every sample of its own shard, once.

Composer's predict loop stops every rank at the shortest one (``Trainer._iter_dataloader``'s
exhausted-flag all-reduce). :class:`~composer_join.UnevenJoin` wraps the predict dataloader at
``PREDICT_START`` the way it wraps an evaluation's: the loop runs for the longest rank's number of
batches, and a rank that has run out runs *shadow* batches, so every collective (FSDP's
all-gathers in the forward, Composer's per-batch time reduction, any callback's) still matches:

* ``PREDICT_BATCH_START``: a shadow batch has zero samples, so ``predict_timestamp`` counts real
  samples (and tokens) only;
* ``PREDICT_BEFORE_FORWARD``: the two-sample stand-in takes its place for the forward;
* ``PREDICT_AFTER_FORWARD``: :func:`empty_outputs` turns its outputs into zero samples (the
  outputs' structure, every tensor cut to length 0) and puts the zero-sample batch back.

So ``return_outputs=True`` gives, on each rank, one entry per step of the longest shard; the
entries of a rank's shadow steps hold zero samples, and concatenating a rank's entries gives
exactly its shard's predictions. Callbacks at ``PREDICT_BATCH_END`` see a zero-sample batch and
zero-sample outputs on a shadow step (and ``is_shadow_step(state)`` is True).
"""

from __future__ import annotations

from composer.core import Event, State

from composer_join.core.batches import first_samples

__all__ = ['PREDICT_EVENTS', 'empty_outputs']

PREDICT_EVENTS = frozenset(
    (Event.PREDICT_START, Event.PREDICT_BEFORE_FORWARD, Event.PREDICT_AFTER_FORWARD, Event.PREDICT_END)
)


def empty_outputs(state: State) -> None:
    """After a shadow predict forward: zero-sample outputs and batch, as if the rank had predicted nothing."""
    state.outputs = first_samples(state.outputs, 0)
    state.batch = first_samples(state.batch, 0)
