"""Algorithms that cannot run beside UnevenJoin: found at ``FIT_START``, on every rank, before any step.

A shadowing rank runs its forward on a two-sample stand-in (``loader.TEMPLATE_SAMPLES``). An
algorithm whose modules refuse batches that small would raise on that rank alone, mid-epoch,
while the others wait in a collective (a hang until the timeout). :func:`refuse_incompatible`
stops every rank at once instead, naming the algorithm, the reason and what works:

* ``GhostBatchNorm(ghost_batch_size=g)`` with ``g`` above the stand-in's two samples: its
  ``_GhostBatchNorm`` raises for a batch smaller than ``g``.

The check reads only the algorithm list, which every rank holds alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from composer.algorithms import GhostBatchNorm
from composer.core import Algorithm

from composer_join.core.errors import UnevenInputsError

__all__ = ['refuse_incompatible']


def refuse_incompatible(algorithms: Sequence[Algorithm], stand_in_samples: int) -> None:
    """Raise :class:`UnevenInputsError` if an algorithm cannot run on a ``stand_in_samples``-sample shadow batch."""
    for algorithm in algorithms:
        if isinstance(algorithm, GhostBatchNorm) and algorithm.ghost_batch_size > stand_in_samples:
            raise UnevenInputsError(
                f'{algorithm!r} cannot run beside UnevenJoin: a rank that has run out of data runs its forward on '
                f'a {stand_in_samples}-sample stand-in batch, and GhostBatchNorm refuses batches smaller than '
                f'ghost_batch_size={algorithm.ghost_batch_size}. Use ghost_batch_size <= {stand_in_samples}, or even '
                'shards without UnevenJoin',
            )
