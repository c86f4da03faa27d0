"""One wrapper per way Composer wraps the model; :func:`wrapper_for` picks it: DDP's, FSDP's (1 and 2), or none.

* :mod:`~composer_join.wrappers.wrapper`: the small contract over what differs between DDP, FSDP1, FSDP2
  and no wrapper: install with an iteration's register, whether a step where no rank shadows needs it, begin a
  step, a microbatch as a context whose exit undoes its stand-ins (the base classes, also the no-wrapper case);
* :mod:`~composer_join.wrappers.ddp`: where UnevenJoin reaches into torch's ``DistributedDataParallel``
  (microbatch sync, the buffer source, inert shadow microbatches);
* :mod:`~composer_join.wrappers.fsdp`: where it reaches into Composer's FSDP (microbatch padding, the
  unused-parameter check).

The factory sits above the wrappers it picks among, which import only the base class.

May import: core, interop, shadow.
"""

from __future__ import annotations

from composer.core import State
from torch.nn.parallel import DistributedDataParallel

from composer_join.wrappers.ddp import DDPWrapper
from composer_join.wrappers.fsdp import FSDPWrapper
from composer_join.wrappers.wrapper import Wrapper

__all__ = ['wrapper_for']


def wrapper_for(state: State, rank: int) -> Wrapper:
    """The :class:`~composer_join.wrappers.wrapper.Wrapper` for how Composer wrapped ``state.model``: DDP, FSDP (1 or 2), or none."""
    if isinstance(state.model, DistributedDataParallel):
        return DDPWrapper(rank)
    if state.fsdp_enabled:
        return FSDPWrapper()
    return Wrapper()
