"""The two places where UnevenJoin reaches into torch's ``DistributedDataParallel``.

* :func:`broadcast_buffers_from`: DDP broadcasts module buffers (BatchNorm statistics) from rank 0
  before each synced forward. Once rank 0 has run out of data its buffers are stale, so, as torch's
  own join does, the broadcast must come from a rank that still has data. This registers a buffer
  hook that runs DDP's own coalesced broadcast, from the rank a callable names. Same collectives,
  same cost, one different source.
* :class:`BufferGuard`: a shadow forward must not fold the stand-in batch into the model's buffers.
  A forward pre-hook on the wrapped module snapshots all buffers (after DDP's broadcast) when
  armed; :meth:`BufferGuard.restore` copies them back once the backward pass no longer needs them.
  Cost when armed: two copies of the buffers; when not armed, one attribute check per forward.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _BufferCommHookLocation

from composer_join.plan import StepPlan

__all__ = ['BufferGuard', 'BufferSource', 'broadcast_buffers_from']


def broadcast_buffers_from(ddp: DistributedDataParallel, source_rank: Callable[[], int]) -> None:
    """Make ``ddp`` broadcast its buffers from ``source_rank()`` instead of rank 0, before each synced forward."""

    def hook(_state, named_buffers: dict[str, torch.Tensor]) -> None:
        ddp._default_broadcast_coalesced(bufs=list(named_buffers.values()), authoritative_rank=source_rank())

    ddp._register_buffer_comm_hook(None, hook, comm_hook_location=_BufferCommHookLocation.PRE_FORWARD)


class BufferSource:
    """The rank whose buffers DDP broadcasts: rank 0 (as stock DDP) until it runs out of data, then a rank with data.

    Unlike torch's join, which takes the highest rank with data at every step, the source only
    moves when it must: a rank that shadowed the end of the last epoch missed that epoch's final
    buffer updates, so making it the source when the next epoch starts would drop them. Call
    :meth:`update` once per step, with the step's plan, on every rank.
    """

    def __init__(self):
        self.rank = 0

    def update(self, plan: StepPlan) -> None:
        if not plan.has_batch(self.rank) and plan.active_ranks:
            self.rank = plan.active_ranks[-1]


class BufferGuard:
    """Keeps one module's buffers unchanged through the forward passes run while :attr:`armed`.

    The owner arms it before a forward pass and calls :meth:`restore` after the backward pass
    (autograd may still need the buffers as the forward left them, e.g. BatchNorm's).

    Example:
        >>> import torch
        >>> bn = torch.nn.BatchNorm1d(3)
        >>> guard = BufferGuard(bn)
        >>> guard.armed = True
        >>> bn(torch.randn(4, 3) + 10).sum().backward()
        >>> guard.restore()
        >>> bn.running_mean.tolist()
        [0.0, 0.0, 0.0]
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.armed = False
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        module.register_forward_pre_hook(self._snapshot)

    def _snapshot(self, _module, _args) -> None:
        if self.armed and not self._saved:
            self._saved = [(b, b.detach().clone()) for b in self.module.buffers()]

    def restore(self) -> None:
        """Put back the buffers saved at the first forward since arming, and disarm."""
        with torch.no_grad():
            for buffer, value in self._saved:
                buffer.copy_(value)
        self._saved = []
        self.armed = False
