"""The single-process reference: what uneven data-parallel training should compute, written out directly.

It does not use composer_join or Composer. At step ``t`` of an epoch every rank whose shard still has
a ``t``-th batch is active (``A_t`` of ``W``), ``S_t`` real samples in all; the gradient is the mean of
the per-sample loss gradients over those samples, times ``A_t / W`` if ``divide_by_initial_world_size``
(the default) and times 1 otherwise. Every epoch has as many steps as the longest shard has batches.

BatchNorm: each rank normalises its own batch (no SyncBatchNorm), and DDP broadcasts buffers before
every step from a source rank: rank 0 until it runs out of data, then the highest rank with data,
which stays the source while it has data. After training every rank holds the source's buffers
(UnevenJoin broadcasts them at the end of ``fit``). ``max_steps`` ends training early (as a
``max_duration`` in batches does).
"""

from __future__ import annotations

import math

import torch

from toy import lm_batch, lm_shard, lm_token_losses, make_lm, make_module, per_sample_loss, shard


def batches_of(cfg: dict, rank: int) -> list:
    b = cfg['batch_size']
    if cfg.get('model') == 'lm':
        seqs = lm_shard(rank, cfg['shards'][rank])
        return [lm_batch(seqs[i : i + b]) for i in range(0, len(seqs), b)]
    x, y = shard(rank, cfg['shards'][rank])
    if cfg.get('batch_plan') is not None:  # per rank, the size of each batch in order (as token budgets give)
        ends = torch.tensor(cfg['batch_plan'][rank]).cumsum(0).tolist()
        return [(x[e - n : e], y[e - n : e]) for n, e in zip(cfg['batch_plan'][rank], ends)]
    return [(x[i : i + b], y[i : i + b]) for i in range(0, len(y), b)]


def optimizer_for(cfg: dict, params) -> torch.optim.Optimizer:
    """The scenario's optimizer (the ranks build theirs with this too): SGD with ``momentum`` (0.9), or Adam."""
    if cfg.get('optimizer', 'sgd') == 'adam':
        return torch.optim.Adam(params, lr=cfg.get('lr', 0.01))
    return torch.optim.SGD(params, lr=cfg.get('lr', 0.1), momentum=cfg.get('momentum', 0.9))


def train(cfg: dict, divide: bool = True) -> dict:
    """Parameters (and BatchNorm buffers per rank) after training as ``cfg`` describes."""
    world = len(cfg['shards'])
    lm = cfg.get('model') == 'lm'
    module = make_lm() if lm else make_module(cfg.get('model', 'mlp'))
    module.train()
    optimizer = optimizer_for(cfg, module.parameters())
    base_lr = optimizer.param_groups[0]['lr']
    per_rank = [batches_of(cfg, r) for r in range(world)]
    steps = max(len(b) for b in per_rank)
    epochs = cfg.get('epochs', 1)
    total = steps * epochs
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    updated = [dict(buffers) for _ in range(world)]  # each rank's buffers after its own last forward
    k, source = 0, 0
    for _ in range(epochs):
        for t in range(steps):
            active = [r for r in range(world) if t < len(per_rank[r])]
            if source not in active:
                source = active[-1]
            if buffers:  # DDP's broadcast before the forward; ranks without data keep what they receive
                buffers = dict(updated[source])
                updated = [updated[r] if r in active else buffers for r in range(world)]
            if cfg.get('schedule') == 'cosine':
                # Composer steps the scheduler after each batch, before the timestamp moves on.
                frac = max(k - 1, 0) / total
                for group in optimizer.param_groups:
                    group['lr'] = base_lr * (1 + math.cos(math.pi * frac)) / 2
            if lm:  # with accumulate_train_batch_on_tokens: the mean over loss-generating tokens
                losses = torch.cat([lm_token_losses(module, per_rank[r][t]) for r in active])
                samples, loss = len(losses), losses.sum()
                active_for_loss = []
            else:
                samples = sum(len(per_rank[r][t][1]) for r in active)
                loss, active_for_loss = 0.0, active
            for r in active_for_loss:
                x, y = per_rank[r][t]
                own = {n: b.clone() for n, b in buffers.items()} if buffers else None
                loss = loss + per_sample_loss(module, x, y, own).sum()
                if own:
                    updated[r] = own
            factor = len(active) / world if divide else 1.0
            optimizer.zero_grad()
            (loss / samples * factor).backward()
            optimizer.step()
            k += 1
            final_active = active
            if k == cfg.get('max_steps'):
                break
        if k == cfg.get('max_steps'):
            break
    # UnevenJoin broadcasts the buffers from the source at the end of fit (as torch's join does)
    final_buffers = [updated[source] if source in final_active else buffers for _ in range(world)]
    return {
        'params': {n: p.detach().clone() for n, p in module.named_parameters()},
        'buffers': final_buffers,
        'steps_per_epoch': steps,
    }


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(
        float((a[k].detach().cpu().double() - b[k].detach().cpu().double()).abs().max()) for k in a
    )  # on the CPU


def assert_like_reference(name: str, per_rank: list[dict], ref_params: dict[str, torch.Tensor], tol: float) -> None:
    """Every rank's final ``params`` within ``tol`` of ``ref_params``, and its ``step_params`` (the
    parameters after each step) identical to rank 0's: the replicas never drift apart."""
    for rank, res in enumerate(per_rank):
        diff = max_abs_diff(res['params'], ref_params)
        assert diff < tol, f'{name}: rank {rank} is {diff:.2e} from the reference'
        assert len(res['step_params']) == len(per_rank[0]['step_params'])
        for step, (a, b) in enumerate(zip(per_rank[0]['step_params'], res['step_params'])):
            assert torch.equal(a, b), f'{name}: rank {rank} differs from rank 0 after step {step}'


def evaluate(flat_params: torch.Tensor, cfg: dict) -> dict[str, float]:
    """Accuracy and mean cross-entropy of the model with ``flat_params`` on all ranks' eval data at once."""
    from toy import shard

    module = make_module(cfg.get('model', 'mlp'))
    torch.nn.utils.vector_to_parameters(flat_params, module.parameters())
    module.eval()
    if cfg.get('eval_shards') is not None:
        parts = [shard(50 + r, n) for r, n in enumerate(cfg['eval_shards'])]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        x, y = shard(99, cfg['eval_map'])
    with torch.no_grad():
        out = module(x)
    return {
        'correct': int((out.argmax(1) == y).sum()),
        'total': len(y),
        'MulticlassAccuracy': float((out.argmax(1) == y).float().mean()),
        'MeanLoss': float(torch.nn.functional.cross_entropy(out, y)),
    }


def assert_evaluation_like_reference(per_rank: list[dict], cfg: dict) -> None:
    """Every rank's last evaluation equals :func:`evaluate` of rank 0's final weights on all ranks' eval data."""
    import pytest

    flat = torch.cat([p.flatten() for p in per_rank[0]['params'].values()])
    expected = evaluate(flat, cfg)
    for res in per_rank:
        assert res['eval']['MulticlassAccuracy'][-1] == pytest.approx(expected['MulticlassAccuracy'], abs=1e-7)
        assert res['eval']['MeanLoss'][-1] == pytest.approx(expected['MeanLoss'], abs=1e-6)
