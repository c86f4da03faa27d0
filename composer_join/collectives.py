"""Counting collectives per training step: the diagnostic behind the README's collective tables.

A diagnostics module at the top of the package, beside the public API: nothing of the join imports it.

May import: join, core, interop, shadow, rebalance, wrappers, data.
"""

from __future__ import annotations

from typing import Any

import torch
from composer import Callback
from torch.nn.parallel import DistributedDataParallel

from composer_join.core import compat
from composer_join.join.algorithm import is_shadow_step

__all__ = ['CollectiveCounter']


class CollectiveCounter(Callback):
    """Counts, per training step on this rank, the collectives issued, by kind.

    A diagnostic: every rank must issue the same collectives in every step, or the run hangs.
    Python-level ``torch.distributed`` calls are counted by wrapping them for the duration of the
    fit (FSDP1 and FSDP2 issue theirs, ``all_gather_into_tensor`` and ``reduce_scatter_tensor``,
    from Python too); DDP's gradient bucket all-reduces (issued from C++) by a DDP communication
    hook that does what DDP's default does, registered once per DDP model (torch allows one; a second fit on the
    same model keeps it). A step's window runs from the previous step's ``BATCH_END`` (or the
    epoch start) to its own ``BATCH_END``, so it includes the dataloader fetch. The wrappers are put back at
    ``FIT_END``, and at the next ``FIT_START`` where a fit raised before its end (never wrapped twice). Cost: a dict
    update per collective; it replaces any DDP communication hook.

    Example::

        counter = CollectiveCounter()
        trainer = Trainer(..., callbacks=[counter], algorithms=[UnevenJoin()])
        trainer.fit()
        counter.steps[3]  # e.g. {'all_reduce': 5, 'broadcast': 1, 'ddp_grad_bucket': 1}
    """

    KINDS = (
        'all_reduce',
        'broadcast',
        'all_gather',
        'all_gather_into_tensor',
        'reduce_scatter_tensor',
        'broadcast_object_list',
        'all_gather_object',
        'barrier',
        compat.DDP_BROADCAST,
    )

    def __init__(self):
        self.total: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []
        self.shadow: list[bool] = []
        self._mark: dict[str, int] = {}
        self._originals: dict[str, Any] = {}
        self._hooked: Any = None  # the DDP model the communication hook is registered on (once per model)

    def _wrap(self, kind):
        original = (
            compat.private(torch.distributed, kind, 'torch')
            if kind.startswith('_')
            else getattr(torch.distributed, kind)
        )
        self._originals[kind] = original

        def counted(*args, **kwargs):
            self.total[kind] = self.total.get(kind, 0) + 1
            return original(*args, **kwargs)

        setattr(torch.distributed, kind, counted)

    def fit_start(self, state, logger):
        self._unwrap()  # a fit that raised left its wrappers
        for kind in self.KINDS:
            self._wrap(kind)
        all_reduce, world = self._originals['all_reduce'], torch.distributed.get_world_size()

        def grad_bucket_hook(_, bucket):
            self.total['ddp_grad_bucket'] = self.total.get('ddp_grad_bucket', 0) + 1
            work = all_reduce(bucket.buffer().div_(world), async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        if isinstance(state.model, DistributedDataParallel) and state.model is not self._hooked:
            state.model.register_comm_hook(None, grad_bucket_hook)
            self._hooked = state.model

    def epoch_start(self, state, logger):
        self._mark = dict(self.total)

    def batch_end(self, state, logger):
        self.steps.append({k: v - self._mark.get(k, 0) for k, v in self.total.items() if v != self._mark.get(k, 0)})
        self.shadow.append(is_shadow_step(state))
        self._mark = dict(self.total)

    def fit_end(self, state, logger):
        self._unwrap()

    def _unwrap(self):
        for kind, original in self._originals.items():
            setattr(torch.distributed, kind, original)
        self._originals = {}
