"""Inert shadow microbatches under DDP: the collectives of a forward and backward pass, and no user code.

torch's own ``DistributedDataParallel.join`` shadows DDP without running the model: a joined rank
issues what DDP's forward and backward would (``_DDPJoinHook.main_hook``). :class:`DDPShadow` does
the same inside Composer's real training step, so nothing the model computes ever sees a shadow
batch: no forward on stand-in data, no user loss, no BatchNorm update, no shape check, no
data-chosen branch. For the duration of one shadow microbatch it stands in for
``DistributedDataParallel.forward`` and for the ``ComposerModel``'s ``loss``:

* the stand-in forward does what DDP's forward does besides running the module: rebuild the
  gradient buckets (``reducer._rebuild_buckets``: once per training, a broadcast), broadcast the
  buffers if this forward would (DDP's buffer hook, from UnevenJoin's buffer source), and note
  whether this microbatch syncs gradients (``require_backward_grad_sync``, as ``_post_forward``);
* the stand-in loss has the structure the model's real loss had on this rank (a tensor, a tuple,
  a dict with the same keys, so Composer's per-key loss all-reduces match), with value ``0``;
* its backward pass, if the microbatch syncs, issues DDP's backward collectives in DDP's order:
  one all-reduce per gradient bucket (zeros, ``_match_all_reduce_for_bwd_pass``) and, with
  ``find_unused_parameters``, the used-parameter map (zeros: this rank used nothing,
  ``_match_unused_params_allreduce``). Unlike torch's join, the reduced buckets become
  this rank's gradients (views of them, as with ``gradient_as_bucket_view``), so the rank takes the same optimizer step as the others; a parameter no
  rank used keeps ``grad = None``, so the optimizer leaves it (and its momentum) alone.

Cost of a shadow microbatch: the collectives only (and a zero fill of the stand-in's own gradient buckets,
kept from one shadow microbatch to the next, whose views the gradients become); no forward or backward
computation, no allocation proportional to the model after the first.

Where the forward itself communicates (``SyncBatchNorm``, or a module with
``shadow_forward = True``), the model must run: see :func:`forward_communicates`; the loss is
then :func:`connected_zero_loss`, never the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from composer_join.core import compat
from composer_join.core.batches import map_tensors
from composer_join.core.changes import Changes

__all__ = [
    'COLLECTIVES',
    'DDPShadow',
    'ForwardProbe',
    'LossShape',
    'connected_zero_loss',
    'forward_communicates',
    'skippable',
]


def forward_communicates(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward issues collectives, so a shadow microbatch must run it.

    True if it holds a ``torch.nn.SyncBatchNorm``, or a submodule with a true ``shadow_forward``
    attribute (set it on a module of your own that all-reduces statistics in its forward; it must
    then accept a zero-sample input and leave that rank out, as ``SyncBatchNorm`` does).
    """
    return any(isinstance(m, torch.nn.SyncBatchNorm) or getattr(m, 'shadow_forward', False) for m in module.modules())


def skippable(ddp: DistributedDataParallel) -> Optional[str]:
    """None if :class:`DDPShadow` can stand in for ``ddp``'s forward and backward, else why not."""
    if forward_communicates(ddp.module):
        return 'its forward communicates (SyncBatchNorm or shadow_forward=True)'
    if getattr(ddp, 'static_graph', False) or getattr(ddp, 'reducer', None) is None:
        return 'DDP runs with static_graph, or without a reducer'
    why = compat.stand_in_unsupported(ddp)
    if why is not None:
        return why
    if compat.sparse_params(ddp):
        return 'a module produces sparse gradients'
    return None


COLLECTIVES = (
    'all_reduce',
    'all_gather',
    'all_gather_into_tensor',
    'reduce_scatter',
    'reduce_scatter_tensor',
    'all_to_all',
    'all_to_all_single',
    'broadcast',
    'reduce',
    'gather',
    'scatter',
    'barrier',
)
"""The ``torch.distributed`` functions that issue collectives, as a forward calls them (:class:`ForwardProbe` watches
them; :func:`~composer_join.shadow.zero_samples.zero_sample_error` quiets them)."""


class ForwardProbe:
    """Notes the ``torch.distributed`` collectives a module's forward issues, during the first training forward of a fit.

    Under DDP a shadow microbatch runs no forward, so a forward that communicates (and is not
    marked, see :func:`forward_communicates`) would leave the other ranks' collectives unmatched.
    :meth:`arm` it at every fit's start: it probes this rank's first training forward of the fit (:attr:`found`),
    and keeps what every probe of the trainer found (:attr:`learned`). A rank that shadows from a fit's first step
    and has seen a loss of the model before runs no forward in that fit, so it cannot probe; every rank therefore
    sends what it learned in earlier fits (:meth:`fact`) in the fit's first agreement, and :meth:`agree` takes every
    rank's: :attr:`communicates` is the same on every rank from the first step on (a rank that has seen no loss
    runs its first shadow microbatch on the template, a forward, so it probes with the others). Cost: two hooks
    that check a flag; the first forward of each fit wraps the collective functions while it runs.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.armed = False
        self.found: list[str] = []
        self.learned: Optional[frozenset[str]] = None  # what every probe of this trainer found; None: none finished
        self.agreed: frozenset[str] = frozenset()  # what every rank had learned before this fit (its first agreement)
        self._saved: dict[str, Any] = {}

    def arm(self) -> None:
        """A fit starts: probe its first training forward."""
        self.armed, self.found, self.agreed = True, [], frozenset()

    def fact(self) -> int:
        """What this rank learned in earlier fits, for the first agreement
        (:class:`~composer_join.core.settings.Facts` ``forward``): 0 never probed, else 1 + a bitmask of
        :data:`COLLECTIVES`."""
        if self.learned is None:
            return 0
        return 1 + sum(1 << i for i, name in enumerate(COLLECTIVES) if name in self.learned)

    def agree(self, facts: Sequence[int]) -> None:
        """Every rank's :meth:`fact`, from the fit's first agreement."""
        self.agreed = frozenset(
            name for code in facts if code > 0 for i, name in enumerate(COLLECTIVES) if (code - 1) >> i & 1
        )

    @property
    def communicates(self) -> list[str]:
        """The collectives a training forward of the model issues, as far as any rank knows (sorted)."""
        return sorted(self.agreed | set(self.found))

    def retried(self) -> None:
        """Composer retries the step (automatic microbatching, after an OOM): call at its start, on every rank. A
        probed forward that raised did not finish, and what it counted is not the forward's: Composer's own OOM
        check all-reduced while the collectives were still wrapped (found by the scenario fuzzer: that rank alone
        then took its forward for a communicating one and raised, the others lost it in their next collective).
        Forgotten, the collectives put back; the retried forward is probed afresh."""
        if self._saved:
            self._restore()
            self.found = []

    def attach(self, changes: Changes) -> None:
        """Hook the module until ``changes`` is undone; undoing also puts back any collective wrapped meanwhile."""
        changes.hook(self.module.register_forward_pre_hook(self._start))
        changes.hook(self.module.register_forward_hook(self._stop))
        changes.call(self._restore)

    def _start(self, module, _args) -> None:
        if not self.armed or not module.training:  # a training forward (an evaluation may come first)
            return
        self.retried()  # (a probed forward that raised without Composer retrying its step: probe this one afresh)
        import torch.distributed as tdist

        for name in COLLECTIVES:
            original = getattr(tdist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                self.found.append(_name)
                return _original(*args, **kwargs)

            setattr(tdist, name, counted)

    def _stop(self, _module, _args, _output) -> None:
        if not self.armed or not self._saved:
            return
        self._restore()
        self.armed = False
        self.learned = (self.learned or frozenset()) | frozenset(self.found)

    def _restore(self) -> None:
        import torch.distributed as tdist

        for name, original in self._saved.items():
            setattr(tdist, name, original)
        self._saved = {}


class LossShape:
    """The structure of a model's loss (a tensor, or a tuple, list or dict of them), to stand in for it.

    :meth:`record` it from a real loss; :meth:`zeros` gives the same structure with every tensor
    replaced by ``value`` (keys and order kept). ``known`` is False until a real loss was recorded.
    """

    def __init__(self):
        self._skeleton: Any = None
        self.known = False

    def record(self, loss: Any) -> None:
        self._skeleton = map_tensors(lambda t: None, loss)
        self.known = True

    def zeros(self, value: torch.Tensor) -> Any:
        def fill(skeleton: Any) -> Any:
            if skeleton is None:  # where a tensor was
                return value
            if isinstance(skeleton, dict):
                items = {k: fill(v) for k, v in skeleton.items()}
                try:
                    return type(skeleton)(items)
                except TypeError:
                    return items
            if isinstance(skeleton, (list, tuple)):
                values = [fill(v) for v in skeleton]
                return type(skeleton)(*values) if hasattr(skeleton, '_fields') else type(skeleton)(values)
            return skeleton

        return fill(self._skeleton)


def connected_zero_loss(shape: LossShape, outputs: Any) -> Any:
    """A loss of ``shape``'s structure whose value is ``0`` and whose backward reaches every output tensor.

    For a shadow microbatch whose forward must run (DDP with ``SyncBatchNorm``: on zero samples;
    FSDP: on the template): its backward then runs the backward collectives of the forward's
    modules (``SyncBatchNorm``'s all-reduce, FSDP's reduce-scatters) like the other ranks', with
    zero gradients, and the model's own loss, which may not cope with so few samples (top-k
    mining, contrastive pairs), never runs. ``shape`` unknown: a scalar.
    """
    parts: list[torch.Tensor] = []
    map_tensors(lambda t: parts.append(t.sum()) if t.requires_grad else None, outputs)
    value = sum(parts) * 0.0 if parts else torch.zeros((), requires_grad=True)
    return shape.zeros(value) if shape.known else value  # type: ignore[arg-type]  # sum() of tensors: a tensor


class _MatchBackward(torch.autograd.Function):
    """Identity on a zero scalar; its backward issues DDP's backward collectives (see :class:`DDPShadow`)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, shadow: DDPShadow) -> torch.Tensor:
        ctx.shadow = shadow
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.shadow.match_backward()
        return None, None


def _bucket_view(segment: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient in its bucket's ``segment``, laid out as DDP's reducer lays it out.

    The reducer stores a dense parameter's gradient in the parameter's own strides (a channels-last
    convolution weight, say: ``initialize_bucket_views`` in torch's ``reducer.cpp``), any other one
    contiguously.
    """
    expected, dense = 1, True
    for d in sorted(range(param.dim()), key=param.stride):
        if param.size(d) != 1 and param.stride(d) != expected:
            dense = False
        expected *= param.size(d)
    return segment.as_strided(param.size(), param.stride()) if dense else segment.view_as(param)


class DDPShadow:
    """Stands in for one DDP model's forward and its ``ComposerModel.loss`` during shadow microbatches.

    :meth:`install` before the forward of a shadow microbatch (``BEFORE_FORWARD``), with a register of changes undone
    after its backward (``AFTER_BACKWARD``), on the rank that shadows. Record the model's loss of
    real microbatches in :attr:`loss_shape` (``AFTER_LOSS``), so the stand-in has its structure.

    Gradient buckets: the stand-in's own, one flat tensor per reducer bucket, made on the first synced shadow
    microbatch of a bucket layout (the reducer's, before and after its one rebuild) and kept until :meth:`release`
    (the wrapper releases them when the iteration over the train dataloader ends). Each synced shadow microbatch
    refills them with zeros in place, all-reduces them in place (the comm hook's result copied back into them where a
    hook returns a tensor of its own) and leaves the parameters' gradients as views of them, as DDP's
    ``gradient_as_bucket_view`` does: a gradient that is ``None``, already such a view, or (without
    ``gradient_as_bucket_view``) a tensor of the user's is bound to the view; one that may be DDP's own bucket view
    (``gradient_as_bucket_view=True``, a gradient left from a real step under ``zero_grad(set_to_none=False)``) is
    copied into, as before, so DDP's next real step divides in place exactly as it would have. Values are bit-equal to
    a copy out of fresh zero buckets. Cost per synced shadow microbatch after the first: the collectives, one
    ``zero_`` pass over the buckets (a ``memset``), and a loop over the parameter tensors; no allocation proportional
    to the model. Memory: one set of gradients for as long as the buckets are kept (a real step holds one too).
    """

    def __init__(self, ddp: DistributedDataParallel, model: torch.nn.Module, device: torch.device):
        self.ddp = ddp
        self.model = model  # the ComposerModel whose loss() Composer calls
        self.device = device
        self.loss_shape = LossShape()
        self._params = compat.params_for_reducer(ddp)  # the reducer's variable order (its used map)
        self._sync = False
        self._rebuilds = 0  # bucket rebuilds done by the stand-in's forward (DDP's own show in buckets_rebuilt)
        self._layout: Any = None  # what the kept buckets were made for (None: none kept)
        self._buckets: list[Any] = []  # the kept GradBuckets, in the reducer's order
        self._flats: list[torch.Tensor] = []  # their buffers
        self._views: list[list[tuple[torch.Tensor, torch.Tensor, int]]] = []  # per bucket: (param, its view, index)

    def install(self, changes: Changes) -> None:
        """Stand in for the forward and the loss until ``changes`` is undone (after the microbatch's backward)."""
        changes.set(self.ddp, 'forward', self._forward)
        changes.set(self.model, 'loss', self._loss)

    def release(self) -> None:
        """Drop the kept gradient buckets (gradients bound to views of them keep their memory alive)."""
        self._layout, self._buckets, self._flats, self._views = None, [], [], []

    def _forward(self, *args, **kwargs) -> Any:
        """What ``DistributedDataParallel.forward`` communicates, in its order, without the module."""
        ddp = self.ddp
        grad = torch.is_grad_enabled()
        if grad and compat.rebuild_buckets(ddp):  # a broadcast, once per training, where DDP's _pre_forward does it
            self._rebuilds += 1
        compat.sync_buffers_around_forward(ddp)
        self._sync = grad and ddp.require_backward_grad_sync
        ddp.require_forward_param_sync = self._sync
        return None

    def _loss(self, outputs: Any, batch: Any) -> Any:
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        return self.loss_shape.zeros(_MatchBackward.apply(anchor, self))

    def _grad_buckets(self) -> list[Any]:
        """The kept buckets, zero-filled in place; made (zeros, from the reducer) where its layout may have changed."""
        rebuilt = compat.buckets_rebuilt(self.ddp)
        layout = None if rebuilt is None else (self.ddp.reducer, rebuilt, self._rebuilds)
        if layout is None or self._layout is None or layout[0] is not self._layout[0] or layout[1:] != self._layout[1:]:
            self._buckets = compat.zero_grad_buckets(self.ddp)
            self._flats = [bucket.buffer() for bucket in self._buckets]
            index = {id(p): i for i, p in enumerate(self._params)}
            self._views = []
            for bucket, flat in zip(self._buckets, self._flats):
                views, offset = [], 0
                for p in bucket.parameters():
                    n = p.numel()
                    views.append((p, _bucket_view(flat[offset : offset + n], p), index[id(p)]))
                    offset += n
                self._views.append(views)
            self._layout = layout
            return self._buckets
        for bucket, flat in zip(self._buckets, self._flats):
            flat.zero_()
            if bucket.buffer().data_ptr() != flat.data_ptr():  # a comm hook replaced it (set_buffer)
                bucket.set_buffer(flat)
        return self._buckets

    def match_backward(self) -> None:
        """DDP's backward collectives with this rank's gradients zero; the gradients left as views of the reduced
        buckets (see the class)."""
        if not self._sync:
            return
        self._sync = False
        find_unused = self.ddp.find_unused_parameters
        if find_unused and self._layout is not None:
            # A parameter no rank uses keeps its gradient (DDP's reducer leaves it untouched): one that is a view of
            # the kept buckets (an earlier synced microbatch of this step, or zero_grad(set_to_none=False)) would be
            # zeroed with them, so it gets a copy of its own first.
            with torch.no_grad():
                for views in self._views:
                    for p, view, _ in views:
                        if p.grad is view:
                            p.grad = view.clone()
        buckets = self._grad_buckets()
        futures = [compat.run_comm_hook(self.ddp, bucket) for bucket in buckets]  # in bucket order, as the reducer
        reduced = [f.wait() for f in futures]
        used: Optional[list[int]] = None
        if find_unused:
            used_map = torch.zeros_like(compat.local_used_map(self.ddp))
            self.ddp.process_group.allreduce(used_map).wait()
            used = used_map.tolist()
        compat.push_rebuilt_params(self.ddp)
        bind = not self.ddp.gradient_as_bucket_view
        with torch.no_grad():
            for flat, result, views in zip(self._flats, reduced, self._views):
                value = result[0] if isinstance(result, (list, tuple)) else result
                if value.data_ptr() != flat.data_ptr():  # a comm hook that returns a tensor of its own
                    flat.copy_(value)
                for p, view, i in views:
                    if used is not None and not used[i]:
                        continue
                    grad = p.grad
                    if grad is view:
                        continue
                    if grad is None or bind:
                        p.grad = view
                    else:  # perhaps DDP's own bucket view (gradient_as_bucket_view): written in place, as DDP would
                        grad.copy_(view)
