"""The single-process reference for BatchNorm under FSDP, where buffers are not broadcast.

Same gradient semantics as :mod:`reference` (NOTES.md): at step ``t``, ``A_t`` of ``W`` ranks have
data, ``S_t`` real samples in all; the gradient is the mean of the per-sample loss gradients over
those samples, times ``A_t / W`` if ``divide_by_initial_world_size``. What differs is where buffers
live: FSDP (1 and 2) never broadcasts them, so every rank keeps its own BatchNorm statistics,
updated by its own real forwards only (shadow forwards leave them untouched), from the initial
values. With ``microbatch``, each rank's batch is split into microbatches of that many samples,
each normalised on its own (as in training) and each updating the rank's statistics once.
"""

from __future__ import annotations

from reference import batches_of, optimizer_for
from toy import make_module, per_sample_loss


def train(cfg: dict, divide: bool = True) -> dict:
    """Parameters and each rank's own buffers after training as ``cfg`` describes (no schedule, MLP/BN models)."""
    world = len(cfg['shards'])
    module = make_module(cfg.get('model', 'mlp'))
    module.train()
    optimizer = optimizer_for(cfg, module.parameters())
    per_rank = [batches_of(cfg, r) for r in range(world)]
    steps = max(len(b) for b in per_rank)
    initial = {k: v.clone() for k, v in module.named_buffers()}
    own = [{k: v.clone() for k, v in initial.items()} for _ in range(world)]
    size = cfg.get('microbatch') or cfg['batch_size']
    for _ in range(cfg.get('epochs', 1)):
        for t in range(steps):
            active = [r for r in range(world) if t < len(per_rank[r])]
            samples = sum(len(per_rank[r][t][1]) for r in active)
            loss = 0.0
            for r in active:
                x, y = per_rank[r][t]
                for i in range(0, len(y), size):  # each microbatch updates the rank's buffers in place
                    loss = loss + per_sample_loss(module, x[i : i + size], y[i : i + size], own[r]).sum()
            factor = len(active) / world if divide else 1.0
            optimizer.zero_grad()
            (loss / samples * factor).backward()
            optimizer.step()
    return {
        'params': {n: p.detach().clone() for n, p in module.named_parameters()},
        'buffers': own,
    }
