"""Models, data and the single-process reference for tests/test_shadow_limits.py (no ``composer_join`` here).

Three models, one per case of issue 46 it covers:

* ``sparse``: an ``nn.Embedding(sparse=True)`` bag (the logits are the sum of a sample's token rows), trained with
  ``torch.optim.SparseAdam``, which moves every row present in the gradient, even with value 0;
* ``mlp``: a plain MLP (DDP's ``static_graph`` with microbatches);
* ``sumbn`` / ``sumbn_refuses``: Linear -> a batch norm over every rank's samples (``shadow_forward = True``) ->
  Tanh -> Linear; ``sumbn_refuses`` adds a module that raises on a zero-sample batch (Hugging Face GPT-2's
  attention reshape: ``cannot reshape tensor of 0 elements``).

Samples carry ids (``1000 * rank + i``); :func:`replay` trains every recorded step in one process: the loss is the
sum over the step's real samples divided by their count, times ``A_t / W``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toy_inert import SumBatchNorm

VOCAB, TOKENS, CLASSES, FEATURES = 32, 3, 4, 4


class Refuses(torch.nn.Module):
    """Identity that cannot take zero samples (as GPT-2's attention reshape cannot)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            raise RuntimeError('cannot reshape tensor of 0 elements into shape [0, -1, 2]')
        return x


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, CLASSES, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x).sum(1)


def make(kind: str, distributed: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == 'sparse':
        return Bag()
    if kind == 'mlp':
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES))
    layers = [torch.nn.Linear(FEATURES, 8), SumBatchNorm(8, distributed), torch.nn.Tanh()]
    layers += [Refuses()] if kind == 'sumbn_refuses' else []
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, CLASSES))


def optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == 'sparse':
        return torch.optim.SparseAdam(list(params), lr=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def data(kind: str, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    y = torch.randint(0, CLASSES, (size,), generator=g)
    if kind == 'sparse':  # rank r's tokens in their own range of rows, so the template's rows are its own
        base = 8 * rank
        return base + torch.randint(0, 16, (size, TOKENS), generator=g), y
    return torch.randn(size, FEATURES, generator=g), y


def replay(kind: str, shards: list[int], steps: list[dict[int, list[int]]]) -> dict[str, torch.Tensor]:
    """One process trains every recorded step (``steps[rank][step]``: the ids of the real samples there)."""
    xs = [data(kind, r, n) for r, n in enumerate(shards)]
    module = make(kind)
    opt = optimizer(kind, module.parameters())
    for step in sorted(steps[0]):
        per_rank = [s.get(step, []) for s in steps]
        ids = [i for part in per_rank for i in part]
        x = torch.stack([xs[i // 1000][0][i % 1000] for i in ids])
        y = torch.stack([xs[i // 1000][1][i % 1000] for i in ids])
        active = sum(1 for part in per_rank if part)
        loss = F.cross_entropy(module(x), y, reduction='sum') / len(ids) * active / len(per_rank)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.named_parameters()}
