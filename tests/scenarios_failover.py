"""Rank-side code of the failover tests: a run killed with SIGKILL mid-epoch, relaunched with ``autoresume=True``.

Used by ``tests/test_failover.py`` (through ``tests/harness.launch``) and by ``tests/failover_train.py`` (under
``composer -n`` or torchrun's elastic agents, ``tests/test_failover_agents.py``). Not a test module.

:func:`fit` trains 2 epochs of a toy model on ids of ``pipeline_data``'s pool, a checkpoint after every batch into
``folder/ckpt``, ``autoresume=True`` with a fixed ``run_name``: the first launch starts from scratch, a relaunch
(any world size) resumes from the latest checkpoint. Every process appends what it does to its own file under
``folder/records`` as it goes (one JSON line per event, flushed), so that what a killed process trained is known:

* at ``FIT_START`` (after the checkpoint is loaded): the attempt (rank 0's start time, broadcast: one id per launch),
  the world size, the rank and the global batch it resumed at;
* at ``BEFORE_FORWARD``: the ids this rank trains in that microbatch (none on a shadow step).

``kill`` makes one process kill itself with SIGKILL at one step, once per folder (a marker file says it happened):
``{'rank': r}`` or ``{'node': name}`` (the process whose ``FAILOVER_NODE`` is ``name``; it kills its parent, a
torchrun agent, first: a node lost), at ``'before_dataloader'`` (before it asks for that step's batch),
``'before_forward'`` or ``'batch_end'`` of ``(epoch, batch_in_epoch)``, or of the first step after it in that epoch
(a node that joined late, in a launch resumed past it).
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from composer import Callback
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import UnevenJoin, is_shadow_step, launcher_compat
from pipeline_data import SizedWorkerShards, collate_ids
from rank_scenarios import ToyModel, quiet_trainer
from scenarios_elastic import make_loader as sampler_loader
from scenarios_pipelines import stop_workers

RUN_NAME = 'failover'
NODE_ENV = 'FAILOVER_NODE'


def shard_sizes(cfg: dict, world: int) -> list[int]:
    """``cfg['sizes']``'s per-rank shard sizes for ``world`` ranks (a data library's own shards)."""
    sizes = cfg['sizes'][str(world)] if isinstance(cfg['sizes'], dict) else cfg['sizes']
    return list(sizes) + [0] * (world - len(sizes))


def make_loader(cfg: dict) -> Any:
    """This rank's train loader: a sampler's shard of ``size`` ids (``cfg['sampler']``, as ``tests/test_elastic.py``),
    or (``'stateful'``) torchdata's ``StatefulDataLoader`` over this rank's own ids, which keeps its own position."""
    if cfg['sampler'] != 'stateful':
        return sampler_loader(cfg)
    from torchdata.stateful_dataloader import StatefulDataLoader

    rank, world = dist.get_global_rank(), dist.get_world_size()
    sizes = shard_sizes(cfg, world)
    first = sum(sizes[:rank])
    ids = list(range(first, first + sizes[rank]))
    return StatefulDataLoader(SizedWorkerShards(ids, len(ids)), batch_size=cfg['batch_size'], collate_fn=collate_ids)


class Record(Callback):
    """Appends this process's fit start and every microbatch's ids to ``folder/records/<pid>.jsonl``, flushed."""

    def __init__(self, folder: str):
        self.path = Path(folder, 'records', f'{os.getpid()}.jsonl')
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, 'a')

    def write(self, **entry: Any) -> None:
        self.file.write(json.dumps(entry) + '\n')
        self.file.flush()

    def fit_start(self, state, logger):
        attempt = [f'{time.time():.6f}']
        dist.broadcast_object_list(attempt, src=0)  # one id per launch: rank 0's start time
        self.write(
            attempt=attempt[0],
            world=dist.get_world_size(),
            rank=dist.get_global_rank(),
            start=int(state.timestamp.batch),
        )

    def before_forward(self, state, logger):
        ids = [] if is_shadow_step(state) else [int(i) for i in state.batch[2]]
        self.write(batch=int(state.timestamp.batch), epoch=int(state.timestamp.epoch), ids=ids)

    def close(self, state, logger):
        self.file.close()


class Kill(Callback):
    """SIGKILL for the process ``kill`` names, at its event and step, once per folder (see the module's docstring)."""

    def __init__(self, kill: Optional[dict], folder: str):
        self.kill, self.marker = kill, Path(folder, 'killed')

    def _maybe(self, state, event: str) -> None:
        kill = self.kill
        if kill is None or kill.get('event', 'before_forward') != event or self.marker.exists():
            return
        here = (int(state.timestamp.epoch), int(state.timestamp.batch_in_epoch))
        if here[0] != kill['at'][0] or here[1] < kill['at'][1]:  # at that step, or (a later launch) the first after
            return
        if 'node' in kill and os.environ.get(NODE_ENV) != kill['node']:
            return
        if 'rank' in kill and dist.get_global_rank() != kill['rank']:
            return
        self.marker.write_text(f'{time.time()} rank {dist.get_global_rank()} pid {os.getpid()} at {here}')
        if 'node' in kill:  # the whole node: its torchrun agent first, so that it restarts nothing
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def before_dataloader(self, state, logger):
        self._maybe(state, 'before_dataloader')

    def before_forward(self, state, logger):
        self._maybe(state, 'before_forward')

    def batch_end(self, state, logger):
        self._maybe(state, 'batch_end')


def fit(cfg: dict, folder: str, kill: Optional[dict] = None, dist_timeout: float = 300.0) -> dict[str, Any]:
    """2 epochs with a checkpoint after every batch and ``autoresume=True`` (see the module's docstring).

    Returns this rank's final parameters, or the error ``fit`` raised (a peer killed), as ``(type, message)``.
    """
    model = ToyModel('mlp')
    loader = make_loader(cfg)
    record = Record(folder)
    with launcher_compat():  # under torchrun: NODE_RANK, and one autoresume signal file per node
        trainer = quiet_trainer(
            model=model,
            train_dataloader=loader,
            max_duration='2ep',
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            algorithms=[UnevenJoin(mode=cfg.get('mode', 'shadow'))] if cfg.get('join', True) else [],
            callbacks=[Kill(kill, folder), record],
            save_folder=str(Path(folder, 'ckpt')),
            save_interval='1ba',
            autoresume=True,
            run_name=RUN_NAME,
            dist_timeout=dist_timeout,
            # a batch_sampler= DataLoader has no batch_size for Composer to take the microbatch size from
            **({'device_train_microbatch_size': cfg['batch_size']} if cfg.get('batched') else {}),
        )
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            trainer.fit()
    except Exception as e:  # a peer was killed, or the relaunch is refused: the test checks which
        error = (type(e).__name__, '\n'.join([str(e), *getattr(e, '__notes__', [])]))
    try:
        trainer.close()  # a barrier: it fails too once a peer is gone
    except Exception:
        if error is None:
            raise
    finally:
        stop_workers(loader if isinstance(loader, DataLoader) else None)
    return {'params': {k: v.detach().clone() for k, v in model.module.named_parameters()}, 'error': error}


def read_records(folder: str) -> list[dict[str, Any]]:
    """The attempts recorded under ``folder/records``, in launch order: ``{'attempt', 'world', 'start', 'steps'}``,
    ``steps``: global batch -> ``(epoch, ids per rank)`` (a rank with no record of that batch: ``None``)."""
    attempts: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(folder, 'records').glob('*.jsonl')):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        head: Optional[dict] = None
        for line in lines:
            if 'attempt' in line:
                head = line
                run = attempts.setdefault(
                    line['attempt'],
                    {'attempt': line['attempt'], 'world': line['world'], 'start': line['start'], 'steps': {}},
                )
                continue
            assert head is not None, path
            _, per_rank = run['steps'].setdefault(line['batch'], (line['epoch'], [None] * run['world']))
            per_rank[head['rank']] = (per_rank[head['rank']] or []) + line['ids']
    return [attempts[k] for k in sorted(attempts, key=float)]


def merged(attempts: list[dict[str, Any]]) -> list[tuple[int, list[list[int]]]]:
    """Every step the attempts trained that counts, in order: ``(epoch, ids per rank)``. A later attempt resumed at
    its ``start`` (the checkpoint it loaded): what earlier ones trained from there on never reached a checkpoint."""
    steps: dict[int, tuple[int, list]] = {}
    for run in attempts:
        steps = {b: s for b, s in steps.items() if b < run['start']}
        steps.update({b: s for b, s in run['steps'].items() if b >= run['start']})
    out = []
    for b in sorted(steps):
        epoch, per_rank = steps[b]
        assert None not in per_rank, f'step {b}: a rank recorded nothing, yet the step reached a checkpoint'
        out.append((epoch, per_rank))
    return out
