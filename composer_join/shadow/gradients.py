"""Weighting a rank's contribution to the gradient without changing the loss it reports.

Composer already weights every microbatch by its share of the step's samples (summed over all
ranks), and DDP averages over ranks, so a rank's loss reaches the optimizer as the mean over the
real samples of the step. :func:`scale_grad` puts one more factor on the gradient only: ``0`` for a
shadow microbatch (it must contribute nothing) and ``A_t / W`` for real ones when
``divide_by_initial_world_size`` asks for torch's semantics. The forward value, and so Composer's
logged loss, is unchanged, but for a factor ``0`` (a stand-in), whose value reads zero: a stand-in's own loss
(a mean over no real token is NaN) reaches no log and no callback.

Example:
    >>> import torch
    >>> w = torch.ones(2, requires_grad=True)
    >>> loss = scale_grad((w * 3).sum(), 0.5)
    >>> loss.backward()
    >>> float(loss), w.grad.tolist()
    (6.0, [1.5, 1.5])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from composer_join.core.batches import map_tensors
from composer_join.core.catalogue import GRADIENT_PRESENCE, UNUSED_PARAMETERS
from composer_join.core.changes import Changes
from composer_join.core.exchange import TorchExchange

__all__ = ['UnusedParameters', 'no_sparse_rows', 'reached_leaves', 'scale_grad', 'share_grad_presence']


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward pass, multiplies the incoming gradient by ``factor`` in the backward pass."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        # a fresh tensor (Composer scales the loss in place afterwards); zero where nothing of it may count
        return tensor.clone() if factor else torch.zeros_like(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_grad(loss: Any, factor: float) -> Any:
    """``loss`` (a tensor, or a tuple or dict of them) with its gradient multiplied by ``factor``.

    Cost: one scalar clone per loss tensor, and one multiplication in the backward pass.
    """
    return map_tensors(lambda t: _ScaleGrad.apply(t, factor) if t.requires_grad else t, loss)


def _without_rows(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` if dense; if sparse, an empty sparse tensor of its shape, dtype and device (no row at all)."""
    if not grad.is_sparse:
        return grad
    dims = grad.sparse_dim()
    indices = torch.empty((dims, 0), dtype=torch.long, device=grad.device)
    values = torch.empty((0, *grad.shape[dims:]), dtype=grad.dtype, device=grad.device)
    return torch.sparse_coo_tensor(indices, values, grad.shape)


def no_sparse_rows(params: Sequence[torch.Tensor], changes: Changes) -> None:
    """Until ``changes`` is undone, a sparse gradient a backward gives any of ``params`` holds no row.

    For a shadow microbatch that runs the model (on the template's two samples, gradient weight zero): an
    ``nn.Embedding(sparse=True)`` would otherwise give its weight a sparse gradient holding the template's rows with
    value 0, DDP's all-reduce of sparse gradients would put those rows in every rank's reduced gradient, and
    ``torch.optim.SparseAdam`` moves every row present (its moments update on any row in the gradient, whatever its
    value). With an empty sparse gradient from the stand-in, the reduced gradient (the sum over ranks) holds exactly
    the rows the real samples gave, the same on every rank. Dense gradients pass unchanged. Cost: one hook per sparse
    parameter, made and removed per shadow microbatch; no collective.

    Example:
        >>> import torch
        >>> from composer_join.core.changes import Changes
        >>> emb, changes = torch.nn.Embedding(5, 2, sparse=True), Changes()
        >>> no_sparse_rows([emb.weight], changes)
        >>> emb(torch.tensor([1, 3])).sum().mul(0).backward()
        >>> emb.weight.grad.coalesce().indices().numel()
        0
        >>> changes.undo()
    """
    for p in params:
        changes.hook(p.register_hook(_without_rows))


def share_grad_presence(
    optimizers: Sequence[torch.optim.Optimizer],
    to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> None:
    """Give a zero gradient to every parameter that has a gradient on some rank but none here.

    Composer's ``forced_sync`` all-reduces ``p.grad`` for each parameter whose gradient is not
    None; if that differs between ranks, so do the collectives. Call this on every rank after the
    last backward pass of a step, before that all-reduce. Parameters without a gradient on any
    rank keep ``None`` (so optimizers still skip them). Cost: one all-reduce of one byte per
    parameter tensor.
    """
    params = [p for optimizer in optimizers for group in optimizer.param_groups for p in group['params']]
    said = GRADIENT_PRESENCE.said('the all-reduce of which parameters have a gradient on some rank')
    present = TorchExchange(to_device).reduce(
        torch.tensor([p.grad is not None for p in params], dtype=torch.uint8), 'max', said
    )
    for p, anywhere in zip(params, present.tolist()):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)


def reached_leaves(loss: Any) -> set[int]:
    """``id`` of every tensor an ``AccumulateGrad`` node of ``loss``'s graph accumulates into (its parameters).

    Known before the backward, but not complete: the parameters inside a reentrant activation-checkpointing
    segment are not in the graph (the backward recomputes the segment and reaches them in a second backward
    pass). :class:`~composer_join.wrappers.fsdp.GradientUnits` adds those from forward hooks;
    :class:`UnusedParameters`, which can wait for the backward, asks autograd's per-parameter hooks instead.
    Cost: a walk over the graph, about 1 us per node in Python (0.4 ms for a 12-layer transformer encoder).
    """
    roots: list[Any] = []
    map_tensors(lambda t: roots.append(t.grad_fn) if t.grad_fn is not None else None, loss)
    seen, found = set(), set()
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, 'variable', None)
        if variable is not None:
            found.add(id(variable))
        roots.extend(next_fn for next_fn, _ in node.next_functions)
    return found


class UnusedParameters:
    """On a step where some rank shadows, a parameter that no real sample used on any rank gets no gradient.

    As in one process: an optimizer then leaves it and its momentum alone. A shadow microbatch that runs the
    model (on the template, or on zero samples where the forward communicates) reaches parameters with a
    zero-weighted loss, and DDP then gives them a zero gradient (so does torch's own join, and DDP under
    ``static_graph``); this takes it back.

    Which parameters a real microbatch used, autograd tells: a hook on each parameter
    (``Tensor.register_post_accumulate_grad_hook``) fires when the backward pass accumulates the parameter's
    gradient, wherever that happens, also in the second backward pass a reentrant activation-checkpointing
    segment (``torch.utils.checkpoint(..., use_reentrant=True)``, Hugging Face's ``gradient_checkpointing_enable()``)
    runs for the parameters inside it, which no walk of the loss's graph reaches. The hooks record only while a
    real microbatch's backward runs (:meth:`record`), and exist only on the steps that need them: made at the
    first real microbatch's :meth:`record` of such a step, removed by :meth:`finish` (or :meth:`stop`).

    Call :meth:`start_step` at every step; on the steps where :meth:`needed` (the same on every rank)
    :meth:`record` before each microbatch's backward (``shadow``: whether it is a shadow microbatch),
    :meth:`pause` after it, and :meth:`finish` on every rank after its last microbatch's backward. :meth:`attach`
    it to each iteration's register of changes (:class:`~composer_join.core.changes.Changes`): undone, it removes
    the hooks, also when the run raised mid-step. Cost, only on those steps: one hook per parameter tensor made and
    removed, one Python call per parameter tensor per backward pass, and one all-reduce of one byte per parameter
    tensor; none on other steps.

    Example:
        >>> import torch
        >>> layer, extra = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        >>> unused = UnusedParameters(list(layer.parameters()) + list(extra.parameters()))
        >>> unused.start_step()
        >>> unused.record(shadow=False)
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> unused.pause()
        >>> sorted(unused.used_here())
        [0, 1]
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        self._used: set[int] = set()  # indices into params
        self._recording = False
        self._hooks = Changes()

    @staticmethod
    def needed(plan: Any) -> bool:
        """Some rank shadows, and every rank can tell its last microbatch (every rank's samples are counted)."""
        return plan.any_joined and plan.all_counted  # (array operations on the step's table)

    def start_step(self) -> None:
        self.stop()
        self._used = set()

    def attach(self, changes: Changes) -> None:
        """Remove the hooks when ``changes`` is undone (the iteration ended, or the run raised)."""
        changes.call(self.stop)

    def record(self, shadow: bool) -> None:
        """Before a microbatch's backward on a step that needs it: record what it accumulates, unless ``shadow``."""
        self._recording = not shadow
        if self._recording and not len(self._hooks):  # a rank that only shadows makes none
            for index, p in enumerate(self.params):
                self._hooks.hook(p.register_post_accumulate_grad_hook(partial(self._accumulated, index)))

    def _accumulated(self, index: int, _param: torch.Tensor) -> None:
        if self._recording:
            self._used.add(index)

    def pause(self) -> None:
        """After the microbatch's backward."""
        self._recording = False

    def used_here(self) -> set[int]:
        """Indices (into :attr:`params`) of the parameters this rank's real microbatches gave a gradient so far."""
        return set(self._used)

    def stop(self) -> None:
        """Remove the hooks; nothing is recorded until the next :meth:`record`."""
        self._recording = False
        self._hooks.undo()

    def finish(self, to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        self.stop()
        said = UNUSED_PARAMETERS.said('the all-reduce of which parameters a real sample used')
        used = torch.tensor([i in self._used for i in range(len(self.params))], dtype=torch.uint8)
        used = TorchExchange(to_device).reduce(used, 'max', said)
        for p, anywhere in zip(self.params, used.tolist()):
            if not anywhere:
                p.grad = None
