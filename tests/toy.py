"""The small model and data every distributed test uses, shared by the ranks and the reference.

Everything here is deterministic: rank ``r``'s shard of ``n`` samples is the same in every process,
and ``make_module`` always starts from the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

FEATURES, CLASSES, TOKENS = 6, 3, 4


def make_module(kind: str = 'mlp') -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == 'mlp':
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES))
    if kind == 'bn':
        return torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 8),
            torch.nn.BatchNorm1d(8),
            torch.nn.Tanh(),
            torch.nn.Linear(8, CLASSES),
        )
    if kind == 'branch':
        return Branchy()
    if kind == 'deep':
        return Deep()
    raise ValueError(kind)


class Branchy(torch.nn.Module):
    """``extra`` adds to the logits of label-0 samples only; a batch without one leaves it unused."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(FEATURES, CLASSES)
        self.extra = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        chosen = (y == 0).nonzero().flatten()
        return out.index_add(0, chosen, self.extra(x[chosen])) if len(chosen) else out


class Deep(torch.nn.Module):
    """``inp`` -> ``block`` (Linear, ReLU, Linear) -> ``out``: ``block`` is what activation checkpointing wraps.

    ``checkpoint``: None (plain), ``'reentrant'`` or ``'non_reentrant'``: ``torch.utils.checkpoint`` around
    ``block`` (the same numbers). ``talk``: a module run after ``inp`` (none here; the ranks may put one in).
    ``skip_below``: ``block`` is skipped on batches of fewer samples (a branch the data chooses).
    """

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(FEATURES, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        self.out = torch.nn.Linear(8, CLASSES)
        self.talk: torch.nn.Module | None = None
        self.checkpoint: str | None = None
        self.skip_below = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.talk is not None:
            h = self.talk(h)
        if len(x) < self.skip_below:
            pass
        elif self.checkpoint is None:
            h = self.block(h)
        else:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.checkpoint == 'reentrant')
        return self.out(torch.tanh(h))


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
        return module(x, y)
    return module(x)


def per_sample_loss(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, buffers=None) -> torch.Tensor:
    """Per-sample loss; with ``buffers``, the module runs on (and updates) those buffers instead of its own."""
    if buffers is not None:
        params = dict(module.named_parameters())
        return F.cross_entropy(torch.func.functional_call(module, {**params, **buffers}, (x,)), y, reduction='none')
    return F.cross_entropy(logits(module, x, y), y, reduction='none')


# A tiny language model on variable-length sequences, for token-weighted gradient accumulation.
VOCAB = 11


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))


def make_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def lm_shard(rank: int, size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s sequences: lengths 2 to 9 tokens, the first ``size`` of a fixed pool."""
    g = torch.Generator().manual_seed(200 + rank)
    lengths = torch.randint(2, 10, (POOL,), generator=g)
    return [torch.randint(0, VOCAB, (int(n),), generator=g) for n in lengths[:size]]


def lm_batch(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence; ``labels`` are the next tokens, -100 where there is none."""
    width = max((len(s) for s in seqs), default=1)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        labels[i, : len(s) - 1] = s[1:]
    return {'input_ids': ids, 'labels': labels}


def lm_tokens(batch: dict) -> dict[str, int]:
    """Composer's token counts: all positions, and the loss-generating ones."""
    return {'total': int(batch['input_ids'].numel()), 'loss_generating': int((batch['labels'] != -100).sum())}


def lm_token_losses(module: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Per loss-generating token losses."""
    out = module(batch['input_ids'])
    mask = batch['labels'] != -100
    return F.cross_entropy(out[mask], batch['labels'][mask], reduction='none')
