"""What every rank runs for ``shadow_cost.py``: a shadow step beside its floor, torch ``Join`` and a real step.

One function per measurement, all on the same MLP (``Linear(256, h)``, ``Linear(h, h)``, ``Linear(h, 10)``: six
parameter tensors; ``h = 1400``: 2.33 M parameters, ``h = 4900``: 25.3 M), batches of :data:`BATCH`, SGD with
momentum 0.9, under DDP (its default buckets) or Composer's FSDP1 or FSDP2 (``kind``; the whole model one unit).
Rank 0 has ``long`` batches, every other rank ``short``, so the last rank runs ``long - short`` shadow steps (or
joined iterations). Each function returns, per rank, per-step times (:class:`Clock`: ``cpu``, the process's CPU,
every thread, gloo's included; ``thread``, the main thread's CPU; ``wall``; on a GPU also ``device``, CUDA events
around the step), to be split by the driver. Ranks run on the CPU with gloo, or on GPUs with NCCL where
``COMPOSER_JOIN_DEVICE=gpu`` (``tests/devices.py``).

* :func:`composer_shadow` - a Composer fit with ``UnevenJoin``; per step its times and whether it was a shadow step
  (``is_shadow_step``), from one ``BATCH_START`` to its ``BATCH_END``.
* :func:`composer_memory` - the same fit, with torch's profiler (``profile_memory=True``) around chosen steps of the
  last rank: bytes allocated in the step, and the step's peak above what was allocated at its start (on a GPU:
  the CUDA caching allocator's counters instead).
* :func:`stock_small` - stock Composer (no ``UnevenJoin``), even data, batches of :data:`SMALL` samples (the
  template's size): what the wrapper's own machinery costs a step that computes almost nothing.
* :func:`recorded_floor` - the collectives of a stock fit's real step, recorded as FSDP's runtime and Composer
  issued them, replayed bare (FSDP's with ``optimizer.step()``: the floor under FSDP; Composer's apart).
* :func:`torch_join` - a plain DDP loop under ``DistributedDataParallel.join``: the joined rank's time per joined
  iteration (the CPU of the join's exit, divided by the iterations it shadowed).
* :func:`floor` - the same DDP's gradient buckets all-reduced bare (one ``all_reduce`` per bucket, issued together
  and waited for, as the reducer does) plus ``optimizer.step()``, on every rank, ``long - short`` times; apart
  (``zero``), the buckets' zero fill before each all-reduce.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests'))
import devices  # (the tests' device choice: CPU and gloo, or GPUs and NCCL)

BATCH = 64
SMALL = 2  # samples in a template (a shadow microbatch that runs the model runs on two)
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

    def __init__(self, n: int, seed: int, size: int = BATCH):
        g = torch.Generator().manual_seed(seed)
        self.batch_size = size
        self.batches = [
            (torch.randn(size, FEATURES, generator=g), torch.randint(0, CLASSES, (size,), generator=g))
            for _ in range(n)
        ]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def _batches(long: int, short: int) -> Batches:
    rank = dist.get_global_rank()
    return Batches(long if rank == 0 else short, seed=rank)


class Clock:
    """Per-interval times: ``cpu`` (the process's, every thread), ``thread`` (this thread's), ``wall``, and on a GPU
    ``device`` (CUDA events around the interval, read at :meth:`stop`, which waits for the device). Seconds.

    Example::

        clock = Clock()
        clock.start(); work(); clock.stop()
        clock.times['cpu'][-1]
    """

    def __init__(self):
        self.times: dict[str, list[float]] = {'cpu': [], 'thread': [], 'wall': []}
        self.cuda = devices.device() == 'gpu'
        if self.cuda:
            self.times['device'] = []
        self._start: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._event: Any = None

    def start(self) -> None:
        if self.cuda:
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        self._start = (time.process_time(), time.thread_time(), time.perf_counter())

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self.times['device'].append(self._event.elapsed_time(end) / 1000)
        now = (time.process_time(), time.thread_time(), time.perf_counter())
        for key, i in (('cpu', 0), ('thread', 1), ('wall', 2)):
            self.times[key].append(now[i] - self._start[i])


def _device() -> torch.device:
    return devices.torch_device()


class _Steps(Callback):
    """Per step, ``BATCH_START`` to ``BATCH_END``: process CPU, thread CPU, wall, and ``is_shadow_step``."""

    def __init__(self):
        self.clock = Clock()
        self.shadow: list[bool] = []

    def batch_start(self, state, logger):
        self.clock.start()

    def batch_end(self, state, logger):
        self.clock.stop()
        self.shadow.append(is_shadow_step(state))


def _parallelism(kind: str) -> Any:
    """Composer's ``parallelism_config`` for ``kind`` (``'ddp'``: None), with the tests' CPU workarounds for FSDP."""
    if kind == 'ddp':
        return None
    from scenarios_fsdp import cpu_fsdp_workarounds, parallelism  # tests/ (on the path since devices' import)

    cpu_fsdp_workarounds()
    return parallelism(kind, {})


def _trainer(
    hidden: int, long: int, short: int, callbacks: list, kind: str = 'ddp', join: bool = True, data: Any = None
) -> Trainer:
    model = MLP(hidden)
    return Trainer(
        model=model,
        train_dataloader=_batches(long, short) if data is None else data,
        max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        algorithms=[UnevenJoin()] if join else [],
        callbacks=callbacks,
        parallelism_config=_parallelism(kind),
        loggers=[],
        device='cpu',
        progress_bar=False,
        log_to_console=False,
        seed=0,
    )


def composer_shadow(hidden: int, long: int, short: int, kind: str = 'ddp') -> dict[str, Any]:
    """A Composer fit with UnevenJoin (``kind``: ``'ddp'``, ``'fsdp1'`` or ``'fsdp2'``): per-step times and shadow
    flags on this rank."""
    steps = _Steps()
    trainer = _trainer(hidden, long, short, [steps], kind)
    dist.barrier()
    trainer.fit()
    trainer.close()
    import composer_join

    return {**steps.clock.times, 'shadow': steps.shadow, 'composer_join': composer_join.__file__}


def stock_small(hidden: int, long: int, short: int, kind: str = 'ddp') -> dict[str, Any]:
    """Stock Composer, ``long - short`` steps of :data:`SMALL` samples on every rank: per-step times."""
    steps = _Steps()
    data = Batches(long - short, seed=dist.get_global_rank(), size=SMALL)
    trainer = _trainer(hidden, long, short, [steps], kind, join=False, data=data)
    dist.barrier()
    trainer.fit()
    trainer.close()
    return steps.clock.times


class _Memory(Callback):
    """torch's profiler (``profile_memory=True``) around the steps ``at`` (indices from 0) on the last rank; on a GPU
    the CUDA caching allocator's counters instead (bytes allocated in the step, its peak above the step's start)."""

    def __init__(self, at: list[int]):
        self.at = set(at) if dist.get_global_rank() == dist.get_world_size() - 1 else set()
        self.found: dict[int, dict[str, Any]] = {}
        self._prof: Any = None
        self._gpu = (0, 0)  # on a GPU: bytes allocated so far, and allocated now, at the step's start
        self._step = 0

    def batch_start(self, state, logger):
        if self._step not in self.at:
            return
        if devices.device() == 'gpu':
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._gpu = (torch.cuda.memory_stats()['allocated_bytes.all.allocated'], torch.cuda.memory_allocated())
        else:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()

    def batch_end(self, state, logger):
        if self._step in self.at and devices.device() == 'gpu':
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_stats()['allocated_bytes.all.allocated'] - self._gpu[0]
            peak = torch.cuda.max_memory_allocated() - self._gpu[1]
            self.found[self._step] = {'shadow': is_shadow_step(state), 'allocated': allocated, 'peak': peak}
        elif self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.found[self._step] = {'shadow': is_shadow_step(state), **_allocations(self._prof)}
            self._prof = None
        self._step += 1


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


def composer_memory(hidden: int, long: int, short: int, kind: str = 'ddp') -> dict[str, Any]:
    """The fit of :func:`composer_shadow`, with the last rank's steps ``short - 2`` (real), ``short`` (its first
    shadow step) and ``short + 2`` (a later one) profiled for memory."""
    memory = _Memory([short - 2, short, short + 2])
    trainer = _trainer(hidden, long, short, [memory], kind)
    dist.barrier()
    trainer.fit()
    trainer.close()
    return {'steps': memory.found}


def torch_join(hidden: int, long: int, short: int) -> dict[str, Any]:
    """A plain DDP loop under ``join()``: per real step times, and the joined iterations' time (per iteration)."""
    ddp = _ddp(hidden)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    batches = _batches(long, short)
    real, joined_clock = Clock(), Clock()
    dist.barrier()
    join = ddp.join()
    join.__enter__()
    for x, y in batches:
        real.start()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x.to(_device())), y.to(_device())).backward()
        optimizer.step()
        real.stop()
    joined_clock.start()
    join.__exit__(None, None, None)
    joined_clock.stop()
    joined = long - len(batches)
    per = {key: values[0] / joined if joined else float('nan') for key, values in joined_clock.times.items()}
    return {'real': real.times, 'joined': per, 'joined_iterations': joined}


def _ddp(hidden: int) -> DistributedDataParallel:
    module = make_mlp(hidden).to(_device())
    return DistributedDataParallel(module, device_ids=[_device()] if devices.device() == 'gpu' else None)


def floor(hidden: int, long: int, short: int) -> dict[str, Any]:
    """The bare floor, ``long - short`` times on every rank: DDP's gradient buckets (made once, zeros, the gradients
    views of them) all-reduced as the reducer does, then ``optimizer.step()``; per-iteration times, and those of
    the zero fill before each (``zero``, not in the floor's)."""
    ddp = _ddp(hidden)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    buckets = compat.zero_grad_buckets(ddp)
    for bucket in buckets:
        flat, offset = bucket.buffer(), 0
        for p in bucket.parameters():
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    times, zero = Clock(), Clock()
    dist.barrier()
    for _ in range(long - short):
        zero.start()
        for b in buckets:  # timed apart: what a rank that contributes zeros to an in-place all-reduce adds
            b.buffer().zero_()
        zero.stop()
        times.start()
        works = [torch.distributed.all_reduce(b.buffer(), async_op=True) for b in buckets]
        for w in works:
            w.wait()
        optimizer.step()
        times.stop()
    return {**times.times, 'zero': zero.times}


class _Recorder(Callback):
    """The collectives ``torch.distributed``'s functions issue in one real step (the ``at``-th, from 0), in order,
    each with its bound arguments and who called it (FSDP's runtime, or Composer)."""

    NAMES = ('all_gather_into_tensor', 'all_gather', 'reduce_scatter_tensor', 'all_reduce', 'broadcast')

    def __init__(self, at: int):
        self.at, self.step = at, 0
        self.calls: list[tuple[str, str, Any, dict[str, Any]]] = []  # (caller, name, original, bound arguments)
        self._saved: dict[str, Any] = {}

    def batch_start(self, state, logger):
        if self.step != self.at:
            return
        import inspect

        import torch.distributed as tdist

        for name in self.NAMES:
            original = getattr(tdist, name)
            self._saved[name] = original

            def recorded(*args, _name=name, _original=original, **kwargs):
                caller = sys._getframe(1).f_globals.get('__name__', '')
                bound = inspect.signature(_original).bind(*args, **kwargs).arguments
                self.calls.append((caller, _name, _original, dict(bound)))
                return _original(*args, **kwargs)

            setattr(tdist, name, recorded)

    def batch_end(self, state, logger):
        import torch.distributed as tdist

        for name, original in self._saved.items():
            setattr(tdist, name, original)
        self._saved = {}
        self.step += 1

    def replay(self, which: str) -> Any:
        """A function that issues the recorded collectives whose caller's module starts with ``which``, bare: on
        buffers of the recorded shapes and dtypes (made once, zeros), waiting for each asynchronous one at the end."""
        calls = []
        for caller, name, original, bound in self.calls:
            if caller.startswith(which):
                args = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in bound.items()}
                if name == 'all_gather':  # a list of outputs
                    args['tensor_list'] = [torch.zeros_like(t) for t in bound['tensor_list']]
                calls.append((name, original, args))

        def run() -> None:
            works = [original(**args) for _, original, args in calls]
            for w in works:
                if w is not None:
                    w.wait()

        run.names = [name for name, _, _ in calls]  # type: ignore[attr-defined]
        return run


def recorded_floor(hidden: int, long: int, short: int, kind: str) -> dict[str, Any]:
    """The floor under ``kind``, ``long - short`` times on every rank, from a stock fit's real step (its third) on
    both ranks (even data): the collectives FSDP's runtime issued in it, bare (buffers of their shapes, made once),
    then ``optimizer.step()`` (``fsdp``: per-iteration times, and the collectives' names); and apart the collectives
    Composer itself issued in that step (``composer``: the loss, samples, tokens, time), bare too. Under DDP the
    reducer's all-reduces do not pass through ``torch.distributed``'s functions: ``fsdp`` is the optimizer step."""
    recorder = _Recorder(at=2)
    trainer = _trainer(hidden, long, short, [recorder], kind, join=False, data=Batches(4, seed=dist.get_global_rank()))
    trainer.fit()
    optimizer = trainer.state.optimizers[0]
    out: dict[str, Any] = {}
    for key, which, step in (('fsdp', 'torch.distributed.fsdp', True), ('composer', 'composer.', False)):
        replay = recorder.replay(which)
        clock = Clock()
        dist.barrier()
        for _ in range(long - short):
            clock.start()
            replay()
            if step:
                optimizer.step()
            clock.stop()
        out[key] = {**clock.times, 'names': replay.names}
    trainer.close()
    return out


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


def composer_profile(hidden: int, long: int, short: int, kind: str = 'ddp') -> dict[str, Any]:
    """The fit of :func:`composer_shadow` with the last rank's shadow steps (after its first two) under cProfile:
    the profile's text, by own time (``shadow_cost.py --profile``)."""
    import io
    import pstats

    prof = _Profile()
    trainer = _trainer(hidden, long, short, [prof], kind)
    dist.barrier()
    trainer.fit()
    trainer.close()
    if not prof.on:
        return {'text': ''}
    out = io.StringIO()
    stats = pstats.Stats(prof.profile, stream=out)
    stats.sort_stats(os.environ.get('SHADOW_PROFILE_SORT', 'tottime')).print_stats(
        os.environ.get('SHADOW_PROFILE_FILTER', ''), 25
    )
    return {'text': out.getvalue(), 'steps': prof.seen - 2}
