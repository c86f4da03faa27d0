"""Where :class:`~composer_join.UnevenJoin` runs among the other algorithms: one Composer algorithm pass.

Composer's engine runs the algorithms that match an event in list order (``AFTER_*`` events in
reverse) and lets *algorithm passes* reorder that list per event (``composer/core/passes.py``).
:func:`join_pass` makes UnevenJoin's place independent of where the user listed it:

* on a shadow microbatch (a joined rank's, or an empty padding one), of the per-microbatch events
  (``BEFORE_FORWARD`` to ``AFTER_BACKWARD``, ``EVAL_*_FORWARD``, ``PREDICT_*_FORWARD``) only
  UnevenJoin runs: its stand-in input is weighted zero, so any other algorithm's effect on it must
  be nil, and MixUp, CutMix and the like would otherwise mix, cut or select from it. The pass only reads the
  microbatch's record (:class:`~composer_join.join.microbatches.Microbatch`), made once in ``UnevenJoin.match``
  at the microbatch's ``BEFORE_FORWARD``; on a step where no rank shadows and no microbatch is a stand-in,
  UnevenJoin does not match the microbatch events at all (:mod:`composer_join.join.fit`), and the pass leaves the
  list as it is;
* on a shadow step's ``AFTER_DATALOADER`` (the batch has zero samples) UnevenJoin runs first and
  last: it puts the two-sample stand-in in place for the others (SelectiveBackprop's extra forward
  is a collective under FSDP, and under DDP broadcasts buffers, so it must run on every rank), then
  takes the zero-sample batch back, so Composer still counts and splits zero samples;
* on every step's ``AFTER_DATALOADER`` where some rank's trainer has other algorithms or its train ``DataSpec`` a
  ``batch_transforms`` (agreed at ``FIT_START``: the same on every rank, whatever each algorithm matches on each
  rank), UnevenJoin runs last and re-agrees the ranks' sample and microbatch counts, which they may have changed
  (:mod:`composer_join.interop.replan`); where neither holds on any rank, UnevenJoin does not match
  ``AFTER_DATALOADER`` at all
  (:meth:`~composer_join.join.fit.FitSession.wants`), so the pass never sees it there;
* ``BEFORE_BACKWARD`` and ``AFTER_*``: UnevenJoin runs last, so the gradient weight it puts on
  ``state.loss`` survives algorithms that rewrite the loss (MixUp's and CutMix's
  ``interpolate_loss``) and it cleans up after the others;
* ``FIT_START``, ``EVAL_START``, ``PREDICT_START``: UnevenJoin runs last, so the others see the
  user's dataloader (AugMix, RandAugment and ColOut reach its dataset) before UnevenJoin wraps it;
* every other event: UnevenJoin runs first (it swaps in the stand-in before the others see the batch).

:func:`install` registers the pass in every Engine created afterwards, next to Composer's own
default passes (``composer.core.engine._get_default_passes``); ``import composer_join`` calls it, so
users need no ``algorithm_passes=`` of their own. Passing ``algorithm_passes=join_pass`` to the
Trainer as well is harmless. With no active UnevenJoin among the algorithms the pass returns the
list unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from composer.core import Algorithm, Event

from composer_join.core import compat
from composer_join.join.algorithm import MICROBATCH_EVENTS, UnevenJoin

__all__ = ['install', 'join_pass']

_LAST = frozenset(e for e in Event if e.name.startswith('AFTER_')) | {
    Event.BEFORE_BACKWARD,
    Event.FIT_START,
    Event.EVAL_START,
    Event.PREDICT_START,
}


def join_pass(algorithms: Sequence[Algorithm], event: Event) -> Sequence[Algorithm]:
    """Place (or isolate) UnevenJoin among ``algorithms`` for ``event``; see the module docstring."""
    if not algorithms:  # (every event of a step where UnevenJoin matches nothing, and no other algorithm does)
        return algorithms
    join = next((a for a in algorithms if isinstance(a, UnevenJoin)), None)
    if join is None:
        return algorithms
    join.pass_seen = True
    others = [a for a in algorithms if a is not join]
    if event == Event.AFTER_DATALOADER:  # some rank has others: the stand-in first where they run, the new counts
        return [join, *others, join] if join.stands_in(bool(others)) else [*others, join]
    if event in MICROBATCH_EVENTS and join.shadows_microbatch(event):
        return [join]
    return [*others, join] if event in _LAST else [join, *others]


def _with_join_pass(default_passes):
    def passes():
        found = default_passes()
        return found if join_pass in found else [*found, join_pass]

    passes.composer_join = True  # type: ignore[attr-defined]  # marks it as installed
    return passes


def install() -> None:
    """Register :func:`join_pass` after Composer's default passes, for every Engine created from now on (idempotent)."""
    passes = compat.default_passes()
    if not getattr(passes, 'composer_join', False):
        compat.set_default_passes(_with_join_pass(passes))
