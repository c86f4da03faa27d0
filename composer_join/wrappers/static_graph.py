"""DDP's ``static_graph``, whose first iteration rejects a backward under ``no_sync()``.

torch's static graph records, in its first iteration, which parameters the backward reaches; a backward under
``no_sync()`` then (``require_backward_grad_sync`` off) makes the reducer's delayed all-reduce fail on every rank
with ``expect_autograd_hooks_ INTERNAL ASSERT FAILED`` (``reducer.cpp``). torch-only repro, 2 ranks::

    ddp = DistributedDataParallel(torch.nn.Linear(3, 2), static_graph=True)
    with ddp.no_sync():
        ddp(x[:2]).sum().backward()  # first iteration: the next synced backward asserts
    ddp(x[2:]).sum().backward()

After that first synced backward, ``no_sync()`` works. Composer's ``multi_auto_sync`` never uses it, so stock trains
a static graph with microbatches; ``single_auto_sync`` uses it on every microbatch but the last, ``forced_sync`` on
every one: stock stops at step 0 there. :class:`~composer_join.wrappers.ddp.MicrobatchSync` turns sync off on a
rank's earlier microbatches where ranks may split a step differently; :func:`first_iteration_syncs` tells it, on the
step of DDP's first static-graph iteration, whether to leave Composer's strategy alone (the ranks' microbatch counts
are equal), or stops every rank with an :class:`~composer_join.UnevenInputsError` where no way of syncing works.
"""

from __future__ import annotations

from typing import Optional

from torch.nn.parallel import DistributedDataParallel

from composer_join.core import compat
from composer_join.core.catalogue import STATIC_GRAPH_COUNTS
from composer_join.core.errors import UnevenInputsError
from composer_join.core.plan import StepPlan
from composer_join.core.protocol import Exchange

__all__ = ['first_iteration_syncs', 'pending']

_WHY = (
    "torch's DDP with static_graph rejects a backward under no_sync() in its first iteration (expect_autograd_hooks_ "
    'INTERNAL ASSERT FAILED in reducer.cpp; repro: one backward under ddp.no_sync() before the first synced backward '
    'of a static_graph DDP)'
)


def pending(ddp: Optional[DistributedDataParallel]) -> bool:
    """Whether ``ddp`` runs with ``static_graph`` and has not run its first synced backward yet (the same on every
    rank: every rank's first synced backward is in the same step)."""
    return ddp is not None and bool(getattr(ddp, 'static_graph', False)) and compat.static_graph_first_pending(ddp)


def first_iteration_syncs(plan: StepPlan, rank: int, strategy: Optional[str], exchange: Exchange) -> bool:
    """On the step of DDP's first static-graph iteration (:func:`pending`), on every rank: True where every rank splits
    the step into the same number of microbatches (then each follows Composer's ``strategy`` exactly: ``multi_auto_sync``
    syncs every microbatch); raises :class:`~composer_join.UnevenInputsError` on every rank where the step would
    need a backward under ``no_sync()``: the counts differ under ``multi_auto_sync``, or Composer's own strategy uses
    it (``forced_sync``; ``single_auto_sync`` with more than one microbatch), as stock Composer's run stops there too.

    The counts come from the agreed plan; on a step planned from the lengths (the others' counts unknown) from one
    exchange of one integer per rank, once per DDP object.
    """
    counts = plan.rows.column('microbatches').tolist()
    if not plan.agreed:
        said = STATIC_GRAPH_COUNTS.said(f'the microbatch counts of step {plan.step}')
        table = exchange.rows([counts[rank]], said).wait()
        counts = [int(row[0]) for row in table]
    even = len(set(counts)) == 1 and 0 not in counts
    if strategy in ('multi_auto_sync', None) and even:  # None: not known, Composer's multi_auto_sync assumed
        return True
    if strategy == 'single_auto_sync' and max(counts) <= 1:
        return True
    if strategy in ('multi_auto_sync', None):
        what = f'its ranks split step {plan.step} into {counts} microbatches (rank by rank; 0: unknown)'
        fix = 'give every rank at least a full batch for the first step, or train the first step without microbatches'
    else:
        what = f"Composer's ddp_sync_strategy={strategy!r} turns sync off on microbatches itself"
        fix = "use ddp_sync_strategy='multi_auto_sync' (stock Composer stops here too)"
    raise UnevenInputsError(
        f'DDP with static_graph cannot train the first step here: {what}, so some rank would run a backward without '
        f"gradient sync in the static graph's first iteration, and {_WHY}. {fix.capitalize()}."
    )
