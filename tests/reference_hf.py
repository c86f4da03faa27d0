"""A tiny GPT-2, its per-rank data, and the single-process reference for it: plain torch + transformers.

No Composer and no composer_join here. The gradient of step ``t`` (NOTES.md), with ``A_t`` of ``W``
ranks holding a ``t``-th batch:

* weighted by samples (Composer's default): the mean over the step's ``S_t`` real sequences of each
  sequence's mean next-token loss, times ``A_t / W``. Hugging Face's loss is the mean over a
  microbatch's loss-generating tokens and Composer weights microbatches by samples, so this holds
  exactly when every sequence has the same number of loss-generating tokens (``padded=False``);
* weighted by tokens (``accumulate_train_batch_on_tokens=True``): the mean over the step's ``T_t``
  loss-generating tokens (labels other than -100 after the shift), times ``A_t / W``.

Evaluation: the per-token mean next-token cross-entropy over all ranks' eval sequences at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, LENGTH = 32, 8


def make_gpt2() -> GPT2LMHeadModel:
    """A two-layer GPT-2 with 16-wide embeddings, no dropout, always the same initial weights."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
    )
    return GPT2LMHeadModel(config)


def lora_config():
    """A PEFT LoRA adapter on GPT-2's attention projections (``Conv1D``, hence ``fan_in_fan_out``)."""
    from peft import LoraConfig

    return LoraConfig(r=2, lora_alpha=4, target_modules=['c_attn'], fan_in_fan_out=True, task_type='CAUSAL_LM')


def make_lm(cfg: dict) -> torch.nn.Module:
    """:func:`make_gpt2`, with a LoRA adapter from seed 1 if ``cfg['lora']`` (what Composer's ``HuggingFaceModel``
    makes of it with ``peft_config=lora_config()`` after ``torch.manual_seed(1)``: only the adapter trains)."""
    model = make_gpt2()
    if not cfg.get('lora'):
        return model
    from peft import get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, lora_config())


def sequences(seed: int, n: int, padded: bool) -> list[torch.Tensor]:
    """``n`` token sequences: all ``LENGTH`` long, or 2 to ``LENGTH`` long if ``padded``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g) if padded else torch.full((n,), LENGTH)
    return [torch.randint(1, VOCAB, (int(k),), generator=g) for k in lengths]


def train_shard(rank: int, n: int, padded: bool = False) -> list[torch.Tensor]:
    return sequences(300 + rank, n, padded)


def eval_shard(rank: int, n: int, padded: bool = False) -> list[torch.Tensor]:
    return sequences(400 + rank, n, padded)


def collate(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face causal-LM batch: right-padded with 0, ``labels`` -100 at padding (the model shifts them)."""
    width = max((len(s) for s in seqs), default=LENGTH)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return {'input_ids': ids, 'attention_mask': mask, 'labels': ids.masked_fill(mask == 0, -100)}


def token_losses(model: GPT2LMHeadModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position next-token losses ``(B, L-1)`` and the mask of loss-generating positions."""
    logits = model(input_ids=batch['input_ids'], attention_mask=batch['attention_mask']).logits[:, :-1]
    target = batch['labels'][:, 1:]
    mask = target != -100
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), target.clamp(min=0).reshape(-1), reduction='none')
    return losses.view(target.shape) * mask, mask


def optimizer_for(cfg: dict, params) -> torch.optim.Optimizer:
    if cfg.get('optimizer', 'sgd') == 'adam':
        return torch.optim.Adam(params, lr=cfg.get('lr', 0.01))
    return torch.optim.SGD(params, lr=cfg.get('lr', 0.1), momentum=0.9)


def train(cfg: dict) -> dict[str, torch.Tensor]:
    """Parameters after training as ``cfg`` describes (UnevenJoin's semantics), in one process."""
    world, b, padded = len(cfg['shards']), cfg['batch_size'], cfg.get('tokens', False)
    divide = (cfg.get('join') or {}).get('divide_by_initial_world_size', True)
    model = make_lm(cfg)
    model.train()
    optimizer = optimizer_for(cfg, model.parameters())
    per_rank = []
    for r, n in enumerate(cfg['shards']):
        seqs = train_shard(r, n, padded)
        per_rank.append([collate(seqs[i : i + b]) for i in range(0, n, b)])
    steps = max(len(batches) for batches in per_rank)
    for _ in range(cfg['epochs']):
        for t in range(steps):
            active = [r for r in range(world) if t < len(per_rank[r])]
            total, count = 0.0, 0
            for r in active:
                losses, mask = token_losses(model, per_rank[r][t])
                if padded:  # every loss-generating token weighs the same
                    total, count = total + losses.sum(), count + int(mask.sum())
                else:  # every sequence weighs the same
                    total, count = total + (losses.sum(1) / mask.sum(1)).sum(), count + len(losses)
            optimizer.zero_grad()
            (total / count * (len(active) / world if divide else 1.0)).backward()
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def evaluate(flat_params: torch.Tensor, cfg: dict) -> dict[str, float]:
    """Per-token mean next-token cross-entropy of the model with ``flat_params`` on all ranks' eval data."""
    model = make_gpt2()
    torch.nn.utils.vector_to_parameters(flat_params, model.parameters())
    model.eval()
    seqs = [s for r, n in enumerate(cfg['eval_shards']) for s in eval_shard(r, n, cfg.get('tokens', False))]
    with torch.no_grad():
        losses, mask = token_losses(model, collate(seqs))
    return {'loss': float(losses.sum() / mask.sum()), 'tokens': int(mask.sum()), 'sequences': len(seqs)}
