"""Which :class:`~composer_join.wrapper.Wrapper` a model gets: DDP's, FSDP's (FSDP1 and FSDP2), or none.

The factory sits above the wrappers it picks among (:mod:`composer_join.ddp`,
:mod:`composer_join.fsdp`), which import only the base class (:mod:`composer_join.wrapper`).
"""

from __future__ import annotations

from composer.core import State
from torch.nn.parallel import DistributedDataParallel

from composer_join.ddp import DDPWrapper
from composer_join.fsdp import FSDPWrapper
from composer_join.wrapper import Wrapper

__all__ = ['wrapper_for']


def wrapper_for(state: State, rank: int) -> Wrapper:
    """The :class:`~composer_join.wrapper.Wrapper` for how Composer wrapped ``state.model``: DDP, FSDP (1 or 2), or none."""
    if isinstance(state.model, DistributedDataParallel):
        return DDPWrapper(rank)
    if state.fsdp_enabled:
        return FSDPWrapper()
    return Wrapper()
