"""Keeping module buffers (BatchNorm statistics) out of reach of shadow forwards, whatever the wrapper."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from composer_join.core.changes import Changes

__all__ = ['BufferGuard', 'checkpoint_due']


class BufferGuard:
    """Keeps one module's buffers unchanged through the forward passes run while :attr:`armed`.

    The owner arms it before a forward pass and calls :meth:`restore` after the backward pass
    (autograd may still need the buffers as the forward left them, e.g. BatchNorm's). The snapshot
    is taken by a forward pre-hook, so under DDP it holds the buffers as DDP's broadcast left them;
    :meth:`attach` puts the hook on the module for as long as a register of changes holds it.
    Cost when armed: two copies of the buffers; when not armed, one attribute check per forward.

    Example:
        >>> import torch
        >>> from composer_join.core.changes import Changes
        >>> bn = torch.nn.BatchNorm1d(3)
        >>> guard, changes = BufferGuard(bn), Changes()
        >>> guard.attach(changes)
        >>> guard.armed = True
        >>> bn(torch.randn(4, 3) + 10).sum().backward()
        >>> guard.restore()
        >>> bn.running_mean.tolist()
        [0.0, 0.0, 0.0]
        >>> changes.undo()  # the hook is off the module again
        >>> len(bn._forward_pre_hooks)
        0
    """

    def __init__(self, module: torch.nn.Module, keep: Callable[[torch.nn.Module], bool] = lambda m: False):
        self.module = module
        self.armed = False
        self._keep = keep  # modules whose buffers a shadow forward may update (SyncBatchNorm's: global statistics)
        self._saved: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []

    def attach(self, changes: Changes) -> None:
        """Hook the module (its snapshot pre-hook) until ``changes`` is undone; undoing also restores and disarms."""
        changes.hook(self.module.register_forward_pre_hook(self._snapshot))
        changes.call(self.restore)

    def _snapshot(self, _module, _args) -> None:
        self.snapshot()

    def snapshot(self) -> None:
        """Save the buffers now, if armed and not saved yet (what the pre-hook does before a forward)."""
        if self.armed and not self._saved:
            self._saved = [
                (owner, name, b, b.detach().clone())
                for owner in self.module.modules()
                if not self._keep(owner)
                for name, b in owner.named_buffers(recurse=False)
            ]

    def restore(self) -> None:
        """Put back the buffers saved at the first forward since arming, and disarm.

        A buffer the forward replaced (``self.count = self.count + 1``) is put back as the tensor
        it replaced, with its saved value.
        """
        with torch.no_grad():
            for owner, name, buffer, value in self._saved:
                buffer.copy_(value)
                if getattr(owner, name, None) is not buffer:
                    setattr(owner, name, buffer)  # a registered buffer's name: nn.Module keeps it a buffer
        self._saved = []
        self.armed = False


def checkpoint_due(state: Any, event: Any) -> bool:
    """Whether one of the run's ``CheckpointSaver`` callbacks saves a checkpoint at this checkpoint ``event``.

    The same on every rank (a save interval depends on the timestamp only). Asked before the
    callbacks run, so that buffers can be made equal on every rank before they are saved.
    """
    from composer.callbacks import CheckpointSaver

    return any(
        isinstance(cb, CheckpointSaver)
        and callable(cb.save_interval)
        and cb.save_interval(state, event)
        and cb.last_checkpoint_batch != state.timestamp.batch
        for cb in state.callbacks
    )
