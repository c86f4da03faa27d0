"""The single-process reference for tests/test_inert_shadow.py: uneven training where shadow batches are inert.

Independent of composer_join and Composer. Step ``t`` of an epoch trains the ``t``-th batch of every rank
that has one (``A_t`` of ``W`` ranks, ``S_t`` samples); each rank's batch is cut into microbatches of
``microbatch`` samples (Composer's split). The gradient is that of
``sum over those microbatches of (microbatch loss * its samples) / S_t``, times ``A_t / W`` if
``divide_by_initial_world_size``. A parameter no microbatch of the step used gets no gradient, so SGD
leaves it and its momentum alone. With ``'syncbn'`` the model normalises microbatch index ``k`` over
the union of every rank's ``k``-th microbatch (what ``SyncBatchNorm`` computes, and ``'sumbn'``), and its running
statistics are updated once per microbatch index.
"""

from __future__ import annotations

from typing import Optional

import torch

import toy_inert
from reference import batches_of, optimizer_for
from toy import make_module


def _microbatches(batch: tuple, size) -> list[tuple]:
    x, y = batch
    if not size:
        return [batch]
    return list(zip(x.split(size), y.split(size)))


def train(cfg: dict, step_outputs: Optional[list] = None) -> dict:
    """The module's final state (``state_dict``) after training as ``cfg`` describes.

    With a list ``step_outputs``: per step, the outputs' ``(predicted classes, labels, per-sample losses)`` over the
    union of every rank's real samples of that step (what train metrics compute from).
    """
    world = len(cfg['shards'])
    kind, kind_loss = cfg['model'], cfg.get('loss', 'ce')
    module = toy_inert.make(kind)
    module.train()
    optimizer = optimizer_for(cfg, module.parameters())
    per_rank = [batches_of(cfg, r) for r in range(world)]
    steps = max(len(b) for b in per_rank)
    divide = cfg.get('join', {}).get('divide_by_initial_world_size', True)
    for _ in range(cfg.get('epochs', 1)):
        for t in range(steps):
            active = [r for r in range(world) if t < len(per_rank[r])]
            samples = sum(len(per_rank[r][t][1]) for r in active)
            micro = {r: _microbatches(per_rank[r][t], cfg.get('microbatch')) for r in active}
            total = 0.0
            seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (outputs, labels) of every microbatch
            if kind in ('syncbn', 'sumbn'):  # one normalisation over the union of each microbatch index's samples
                for k in range(max(len(m) for m in micro.values())):
                    parts = [micro[r][k] for r in active if k < len(micro[r])]
                    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                    out = module(x)
                    if kind_loss == 'topk':
                        raise ValueError('topk and syncbn are not combined')
                    total = total + torch.nn.functional.cross_entropy(out, y, reduction='sum')
                    seen.append((out, y))
            else:
                for r in active:
                    for x, y in micro[r]:
                        out = toy_inert.run(module, x, y, r)
                        total = total + toy_inert.loss_sum(kind_loss, out, y)
                        seen.append((out, y))
            if step_outputs is not None:
                out, y = torch.cat([o for o, _ in seen]).detach(), torch.cat([y for _, y in seen])
                step_outputs.append((out.argmax(1), y, torch.nn.functional.cross_entropy(out, y, reduction='none')))
            optimizer.zero_grad(set_to_none=True)
            (total / samples * (len(active) / world if divide else 1.0)).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def evaluate(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, float]:
    """Accuracy and mean cross-entropy of the BatchNorm model in ``state`` on every rank's eval shard at once."""
    from toy import shard

    module = make_module('bn')
    module.load_state_dict(state)
    module.eval()
    parts = [shard(50 + r, n) for r, n in enumerate(cfg['eval_shards'])]
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    with torch.no_grad():
        out = module(x)
    return {
        'MulticlassAccuracy': float((out.argmax(1) == y).float().mean()),
        'MeanLoss': float(torch.nn.functional.cross_entropy(out, y)),
    }
