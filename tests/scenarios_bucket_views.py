"""Rank-side scenarios for tests/test_bucket_views.py: a fit with shadow steps, with the stand-in's gradients as views
of its kept buckets (issue 52) and with the copy out of fresh zero buckets it replaced. Not a test module."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import torch
from composer.algorithms import GradientClipping
from composer.utils import dist
from torch.nn.parallel import DistributedDataParallel

from composer_join import UnevenJoin
from composer_join.core import compat
from composer_join.shadow import shadow
from rank_scenarios import AsksForUnusedParameters, make_loader, quiet_trainer
from scenarios_inert import InertModel


def copied_match_backward(self: shadow.DDPShadow) -> None:
    """``DDPShadow.match_backward`` before issue 52: fresh zero buckets, each reduced gradient cloned or copied out."""
    if not self._sync:
        return
    self._sync = False
    buckets = compat.zero_grad_buckets(self.ddp)
    reduced = [f.wait() for f in [compat.run_comm_hook(self.ddp, bucket) for bucket in buckets]]
    used: Optional[list[int]] = None
    if self.ddp.find_unused_parameters:
        used_map = torch.zeros_like(compat.local_used_map(self.ddp))
        self.ddp.process_group.allreduce(used_map).wait()
        used = used_map.tolist()
    compat.push_rebuilt_params(self.ddp)
    index = {id(p): i for i, p in enumerate(self._params)}
    with torch.no_grad():
        for bucket, result in zip(buckets, reduced):
            flat = result[0] if isinstance(result, (list, tuple)) else result
            offset = 0
            for p in bucket.parameters():
                n = p.numel()
                if used is None or used[index[id(p)]]:
                    value = shadow._bucket_view(flat[offset : offset + n], p)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)
                offset += n


class KeepsGrads(torch.optim.SGD):
    """SGD whose ``zero_grad`` always zeroes in place (``set_to_none=False``, whatever Composer asks)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)


class NeverZeroes(torch.optim.SGD):
    """SGD whose ``zero_grad`` does nothing: gradients add up across steps (accumulated by hand)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


@contextlib.contextmanager
def ddp_defaults(**kwargs: Any):
    """``DistributedDataParallel(..., **kwargs)`` for every DDP built meanwhile (Composer builds its own)."""
    original = DistributedDataParallel.__init__
    DistributedDataParallel.__init__ = functools.partialmethod(original, **kwargs)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = original  # type: ignore[method-assign]


def _fit(cfg: dict, copied: bool) -> dict[str, Any]:
    rank = dist.get_global_rank()
    model = InertModel(cfg['model'])
    optimizer_class = {'keep': KeepsGrads, 'never': NeverZeroes}.get(cfg.get('zero_grad', ''), torch.optim.SGD)
    optimizer = optimizer_class(model.parameters(), lr=0.05, momentum=0.9)
    algorithms: list[Any] = [UnevenJoin()]
    if cfg.get('find_unused'):
        algorithms.append(AsksForUnusedParameters())
    if cfg.get('clip'):
        algorithms.append(GradientClipping(clipping_type='norm', clipping_threshold=0.05))
    calls = {'n': 0}
    method = copied_match_backward if copied else shadow.DDPShadow.match_backward

    def counted(self: shadow.DDPShadow) -> None:
        calls['n'] += bool(self._sync)
        method(self)

    original = shadow.DDPShadow.match_backward
    shadow.DDPShadow.match_backward = counted  # type: ignore[method-assign]
    try:
        with ddp_defaults(gradient_as_bucket_view=cfg.get('as_view', False)):
            trainer = quiet_trainer(
                model=model,
                train_dataloader=make_loader(cfg, rank),
                max_duration=f'{cfg.get("epochs", 2)}ep',
                optimizers=optimizer,
                algorithms=algorithms,
                device_train_microbatch_size=cfg.get('microbatch'),
                ddp_sync_strategy=cfg.get('sync'),
            )
        trainer.fit()
        trainer.close()
    finally:
        shadow.DDPShadow.match_backward = original  # type: ignore[method-assign]
    params = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    grads = {k: None if v.grad is None else v.grad.detach().clone() for k, v in model.module.named_parameters()}
    momenta = [
        optimizer.state[p]['momentum_buffer'].clone() if 'momentum_buffer' in optimizer.state[p] else None
        for p in model.parameters()
    ]
    return {'params': params, 'grads': grads, 'momenta': momenta, 'shadow_syncs': calls['n']}


def views_and_copies(cfg: dict) -> dict[str, Any]:
    """The same fit with the views (``new``) and with the copies (``old``), on this rank."""
    return {'new': _fit(cfg, copied=False), 'old': _fit(cfg, copied=True)}
