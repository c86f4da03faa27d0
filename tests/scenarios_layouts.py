"""What the ranks of tests/test_layouts.py run: hybrid sharding and tensor parallelism under Composer, on CPU.

Not a test module. A scenario gives its data per *data-parallel member* (``shards``); with ``tp`` (tensor
parallelism beside FSDP1), member ``m`` is the TP group of ranks ``m * tp ... m * tp + tp - 1`` (Composer
0.32.1's mesh puts the TP dimension innermost; UnevenJoin reads the groups from the mesh itself), and every
rank of the group reads member ``m``'s shard, as a TP user must give it. ``parallel``:

* ``'hsdp1'``, ``'hsdp1_zero2'``: FSDP1 ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2`` over a 2 x 2 mesh
  (``data_parallel_replicate_degree=2``, ``data_parallel_shard_degree=2``); every rank its own member;
* ``'hsdp2'``: FSDP2 over the same 2 x 2 mesh, through :class:`HybridFSDP2Config` (below);
* ``'tp'``: ``TPConfig(tensor_parallel_degree=tp)`` beside FSDP1 (``FULL_SHARD`` over the members): the toy
  MLP's first layer column-parallel, its last row-parallel.

Test-only CPU workarounds, beside the two of tests/scenarios_fsdp.py (facts about torch and Composer on CPU):

* **Composer 0.32.1 cannot ask for FSDP2 hybrid sharding**: ``FSDP2Config``'s ``data_parallel_*_degree`` are
  read-only properties (``-1`` and ``None``), and a 2-D ``device_mesh`` passed in is replaced by a 1-D one.
  :class:`HybridFSDP2Config` overrides the two properties, so Composer builds the 2-D mesh and FSDP2 shards over
  one dimension and replicates over the other.
* **torch 2.7's ``torch.cpu.Stream.record_event`` returns None**, and FSDP2's hybrid all-reduce waits on the
  event it records; :func:`cpu_hsdp_workarounds` makes it return a (completed) ``torch.cpu.Event``.
* **gloo's ``all_reduce`` has no ``AVG``**, which FSDP2's hybrid all-reduce asks for: emulated, sum then divide
  (as tests/scenarios_fsdp.py does for ``reduce_scatter_tensor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as tdist
from composer.utils import FSDP2Config, TPConfig, dist
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, DistributedSampler

import devices
import scenarios_fsdp
from composer_join import ExactDistributedSampler, UnevenJoin
from rank_scenarios import Indexed, error_if_expected, make_optimizer, quiet_trainer
from scenarios_fsdp import FSDPToyModel, Recorder, full_params
from scenarios_readahead import make_loader as id_loader
from toy import shard

_PATCHED = False


@dataclass
class HybridFSDP2Config(FSDP2Config):
    """``FSDP2Config`` with the data-parallel degrees Composer 0.32.1 keeps read-only (test-only, module docstring)."""

    replicate: int = 2
    shard: int = 2

    @property
    def data_parallel_shard_degree(self) -> int:  # type: ignore[override]
        return self.shard

    @property
    def data_parallel_replicate_degree(self) -> Optional[int]:  # type: ignore[override]
        return self.replicate


def cpu_hsdp_workarounds() -> None:
    """FSDP2 hybrid sharding on CPU with gloo (the module docstring). Idempotent; nothing to do on GPUs."""
    global _PATCHED
    scenarios_fsdp.cpu_fsdp_workarounds()
    if _PATCHED or devices.device() != 'cpu':
        return
    _PATCHED = True
    torch.cpu.Stream.record_event = lambda self, event=None: event or torch.cpu.Event()  # type: ignore[method-assign]
    summed = tdist.all_reduce

    def all_reduce(tensor, op=tdist.ReduceOp.SUM, group=None, async_op=False):
        if op != tdist.ReduceOp.AVG:
            return summed(tensor, op=op, group=group, async_op=async_op)
        summed(tensor, op=tdist.ReduceOp.SUM, group=group, async_op=False)
        tensor.div_(tdist.get_world_size(group))
        return None

    tdist.all_reduce = all_reduce


def parallelism(cfg: dict) -> dict:
    """Composer 0.32.1's ``parallelism_config`` for ``cfg['parallel']``."""
    layout = cfg['parallel']
    state_dict = cfg.get('state_dict_type', 'sharded')
    if layout in ('hsdp1', 'hsdp1_zero2'):
        strategy = 'HYBRID_SHARD' if layout == 'hsdp1' else '_HYBRID_SHARD_ZERO2'
        fsdp = dict(
            sharding_strategy=strategy,
            data_parallel_shard_degree=2,
            data_parallel_replicate_degree=2,
            state_dict_type=state_dict,
        )
        return {'fsdp': fsdp}
    if layout == 'hsdp2':
        return {'fsdp': HybridFSDP2Config(state_dict_type=state_dict)}
    if layout == 'tp':
        plan = {'module.0': ColwiseParallel(), 'module.2': RowwiseParallel()}
        return {
            'fsdp': dict(sharding_strategy='FULL_SHARD', state_dict_type=state_dict),
            'tp': TPConfig(tensor_parallel_degree=cfg['tp'], layer_plan=plan),
        }
    raise ValueError(layout)


def member_of(cfg: dict, rank: int) -> int:
    """The data-parallel member whose shard ``rank`` reads (its TP group under ``'tp'``)."""
    return rank // cfg['tp'] if cfg['parallel'] == 'tp' else rank


def make_loader(cfg: dict, rank: int) -> DataLoader:
    """This rank's train data: its member's shard with sample ids (``unsized``: members without ``len()``;
    ``rank_shards``: a rank given another length, a TP user's mistake); or
    ``data='exact'`` / ``'torch'``: one dataset of ``map_size`` samples through ``ExactDistributedSampler`` (which
    shards over members under UnevenJoin) or torch's ``DistributedSampler`` with its defaults (which shards over
    every rank: the TP user's mistake)."""
    data = cfg.get('data', 'shards')
    if data == 'shards':
        member = member_of(cfg, rank)
        shards = list(cfg['shards'])
        shards[member] = cfg.get('rank_shards', {}).get(rank, shards[member])
        own = dict(cfg, shards=shards, unsized=[member] if member in cfg.get('unsized', []) else [])
        return id_loader(own, member)
    dataset = Indexed(*shard(7, cfg['map_size']))
    sampler_cls = ExactDistributedSampler if data == 'exact' else DistributedSampler
    return DataLoader(dataset, batch_size=cfg['batch_size'], sampler=sampler_cls(dataset, shuffle=True, seed=3))


def train(cfg: dict, recorder: Optional[Recorder] = None) -> dict[str, Any]:
    """One Composer ``fit`` on this rank under ``cfg['parallel']``; the parameters, per-step ids, the reports."""
    cpu_hsdp_workarounds()
    rank = dist.get_global_rank()
    model = FSDPToyModel('mlp')
    join = UnevenJoin(**cfg['join']) if cfg.get('join') is not None else None
    recorder = recorder or Recorder()
    checkpoint: dict[str, Any] = {}
    if cfg.get('save_folder'):
        checkpoint = dict(save_folder=cfg['save_folder'], save_interval=cfg['save_interval'], save_overwrite=True)
    if cfg.get('load_path'):
        checkpoint['load_path'] = cfg['load_path']
    trainer = quiet_trainer(
        model=model,
        train_dataloader=make_loader(cfg, rank),
        max_duration=cfg.get('max_duration', f'{cfg.get("epochs", 1)}ep'),
        optimizers=make_optimizer(cfg, model.parameters()),
        algorithms=[join] if join is not None else [],
        callbacks=[recorder],
        device_train_microbatch_size=cfg.get('microbatch'),
        parallelism_config=parallelism(cfg),
        **checkpoint,
    )
    error = error_if_expected(cfg, trainer.fit)
    params = full_params(trainer, 'mlp') if error is None else {}
    trainer.close()
    ts = trainer.state.timestamp
    return {
        'error': error,
        'params': {k: _full(v) for k, v in params.items()},
        'steps': recorder.steps,
        'shadow': recorder.shadow,
        'microbatch_sizes': recorder.microbatch_sizes,
        'start_batch': recorder.start_batch,
        'timestamp': {'batch': int(ts.batch), 'sample': int(ts.sample), 'epoch': int(ts.epoch)},
        'reports': [vars(r).copy() for r in join.reports] if join is not None else [],
    }


def _full(t: Any) -> torch.Tensor:
    """A parameter as one whole tensor (a DTensor under TP is gathered: collective, on every rank alike)."""
    return t.full_tensor().detach().cpu().clone() if hasattr(t, 'full_tensor') else t


def train_resumed(cfg: dict, folder: str, batch: int) -> dict[str, Any]:
    """``train(cfg)`` resumed from the (sharded) checkpoint saved after global step ``batch`` in epoch 0 of ``folder``."""
    return train(dict(cfg, load_path=f'{folder}/ep0-ba{batch}'))


def train_until_timeout(cfg: dict) -> dict[str, Any]:
    """``train(cfg)`` where a hang is expected (:func:`scenarios_fsdp.train_until_timeout`)."""
    return scenarios_fsdp.train_until_timeout(cfg, train)
