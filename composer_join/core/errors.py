"""The one error type of composer-join."""

from __future__ import annotations

__all__ = ['UnevenInputsError']


class UnevenInputsError(RuntimeError):
    """Ranks' inputs are uneven in a way the run was told not to accept, or cannot be joined.

    Raised by :class:`~composer_join.UnevenJoin` on every rank at the same step, never on one
    rank alone, so that a distributed run stops instead of hanging. The message names the ranks
    involved, the step and what is allowed. Typical causes:

    * ``throw_on_early_termination=True`` and some rank ran out of batches before the others;
    * a rank's dataloader failed while fetching a batch (the other ranks report it too);
    * a dataloader yielded fewer batches than its ``len()`` promised, so the epoch length would
      be wrong; or, with ``mode='rebalance'`` (whose schedule is planned from each ``len()``),
      more (``mode='shadow'`` treats such a ``len()`` as a hint and trains the extra batches);
    * on a step where some rank shadows, the ranks' batches differ in structure (container
      types, keys, tensor dtypes or dimensions), so a shadow batch cannot stand in for them.
    """
