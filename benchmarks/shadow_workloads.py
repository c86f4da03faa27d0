"""What every rank runs for ``shadow_cost.py``: a shadow step beside its floor, torch ``Join`` and a real step.

One function per measurement, all on the same MLP (``Linear(256, h)``, ``Linear(h, h)``, ``Linear(h, 10)``: six
parameter tensors; ``h = 1400``: 2.33 M parameters, ``h = 4900``: 25.3 M), batches of :data:`BATCH`, SGD with
momentum 0.9, DDP with its default buckets. Rank 0 has ``long`` batches, every other rank ``short``, so the last
rank runs ``long - short`` shadow steps (or joined iterations). Each function returns, per rank, per-step times
(``cpu``: the process's CPU, every thread, gloo's included; ``thread``: the main thread's CPU; ``wall``), to be
split by the driver.

* :func:`composer_shadow` - a Composer fit with ``UnevenJoin``; per step its times and whether it was a shadow step
  (``is_shadow_step``), from one ``BATCH_START`` to its ``BATCH_END``.
* :func:`composer_memory` - the same fit, with torch's profiler (``profile_memory=True``) around chosen steps of the
  last rank: bytes allocated in the step, and the step's peak above what was allocated at its start.
* :func:`torch_join` - a plain DDP loop under ``DistributedDataParallel.join``: the joined rank's time per joined
  iteration (the CPU of the join's exit, divided by the iterations it shadowed).
* :func:`floor` - the same DDP's gradient buckets all-reduced bare (one ``all_reduce`` per bucket, issued together
  and waited for, as the reducer does) plus ``optimizer.step()``, on every rank, ``long - short`` times; apart
  (``zero``), the buckets' zero fill before each all-reduce.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from composer import Callback, Trainer
from composer.models import ComposerModel
from composer.utils import dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from composer_join import UnevenJoin, is_shadow_step
from composer_join.core import compat

BATCH = 64
FEATURES = 256
CLASSES = 10
LR = 0.02


def make_mlp(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
    )


class MLP(ComposerModel):
    def __init__(self, hidden: int):
        super().__init__()
        self.module = make_mlp(hidden)

    def forward(self, batch):
        return self.module(batch[0])

    def loss(self, outputs, batch, *args, **kwargs):
        return F.cross_entropy(outputs, batch[1])


class Batches:
    """Pre-made batches with ``len()``."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.batch_size = BATCH
        self.batches = [
            (torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(n)
        ]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def _batches(long: int, short: int) -> Batches:
    rank = dist.get_global_rank()
    return Batches(long if rank == 0 else short, seed=rank)


def _now() -> tuple[float, float, float]:
    return time.process_time(), time.thread_time(), time.perf_counter()


class _Steps(Callback):
    """Per step, ``BATCH_START`` to ``BATCH_END``: process CPU, thread CPU, wall, and ``is_shadow_step``."""

    def __init__(self):
        self.cpu: list[float] = []
        self.thread: list[float] = []
        self.wall: list[float] = []
        self.shadow: list[bool] = []
        self._start = (0.0, 0.0, 0.0)

    def batch_start(self, state, logger):
        self._start = _now()

    def batch_end(self, state, logger):
        end = _now()
        self.cpu.append(end[0] - self._start[0])
        self.thread.append(end[1] - self._start[1])
        self.wall.append(end[2] - self._start[2])
        self.shadow.append(is_shadow_step(state))


def _trainer(hidden: int, long: int, short: int, callbacks: list) -> Trainer:
    model = MLP(hidden)
    return Trainer(
        model=model,
        train_dataloader=_batches(long, short),
        max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        algorithms=[UnevenJoin()],
        callbacks=callbacks,
        loggers=[],
        device='cpu',
        progress_bar=False,
        log_to_console=False,
        seed=0,
    )


def composer_shadow(hidden: int, long: int, short: int) -> dict[str, Any]:
    """A Composer fit with UnevenJoin: per-step times and shadow flags on this rank."""
    steps = _Steps()
    trainer = _trainer(hidden, long, short, [steps])
    dist.barrier()
    trainer.fit()
    trainer.close()
    import composer_join

    return {
        'cpu': steps.cpu,
        'thread': steps.thread,
        'wall': steps.wall,
        'shadow': steps.shadow,
        'composer_join': composer_join.__file__,
    }


class _Memory(Callback):
    """torch's profiler (``profile_memory=True``) around the steps ``at`` (indices from 0) on the last rank."""

    def __init__(self, at: list[int]):
        self.at = set(at) if dist.get_global_rank() == dist.get_world_size() - 1 else set()
        self.found: dict[int, dict[str, Any]] = {}
        self.rss: dict[int, dict[str, Any]] = {}  # the steps not profiled: the process's peak resident set in the step
        self._prof: Any = None
        self._step = 0

    def batch_start(self, state, logger):
        if self.at:
            _reset_peak_rss()
        if self._step in self.at:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()

    def batch_end(self, state, logger):
        if self.at and self._step not in self.at:
            self.rss[self._step] = {'shadow': is_shadow_step(state), 'peak_rss': _peak_rss()}
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.found[self._step] = {'shadow': is_shadow_step(state), **_allocations(self._prof)}
            self._prof = None
        self._step += 1


def _reset_peak_rss() -> None:
    with open('/proc/self/clear_refs', 'w') as f:  # Linux: "5" resets the peak resident set (VmHWM)
        f.write('5')


def _peak_rss() -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmHWM:'))


def _allocations(prof: Any) -> dict[str, int]:
    """Bytes allocated in a profiled window (each op's own allocations, and frees outside ops), and the peak of
    what was allocated and not yet freed, above the window's start (ops in their start order, each counted with
    its own net allocation: a temporary freed within one op is not seen in the peak)."""
    allocated, live, peak = 0, 0, 0
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    for e in events:
        change = e.cpu_memory_usage if e.name == '[memory]' else e.self_cpu_memory_usage
        if change > 0:
            allocated += change
        live += change
        peak = max(peak, live)
    return {'allocated': allocated, 'peak': peak}


def composer_memory(hidden: int, long: int, short: int) -> dict[str, Any]:
    """The fit of :func:`composer_shadow`, with the last rank's steps ``short - 2`` (real), ``short`` (its first
    shadow step) and ``short + 2`` (a later one) profiled for memory."""
    memory = _Memory([short - 2, short, short + 2])
    trainer = _trainer(hidden, long, short, [memory])
    dist.barrier()
    trainer.fit()
    trainer.close()
    return {'steps': memory.found, 'rss': memory.rss}


def torch_join(hidden: int, long: int, short: int) -> dict[str, Any]:
    """A plain DDP loop under ``join()``: per real step times, and the joined iterations' time (per iteration)."""
    ddp = DistributedDataParallel(make_mlp(hidden))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    batches = _batches(long, short)
    real: dict[str, list[float]] = {'cpu': [], 'thread': [], 'wall': []}
    dist.barrier()
    join = ddp.join()
    join.__enter__()
    for x, y in batches:
        start = _now()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        end = _now()
        for key, i in (('cpu', 0), ('thread', 1), ('wall', 2)):
            real[key].append(end[i] - start[i])
    start = _now()
    join.__exit__(None, None, None)
    end = _now()
    joined = long - len(batches)
    per = {key: (end[i] - start[i]) / joined if joined else float('nan') for key, i in (('cpu', 0), ('thread', 1))}
    per['wall'] = (end[2] - start[2]) / joined if joined else float('nan')
    return {'real': real, 'joined': per, 'joined_iterations': joined}


def floor(hidden: int, long: int, short: int) -> dict[str, Any]:
    """The bare floor, ``long - short`` times on every rank: DDP's gradient buckets (made once, zeros, the gradients
    views of them) all-reduced as the reducer does, then ``optimizer.step()``; per-iteration times, and those of
    the zero fill before each (``zero``, not in the floor's)."""
    ddp = DistributedDataParallel(make_mlp(hidden))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    buckets = compat.zero_grad_buckets(ddp)
    for bucket in buckets:
        flat, offset = bucket.buffer(), 0
        for p in bucket.parameters():
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    times: dict[str, list[float]] = {'cpu': [], 'thread': [], 'wall': []}
    zero: dict[str, list[float]] = {'cpu': [], 'thread': [], 'wall': []}
    dist.barrier()
    for _ in range(long - short):
        start = _now()
        for b in buckets:  # timed apart: what a rank that contributes zeros to an in-place all-reduce adds
            b.buffer().zero_()
        end = _now()
        for key, i in (('cpu', 0), ('thread', 1), ('wall', 2)):
            zero[key].append(end[i] - start[i])
        start = _now()
        works = [torch.distributed.all_reduce(b.buffer(), async_op=True) for b in buckets]
        for w in works:
            w.wait()
        optimizer.step()
        end = _now()
        for key, i in (('cpu', 0), ('thread', 1), ('wall', 2)):
            times[key].append(end[i] - start[i])
    return {**times, 'zero': zero}


class _Profile(Callback):
    """cProfile around the last rank's shadow steps after its first two."""

    def __init__(self):
        import cProfile

        self.profile = cProfile.Profile()
        self.on = dist.get_global_rank() == dist.get_world_size() - 1
        self.seen = 0

    def batch_start(self, state, logger):
        if self.on and is_shadow_step(state):
            self.seen += 1
            if self.seen > 2:
                self.profile.enable()

    def batch_end(self, state, logger):
        self.profile.disable()


def composer_profile(hidden: int, long: int, short: int) -> dict[str, Any]:
    """The fit of :func:`composer_shadow` with the last rank's shadow steps (after its first two) under cProfile:
    the profile's text, by own time (``shadow_cost.py --profile``)."""
    import io
    import pstats

    prof = _Profile()
    trainer = _trainer(hidden, long, short, [prof])
    dist.barrier()
    trainer.fit()
    trainer.close()
    if not prof.on:
        return {'text': ''}
    out = io.StringIO()
    stats = pstats.Stats(prof.profile, stream=out)
    stats.sort_stats('tottime').print_stats(25)
    return {'text': out.getvalue(), 'steps': prof.seen - 2}
