"""Rank-side scenarios for tests/test_activation_checkpointing.py: activation checkpointing under DDP and FSDP.

Not a test module. Models:

* ``toy.Deep`` (``inp`` -> ``block`` -> ``out``) with ``torch.utils.checkpoint`` around ``block``, reentrant or
  not (``cfg['checkpoint']``), under DDP's default, ``static_graph``, ``find_unused_parameters``, or with a marked
  communicating module (:class:`Talk`, ``shadow_forward = True``); under FSDP1 with Composer's own
  ``activation_checkpointing`` (``composer_checkpointing``: ``block`` its own FSDP unit, wrapped by Composer's
  checkpoint wrapper, reentrant or not); under FSDP2 with ``block`` skipped on small batches (``skip_below``);
* the tiny GPT-2 of :mod:`reference_hf` with Hugging Face's ``gradient_checkpointing_enable()`` (reentrant, as
  transformers 4.51 defaults), with and without a PEFT LoRA adapter (``HuggingFaceModel(peft_config=...)``).

Every function returns the trained parameters, the samples trained, the error (its type and message) if the fit
raised, and how many of UnevenJoin's hooks are left on the model after it, with or without UnevenJoin
(``cfg['join']`` None: stock Composer).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as tdist
from composer import Trainer
from composer.models import ComposerModel, HuggingFaceModel
from composer.utils import FSDP2Config, dist
from torch.utils.data import DataLoader

import reference_hf
from composer_join import UnevenJoin
from composer_join.wrappers.fsdp import GradientUnits
from rank_scenarios import AsksForUnusedParameters, ToyModel, make_loader, make_optimizer, quiet_trainer
from reference_hf import collate, lora_config, make_gpt2, train_shard
from scenarios_fsdp import cpu_fsdp_workarounds, full_params
from scenarios_hf import Sequences
from scenarios_undo import RaiseAt


class Talk(torch.nn.Module):
    """A forward that communicates and says so (``shadow_forward = True``): an all-reduce of its sample count.

    It returns its input unchanged, so the single-process reference is the model without it.
    """

    shadow_forward = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tdist.all_reduce(torch.tensor([float(len(h))], device=h.device))
        return h


def _parallelism(cfg: dict) -> Optional[dict]:
    if cfg['wrapper'] == 'fsdp2':
        return {'fsdp': FSDP2Config()}
    if cfg['wrapper'] != 'fsdp1':
        return None  # DDP
    composer = cfg.get('composer_checkpointing', False)
    return {
        'fsdp': {
            'sharding_strategy': 'FULL_SHARD',
            'activation_checkpointing': composer,
            'activation_checkpointing_reentrant': composer and cfg['checkpoint'] == 'reentrant',
        }
    }


def hooks_left(model: torch.nn.Module) -> int:
    """UnevenJoin's hooks still on ``model``: autograd's on its parameters, forward pre-hooks on its modules."""
    on_params = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())  # only UnevenJoin's here
    ours = [h for m in model.modules() for h in m._forward_pre_hooks.values() if isinstance(h.__self__, GradientUnits)]
    return on_params + len(ours)


def _fit(cfg: dict, model: ComposerModel, loader: Any, optimizer: torch.optim.Optimizer) -> tuple[Trainer, Any]:
    """Composer ``fit`` for ``cfg['epochs']``: the trainer, and the error the fit raised (as text) or None.

    ``raise_at``: ``(step, event)``, every rank raises there (:class:`scenarios_undo.RaiseAt`).
    """
    join = [UnevenJoin()] if cfg.get('join') is not None else []
    trainer = quiet_trainer(
        model=model,
        train_dataloader=loader,
        max_duration=f'{cfg["epochs"]}ep',
        optimizers=optimizer,
        algorithms=join + ([AsksForUnusedParameters()] if cfg.get('find_unused') else []),
        callbacks=[RaiseAt(*cfg['raise_at'])] if cfg.get('raise_at') else [],
        parallelism_config=_parallelism(cfg),
    )
    if cfg.get('static_graph'):
        trainer.state.model._set_static_graph()  # torch's own switch; Composer has no option for it
    try:
        trainer.fit()
    except Exception as e:  # stock Composer's failures are part of what is measured
        return trainer, f'{type(e).__name__}: {e}'[:400]
    return trainer, None


def toy(cfg: dict) -> dict[str, Any]:
    """``toy.Deep`` on this rank's shard of the toy data, ``block`` checkpointed as ``cfg`` says."""
    if cfg['wrapper'] != 'ddp':
        cpu_fsdp_workarounds()
    model = ToyModel('deep')
    deep = model.module
    if cfg.get('composer_checkpointing'):  # Composer checkpoints block, its own FSDP1 unit (marked on our module)
        deep.block._fsdp_wrap = True
        deep.block._activation_checkpointing = True
    else:
        deep.checkpoint = cfg['checkpoint']
    if cfg.get('talk'):
        deep.talk = Talk()
    deep.skip_below = cfg.get('skip_below', 0)
    trainer, error = _fit(cfg, model, make_loader(cfg, dist.get_global_rank()), make_optimizer(cfg, model.parameters()))
    params = full_params(trainer, 'deep') if error is None or cfg['wrapper'] == 'ddp' else {}
    trainer.close()
    return {
        'error': error,
        'params': params,
        'samples': int(trainer.state.timestamp.sample),
        'hooks_left': hooks_left(model),
    }


def hf(cfg: dict) -> dict[str, Any]:
    """The tiny GPT-2 with ``gradient_checkpointing_enable()``, and a LoRA adapter with ``cfg['lora']``."""
    gpt2 = make_gpt2()
    if cfg['checkpoint'] == 'reentrant':
        gpt2.gradient_checkpointing_enable()  # transformers 4.51: use_reentrant=True unless told otherwise
    elif cfg['checkpoint'] is not None:
        gpt2.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
    torch.manual_seed(1)  # the adapter's initial weights (reference_hf.make_lm builds it the same way)
    model = HuggingFaceModel(gpt2, use_logits=True, peft_config=lora_config() if cfg.get('lora') else None)
    shard = train_shard(dist.get_global_rank(), cfg['shards'][dist.get_global_rank()])
    loader = DataLoader(Sequences(shard), batch_size=cfg['batch_size'], collate_fn=collate)
    trainer, error = _fit(cfg, model, loader, reference_hf.optimizer_for(cfg, model.parameters()))
    trainer.close()
    params = {k: v.detach().clone() for k, v in model.model.named_parameters()}
    return {
        'error': error,
        'params': params,
        'samples': int(trainer.state.timestamp.sample),
        'hooks_left': hooks_left(model),
    }
