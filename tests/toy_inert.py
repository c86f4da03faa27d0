"""The models of the inert-shadow tests (after torch's own DDP uneven-input tests), shared by ranks and reference.

Every model is built deterministically (``make``), and every model's computation that is not a
per-sample gradient is one a shadow batch must not reach:

* ``'syncbn'``: the toy BatchNorm MLP; the ranks convert it with ``SyncBatchNorm.convert_sync_batchnorm``,
  the reference keeps plain ``BatchNorm1d`` over the union of the ranks' samples;
* ``'sumbn'``: the same with a BatchNorm of its own that sums its statistics over ranks in the forward
  (a differentiable all-reduce of sum, sum of squares and count), marked ``shadow_forward = True``
  and coping with a zero-sample input, the rule for such models; the reference normalises over the union;
* ``'bn'``: plain ``BatchNorm1d`` (running statistics, ``num_batches_tracked``);
* ``'heads'``: three heads, each sample's chosen by its label (DDP's reducer expects every head to be used);
* ``'unused'``: torch's ``UnusedParamModule`` pattern: rank 0 runs ``t1(t0(x))``, the others ``t1(x)``;
* ``'count'``: the MLP with a buffer the forward replaces (``self.count = self.count + 1``);
* ``'mlp'`` with the ``'topk'`` loss: the mean loss of the 4 hardest samples of each microbatch; with the
  ``'dict'`` loss: a dict of losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toy import CLASSES, FEATURES, make_module

TOPK = 4


class SumBatchNorm(torch.nn.Module):
    """Batch normalisation over every rank's samples: sum, sum of squares and count all-reduced in the forward.

    ``shadow_forward = True`` tells UnevenJoin that the forward communicates, so a shadow microbatch
    runs it, on zero samples: those add nothing to the sums. Without ``distributed`` (the
    reference) it normalises over its own input.
    """

    shadow_forward = True

    def __init__(self, channels: int, distributed: bool, eps: float = 1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))
        self.distributed, self.eps = distributed, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), float(len(x)))])
        if self.distributed:
            from torch.distributed.nn.functional import all_reduce

            stats = all_reduce(stats)
        c = len(self.weight)
        n = stats[2 * c]
        mean = stats[:c] / n
        var = stats[c : 2 * c] / n - mean * mean
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class UnmarkedSumBatchNorm(SumBatchNorm):
    """The same, without ``shadow_forward``: UnevenJoin cannot know that its forward communicates."""

    shadow_forward = False


def make_sumbn(distributed: bool, marked: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = (SumBatchNorm if marked else UnmarkedSumBatchNorm)(8, distributed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), norm, torch.nn.Tanh(), torch.nn.Linear(8, CLASSES))


class Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(FEATURES, 8)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(8, CLASSES) for _ in range(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = h.new_zeros(len(x), CLASSES)
        for i, head in enumerate(self.heads):
            chosen = (y == i).nonzero().flatten()
            if len(chosen):
                out = out.index_add(0, chosen, head(h[chosen]))
        return out


class UnusedParam(torch.nn.Module):
    """torch's ``UnusedParamModule`` (distributed_test.py): ``t0`` is used by rank 0 only."""

    def __init__(self):
        super().__init__()
        self.t0 = torch.nn.Linear(FEATURES, FEATURES)
        self.t1 = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
        return self.t1(torch.tanh(self.t0(x))) if rank == 0 else self.t1(x)


class Counting(torch.nn.Module):
    """The MLP and a buffer counting training forwards, replaced (not updated in place) by each."""

    def __init__(self):
        super().__init__()
        self.mlp = make_module('mlp')
        self.register_buffer('count', torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
        if self.training:
            self.count = self.count + 1
        return self.mlp(x)


def make(kind: str, distributed: bool = False) -> torch.nn.Module:
    if kind in ('sumbn', 'sumbn_unmarked'):
        return make_sumbn(distributed, marked=kind == 'sumbn')
    torch.manual_seed(0)
    if kind in ('syncbn', 'bn'):
        return make_module('bn')
    if kind == 'heads':
        return Heads()
    if kind == 'unused':
        return UnusedParam()
    if kind == 'count':
        return Counting()
    return make_module('mlp')


def run(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
    if isinstance(module, (Heads, UnusedParam, Counting)):
        return module(x, y, rank)
    return module(x)


def loss_sum(kind_loss: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The microbatch's loss times its number of samples (what Composer's weighting sums over ranks)."""
    losses = F.cross_entropy(out, y, reduction='none')
    if kind_loss == 'topk':
        return losses.topk(TOPK).values.mean() * len(y)
    return losses.sum()


def loss_mean(kind_loss: str, out: torch.Tensor, y: torch.Tensor):
    """The model's loss, as a ComposerModel returns it (fails on fewer than 4 samples for ``'topk'``).

    ``'dict'``: a dict with ``total`` (the mean cross-entropy, which Composer backpropagates) and one
    more logged entry; Composer all-reduces each key, so a shadow rank must return the same keys.
    """
    mean = loss_sum(kind_loss, out, y) / len(y)
    if kind_loss == 'dict':
        return {'total': mean, 'hardest': F.cross_entropy(out, y, reduction='none').max()}
    return mean
