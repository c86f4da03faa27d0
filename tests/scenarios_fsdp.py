"""What the ranks of tests/test_fsdp.py run: Composer training under FSDP1, FSDP2 and DDP, with and without UnevenJoin.

Not a test module. Two workarounds for running Composer's FSDP on CPU with gloo live here, and
only here (they are facts about torch and Composer on CPU, not about composer_join):

* **gloo's ``reduce_scatter_tensor`` ignores ``ReduceOp.AVG`` and sums.** FSDP2 asks for AVG for
  fp32 gradients (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``), so on gloo its
  gradients come out ``W`` times too large. :func:`cpu_fsdp_workarounds` emulates AVG: sum, then
  divide by the group size. (FSDP1 divides by itself and asks for SUM, so it is unaffected.)
* **Composer's FSDP1 passes ``device_id=torch.cuda.current_device()``** to
  ``FullyShardedDataParallel`` (``composer/distributed/dist_strategy.py``), which fails without
  CUDA. :func:`cpu_fsdp_workarounds` makes ``torch.cuda.current_device()`` return the CPU device.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as tdist
from composer import Callback, Trainer
from composer.loggers import InMemoryLogger
from composer.utils import FSDP2Config, dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn.parallel import DistributedDataParallel

import devices
import scenarios_readahead
from composer_join import UnevenJoin, is_shadow_step
from composer_join.collectives import CollectiveCounter
from composer_join.core import exchange
from rank_scenarios import ToyModel, error_if_expected, make_evaluator, make_loader, make_optimizer, quiet_trainer
from toy import make_module, unpack

_PATCHED = False


def cpu_fsdp_workarounds() -> None:
    """Make Composer's FSDP1 and FSDP2 run correctly on CPU with gloo (see the module docstring). Idempotent.

    Nothing to do on GPUs (``COMPOSER_JOIN_DEVICE=gpu``, NCCL).
    """
    global _PATCHED
    if _PATCHED or devices.device() != 'cpu':
        return
    _PATCHED = True
    torch.cuda.current_device = lambda: torch.device('cpu')
    summed = tdist.reduce_scatter_tensor

    def reduce_scatter_tensor(output, input, op=tdist.ReduceOp.SUM, group=None, async_op=False):
        if op != tdist.ReduceOp.AVG:
            return summed(output, input, op=op, group=group, async_op=async_op)
        work = summed(output, input, op=tdist.ReduceOp.SUM, group=group, async_op=False)
        output.div_(tdist.get_world_size(group))
        return work if async_op else None

    tdist.reduce_scatter_tensor = reduce_scatter_tensor


def parallelism(kind: Optional[str], cfg: dict) -> Optional[dict]:
    """Composer 0.32.1's spelling of each wrapper: ``FSDP2Config`` for FSDP2, a dict (→ ``FSDPConfig``) for FSDP1."""
    if kind == 'fsdp2':
        return {'fsdp': FSDP2Config(state_dict_type=cfg.get('state_dict_type', 'sharded'))}
    if kind == 'fsdp1':
        return {'fsdp': {'sharding_strategy': 'FULL_SHARD', 'state_dict_type': cfg.get('state_dict_type', 'full')}}
    return None  # DDP


class Recorder(Callback):
    """Per step on this rank: shadow or not, and the size of every microbatch the forward saw."""

    def __init__(self):
        self.start_batch = -1
        self.shadow: list[bool] = []
        self.losses: list[float] = []
        self.microbatch_sizes: list[list[int]] = []
        self.steps: list[dict[str, Any]] = []  # per step: epoch, and the sample ids of batches that carry them
        # per evaluation: the samples a callback counts at EVAL_BEFORE_FORWARD where is_shadow_step is False, and
        # whether it said True at an EVAL_BATCH_END
        self.eval_samples: list[int] = []
        self.eval_shadow_at_batch_end: list[bool] = []

    def fit_start(self, state, logger):
        self.start_batch = int(state.timestamp.batch)

    def before_train_batch(self, state, logger):
        self.microbatch_sizes.append([])
        batch, shadow = state.batch, is_shadow_step(state)
        ids = (
            [int(i) for i in batch[2]] if isinstance(batch, (tuple, list)) and len(batch) == 3 and not shadow else None
        )
        self.steps.append({'epoch': int(state.timestamp.epoch), 'ids': ids})

    def before_forward(self, state, logger):
        x = state.batch[0] if isinstance(state.batch, (tuple, list)) else state.batch
        self.microbatch_sizes[-1].append(len(x['x']) if isinstance(x, dict) else len(x))

    def batch_end(self, state, logger):
        self.shadow.append(is_shadow_step(state))

    def eval_start(self, state, logger):
        self.eval_samples.append(0)

    def eval_before_forward(self, state, logger):
        if not is_shadow_step(state):  # a callback counting the samples evaluated (a stand-in's are not data)
            x = state.batch[0] if isinstance(state.batch, (tuple, list)) else state.batch
            self.eval_samples[-1] += len(x['x']) if isinstance(x, dict) else len(x)

    def eval_batch_end(self, state, logger):
        self.eval_shadow_at_batch_end.append(is_shadow_step(state))


class FSDPToyModel(ToyModel):
    """The toy model; ``Branchy`` gets its labels even when FSDP1 has wrapped it (``isinstance`` no longer holds)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind

    def forward(self, batch):
        x, y = unpack(batch)
        self.forward_sizes.append(len(x))
        return self.module(x, y) if self.kind == 'branch' else self.module(x)


def full_params(trainer: Trainer, kind: str) -> dict[str, torch.Tensor]:
    """The trained parameters, whole (FSDP gathers its shards: a collective on every rank)."""
    model = trainer.state.model
    if isinstance(model, DistributedDataParallel):
        return {n: p.detach().clone() for n, p in model.module.module.named_parameters()}
    names = {n for n, _ in make_module(kind).named_parameters()}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k[len('module.') :]: v.detach().cpu().clone() for k, v in state.items() if k[len('module.') :] in names}


def local_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's own buffers, named as in the unwrapped toy module."""
    module = model.module.module if isinstance(model, DistributedDataParallel) else model.module
    return {n.replace('_fsdp_wrapped_module.', ''): b.detach().clone() for n, b in module.named_buffers()}


@contextlib.contextmanager
def pairwise_sums(on: bool) -> Iterator[None]:
    """Within the block (if ``on``), ``TorchExchange.host_sum`` (the FSDP unit check's sum) sums pairwise at any
    world size, as it does from ``PAIRWISE_FROM`` ranks on."""
    saved = exchange.PAIRWISE_FROM
    exchange.PAIRWISE_FROM = 1 if on else saved
    try:
        yield
    finally:
        exchange.PAIRWISE_FROM = saved


def host_sums(payloads: tuple[int, ...] = (1, 17, 257)) -> dict[str, Any]:
    """``TorchExchange.host_sum`` both ways on this launch's ranks, against the exact sums: random integers (int32,
    int64, uint8 counts), each rank's own; the sums every rank got, and whether each was exact."""
    from composer_join.core.catalogue import FSDP_UNITS

    rank, world = dist.get_global_rank(), dist.get_world_size()
    ex = exchange.TorchExchange()
    said = FSDP_UNITS.said('the test of host_sum')
    exact, sums = [], []
    for payload in payloads:
        for dtype, high in ((torch.int32, 2**20), (torch.int64, 2**40), (torch.uint8, 256 // world)):
            gen = torch.Generator().manual_seed(payload)
            every = torch.randint(0, high, (world, payload), dtype=dtype, generator=gen)
            for pairwise_from in (world + 1, 1):
                mine = every[rank].clone()
                got = ex.host_sum(mine, said, pairwise_from=pairwise_from)
                exact.append(torch.equal(got, every.sum(0, dtype=dtype)) and torch.equal(mine, every[rank]))
                sums.append(got.tolist())
    return {'exact': exact, 'sums': sums}


def train(cfg: dict, recorder: Optional[Recorder] = None) -> dict[str, Any]:
    """One Composer ``fit`` on this rank's shard under ``cfg['wrapper']`` (``fsdp1``, ``fsdp2`` or ``ddp``)."""
    cpu_fsdp_workarounds()
    rank = dist.get_global_rank()
    kind = cfg.get('model', 'mlp')
    model = FSDPToyModel(kind)
    join = UnevenJoin(**cfg['join']) if cfg.get('join') is not None else None
    recorder, memory, counter = recorder or Recorder(), InMemoryLogger(), CollectiveCounter()
    checkpoint = {}
    if cfg.get('save_folder'):
        checkpoint = dict(
            save_folder=cfg['save_folder'],
            save_interval=cfg['save_interval'],
            save_overwrite=True,
            save_num_checkpoints_to_keep=-1,
        )
    if cfg.get('load_path'):
        checkpoint['load_path'] = cfg['load_path']
    trainer = quiet_trainer(
        model=model,
        # ids: samples (x, y, id), the shard with or without len() (tests/scenarios_readahead.py)
        train_dataloader=scenarios_readahead.make_loader(cfg, rank) if cfg.get('ids') else make_loader(cfg, rank),
        max_duration=cfg.get('max_duration', f'{cfg.get("epochs", 1)}ep'),
        optimizers=make_optimizer(cfg, model.parameters()),
        algorithms=[join] if join is not None else [],
        callbacks=[recorder] + ([counter] if cfg.get('count_collectives') else []),
        loggers=[memory],
        device_train_microbatch_size=cfg.get('microbatch'),
        parallelism_config=parallelism(cfg['wrapper'], cfg),
        eval_dataloader=make_evaluator(cfg, rank),
        eval_interval=cfg.get('eval_interval', 1),
        **checkpoint,
    )
    with pairwise_sums(cfg.get('pairwise', False)):
        error = error_if_expected(cfg, trainer.eval if cfg.get('eval_only') else trainer.fit)
    params = full_params(trainer, kind) if error is None else {}
    trainer.close()
    ts = trainer.state.timestamp
    return {
        'error': error,
        'params': params,
        'buffers': local_buffers(trainer.state.model),
        'start_batch': recorder.start_batch,
        'shadow': recorder.shadow,
        'microbatch_sizes': recorder.microbatch_sizes,
        'steps': recorder.steps,
        'eval_samples': recorder.eval_samples,
        'eval_shadow_at_batch_end': recorder.eval_shadow_at_batch_end,
        'timestamp': {'batch': int(ts.batch), 'sample': int(ts.sample), 'epoch': int(ts.epoch)},
        'reports': [vars(r).copy() for r in join.reports] if join is not None else [],
        'collectives': counter.steps,
        'eval': {
            k.split('/')[-1]: [float(v) for _, v in vals]
            for k, vals in memory.data.items()
            if k.startswith('metrics/eval/')
        },
        'max_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def train_resumed(cfg: dict, folder: str, batch: int) -> dict[str, Any]:
    """``train(cfg)`` resumed (``load_path``) from the checkpoint saved after global step ``batch`` in ``folder``."""
    found = sorted(p for p in Path(folder).iterdir() if f'ba{batch}' in p.name and 'symlink' not in p.name)
    assert len(found) == 1, f'checkpoint for batch {batch} not found in {sorted(Path(folder).iterdir())}'
    result = train(dict(cfg, load_path=str(found[0])))
    result['resumed_from'] = result.pop('start_batch')
    return result


def train_until_timeout(cfg: dict, train: Callable[..., Any] = train) -> dict[str, Any]:
    """``train(cfg, recorder)`` where a hang is expected: reports the collective timeout that ends it and the steps
    run before (``train``: this module's, or another scenario module's with the same signature)."""
    recorder = Recorder()
    try:
        train(cfg, recorder)
    except RuntimeError as e:
        return {'timed_out': True, 'steps_completed': len(recorder.shadow), 'error': f'{type(e).__name__}: {e}'[:500]}
    return {'timed_out': False, 'steps_completed': len(recorder.shadow), 'error': None}
