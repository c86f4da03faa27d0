"""A tiny sequence classifier whose batches differ in shape between dataloaders, shared by ranks and reference.

Issue 40's second case: a run evaluates (or trains on) one dataloader, then another whose batches have another
sequence length and a key the first has not (``mask``). The model takes both; its per-token output ``tokens``
(``n x L``, zero where masked) feeds a list-state metric (``CatMetric``) whose states are shaped by the
dataloader, so a rank that shadows with what it learned from the other dataloader gives states the sync cannot
concatenate. Everything is deterministic: :func:`seq_shard` gives the same samples in every process.

:func:`reference` is the single-process reference, independent of Composer and composer_join: fits (SGD with
momentum, kept across fits, as one optimizer is), evaluations and predictions in order, where step ``t`` of a fit
trains the ``t``-th batch of every rank that has one (``A_t`` of ``W``, ``S_t`` samples) with the gradient of the
mean loss over those samples times ``A_t / W``. Not a test module.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

VOCAB, DIM, CLASSES = 13, 4, 3
LR, MOMENTUM = 0.1, 0.9


class SeqModule(torch.nn.Module):
    """Embedding, ``tanh``, mean over the (unmasked) positions, a linear head: logits and per-token scores."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, CLASSES)

    def forward(self, input_ids: torch.Tensor, mask: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        e = torch.tanh(self.embed(input_ids))
        m = torch.ones(input_ids.shape, dtype=e.dtype, device=e.device) if mask is None else mask.to(e.dtype)
        pooled = (e * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1)
        return {'logits': self.head(pooled), 'tokens': e.sum(-1) * m}


def seq_shard(seed: int, size: int, length: int, masked: bool) -> list[dict[str, torch.Tensor]]:
    """``size`` samples: ``input_ids`` of ``length`` tokens, a label, and (``masked``) a ``mask`` of 1 to ``length``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, length), generator=g)
    labels = torch.randint(0, CLASSES, (size,), generator=g)
    ends = torch.randint(1, length + 1, (size,), generator=g)
    out = []
    for i in range(size):
        sample = {'input_ids': ids[i], 'labels': labels[i]}
        if masked:
            sample['mask'] = (torch.arange(length) < ends[i]).long()
        out.append(sample)
    return out


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def batches(samples: list[dict[str, torch.Tensor]], batch_size: int) -> list[dict[str, torch.Tensor]]:
    return [collate(samples[i : i + batch_size]) for i in range(0, len(samples), batch_size)]


def run(module: SeqModule, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return module(batch['input_ids'], batch.get('mask'))


def reference(plan: list[tuple[str, list[list[dict]]]], batch_size: int) -> list[dict[str, Any]]:
    """What each call of ``plan`` gives, in one process: per call ``(kind, per-rank samples)``, kind ``'fit'``,
    ``'eval'`` or ``'predict'``.

    A fit gives its per-step train ``Tokens`` (the real samples' rows, in rank order, before the step's update) and
    the parameters after it; an evaluation ``Tokens`` (every rank's rows, in rank order) and ``MeanLoss``; a
    prediction each rank's ``tokens`` outputs, concatenated.
    """
    module = SeqModule()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    out: list[dict[str, Any]] = []
    for kind, per_rank in plan:
        world = len(per_rank)
        rank_batches = [batches(s, batch_size) for s in per_rank]
        if kind == 'fit':
            steps = max(len(b) for b in rank_batches)
            tokens = []
            for t in range(steps):
                active = [r for r in range(world) if t < len(rank_batches[r])]
                outputs = [run(module, rank_batches[r][t]) for r in active]
                labels = torch.cat([rank_batches[r][t]['labels'] for r in active])
                logits = torch.cat([o['logits'] for o in outputs])
                tokens.append(torch.cat([o['tokens'] for o in outputs]).detach().clone())
                loss = F.cross_entropy(logits, labels) * len(active) / world
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            params = {n: p.detach().clone() for n, p in module.named_parameters()}
            out.append({'train_tokens': tokens, 'params': params})
            continue
        with torch.no_grad():
            outputs = [[run(module, b) for b in rb] for rb in rank_batches]
        if kind == 'eval':
            all_out = [o for per in outputs for o in per]
            labels = torch.cat([b['labels'] for rb in rank_batches for b in rb])
            logits = torch.cat([o['logits'] for o in all_out])
            out.append(
                {
                    'Tokens': torch.cat([o['tokens'] for o in all_out]),
                    'MeanLoss': float(F.cross_entropy(logits, labels)),
                }
            )
        else:
            out.append({'predictions': [torch.cat([o['tokens'] for o in per]) if per else None for per in outputs]})
    return out
