"""Automatic microbatching on CPU ranks: Composer's own OOM retry, driven by chosen out-of-memory errors.

Composer accepts ``device_train_microbatch_size='auto'`` only on GPUs. Here the Trainer is built with
an integer microbatch size, then :func:`enable_auto_microbatching` switches ``state.auto_microbatching``
on (and the evaluator's), which is all Composer's OOM path looks at. The model then raises Composer's
recognised ``RuntimeError('CUDA out of memory. ...')`` on chosen ranks, at chosen steps, at a chosen
point (``forward``, ``loss`` or ``backward``: the first backward node of the loss, before any gradient
collective), while the microbatch size in force is above a limit, as a real memory cap would. Composer
halves the microbatch size and re-splits the batch on every rank. Not a test module.

``cfg['oom']`` is a list of ``{'ranks': [..], 'steps': [..], 'point': 'forward'|'loss'|'backward',
'limit': n}`` (``steps``: the global batch index, ``timestamp.batch``; ``'eval'`` in ``steps`` means every
evaluation batch); everything else is :func:`rank_scenarios.train`'s config.
"""

from __future__ import annotations

from typing import Any

import torch
from composer.utils import dist

import rank_scenarios

OOM_MESSAGE = 'CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test on purpose)'


class _OOMInBackward(torch.autograd.Function):
    """Identity forward; its backward raises the OOM, before any parameter gradient (so before any sync)."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(OOM_MESSAGE)


class OOMInjector:
    """Raises Composer's recognised CUDA OOM from ``model`` where ``rules`` say (see the module docstring)."""

    def __init__(self, trainer, rules: list[dict]):
        self.state = trainer.state
        self.rules = rules
        self.rank = dist.get_global_rank()
        self.raised: list[tuple[int, str, int]] = []  # (step, point, microbatch size in force)

    def _size(self, evaluating: bool) -> int:
        if evaluating:
            return next((e.device_eval_microbatch_size for e in self.state.evaluators), 0)  # predict(): none
        return self.state.device_train_microbatch_size

    def due(self, point: str) -> bool:
        evaluating = not self.state.model.training
        step = 'eval' if evaluating else int(self.state.timestamp.batch)
        size = self._size(evaluating)
        for rule in self.rules:
            if rule['point'] == point and self.rank in rule['ranks'] and step in rule['steps'] and size > rule['limit']:
                self.raised.append((-1 if evaluating else step, point, size))
                return True
        return False

    def install(self, model) -> None:
        forward, loss = model.forward, model.loss  # Composer's eval_forward calls forward

        def oom_forward(batch):
            if self.due('forward'):
                raise RuntimeError(OOM_MESSAGE)
            out = forward(batch)
            return _OOMInBackward.apply(out) if self.due('backward') else out

        def oom_loss(outputs, batch):
            if self.due('loss'):
                raise RuntimeError(OOM_MESSAGE)
            return loss(outputs, batch)

        model.forward, model.loss = oom_forward, oom_loss


def enable_auto_microbatching(trainer) -> None:
    """What ``'auto'`` would give on a GPU, as far as Composer's OOM retry is concerned (test-only).

    Under FSDP1, also Composer's OOM checks around every FSDP module (which ``'auto'`` installs at
    construction, ``Trainer.__init__`` through ``prepare_fsdp_module``).
    """
    from composer.distributed.shared_utils import add_fsdp_oom_hooks
    from composer.trainer._patch_pytorch import patch_unshard_for_automicrobatching

    state = trainer.state
    state.auto_microbatching = True
    for evaluator in state.evaluators:
        evaluator.auto_microbatching = True
    if state.fsdp_enabled and not state.automicrobatch_fsdp_hook_handles:
        state.automicrobatch_fsdp_hook_handles = add_fsdp_oom_hooks(state.model, state.device)
        patch_unshard_for_automicrobatching(auto_microbatch_size_found=False)


class _MicrobatchSizes(rank_scenarios.Callback):
    """The microbatch sizes in force at each training step's end and at each evaluation's end."""

    def __init__(self):
        self.train: list[int] = []
        self.eval: list[int] = []

    def batch_end(self, state, logger):
        self.train.append(int(state.device_train_microbatch_size))

    def eval_end(self, state, logger):
        self.eval.extend(int(e.device_eval_microbatch_size) for e in state.evaluators)


def train_oom(cfg: dict) -> dict[str, Any]:
    """:func:`rank_scenarios.train` with automatic microbatching on and OOMs where ``cfg['oom']`` says."""
    built: list = []
    sizes = _MicrobatchSizes()

    def trainer_with_ooms(**kwargs):
        kwargs['callbacks'] = list(kwargs.get('callbacks') or []) + [sizes]
        trainer = original(**kwargs)
        enable_auto_microbatching(trainer)
        injector = OOMInjector(trainer, cfg.get('oom', []))
        injector.install(trainer._original_model)
        built.append(injector)
        return trainer

    module = rank_scenarios
    if cfg.get('wrapper') is not None:  # FSDP1, FSDP2 (or DDP) through tests/scenarios_fsdp.py
        import scenarios_fsdp as module
    original = module.quiet_trainer
    module.quiet_trainer = trainer_with_ooms
    try:
        result = module.train(cfg)
    finally:
        module.quiet_trainer = original
    result['ooms_raised'] = built[0].raised if built else []
    result['train_microbatch_sizes'] = sizes.train
    result['eval_microbatch_sizes'] = sizes.eval
    return result
