"""The small model and data every distributed test uses, shared by the ranks and the reference.

Everything here is deterministic: rank ``r``'s shard of ``n`` samples is the same in every process,
and ``make_module`` always starts from the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FEATURES, CLASSES, TOKENS = 6, 3, 4


def make_module(kind: str = 'mlp') -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == 'mlp':
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES))
    if kind == 'bn':
        return torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES),
        )
    if kind == 'branch':  # the head ``extra`` is used only by batches whose first label is 0
        return Branchy()
    raise ValueError(kind)


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(FEATURES, CLASSES)
        self.extra = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


POOL = 1000  # samples per rank at most


def shard(rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s own samples, features and labels: the first ``size`` of a fixed pool."""
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(POOL, FEATURES, generator=g), torch.randint(0, CLASSES, (POOL,), generator=g)
    return x[:size], y[:size]


def make_batch(x: torch.Tensor, y: torch.Tensor, fmt: str):
    """A batch in one of the formats Composer users feed: ``tuple``, ``dict`` (with tokens) or ``tensor``."""
    if fmt == 'tuple':
        return x, y
    if fmt == 'dict':
        return {'x': x, 'y': y, 'input_ids': torch.zeros(len(y), TOKENS, dtype=torch.long)}
    if fmt == 'text':  # a list of strings beside the tensors
        return {'x': x, 'y': y, 'text': [f'sample {int(v)}' for v in y]}
    if fmt == 'tensor':
        return torch.cat([x, y[:, None].float()], dim=1)
    raise ValueError(fmt)


def unpack(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        return batch['x'], batch['y']
    if isinstance(batch, torch.Tensor):
        return batch[:, :FEATURES], batch[:, FEATURES].long()
    return batch[0], batch[1]


def logits(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if isinstance(module, Branchy):
        return module(x, use_extra=bool(len(y)) and int(y[0]) == 0)
    return module(x)


def per_sample_loss(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, buffers=None) -> torch.Tensor:
    """Per-sample loss; with ``buffers``, the module runs on (and updates) those buffers instead of its own."""
    if buffers is not None:
        params = dict(module.named_parameters())
        return F.cross_entropy(torch.func.functional_call(module, {**params, **buffers}, (x,)), y, reduction='none')
    return F.cross_entropy(logits(module, x, y), y, reduction='none')
