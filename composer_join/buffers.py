"""Keeping module buffers (BatchNorm statistics) out of reach of shadow forwards, whatever the wrapper."""

from __future__ import annotations

import torch

__all__ = ['BufferGuard']


class BufferGuard:
    """Keeps one module's buffers unchanged through the forward passes run while :attr:`armed`.

    The owner arms it before a forward pass and calls :meth:`restore` after the backward pass
    (autograd may still need the buffers as the forward left them, e.g. BatchNorm's). The snapshot
    is taken by a forward pre-hook, so under DDP it holds the buffers as DDP's broadcast left them.
    Cost when armed: two copies of the buffers; when not armed, one attribute check per forward.

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
