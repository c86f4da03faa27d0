"""What each rank runs in the benchmarks: the model, the data, and one function per kind of run.

Every function here runs on *every* rank of a launch (``common.launch``, through ``tests/harness.py``),
inside one gloo process group that many runs share, and returns plain data (floats, lists, dicts) for the benchmark modules
(``overhead.py``, ``uneven.py``, ``counts.py``, ``breakdown.py``, ``profiling.py``, ``rebalance.py``).

The workload
------------
* **Model**: a small conv net (two conv + BatchNorm blocks, an MLP head; 0.62 M parameters) on
  3x24x24 inputs, 10 classes. The forward and backward pass of 32 samples takes ~16 ms on one
  core; a whole Composer step with DDP at 2 ranks (one thread each, 2 cores) ~33 ms.
* **Data**: synthetic, deterministic. Class ``c`` has a fixed smooth template image; a sample is
  its class template plus strong Gaussian noise (learnable, but every extra sample helps). Rank
  ``r``'s shard of ``n`` samples is the first ``n`` of rank ``r``'s own fixed pool, pre-batched
  (32 per batch) so that data loading costs the same in every method. A held-out set of 1024
  samples (a separate pool) gives the final loss. Shards are i.i.d., so dropping or repeating a
  rank's data changes how much the model learns, not what it is biased towards.
* **Optimizer**: SGD, lr 0.02, momentum 0.9, constant learning rate, one epoch, same seed and
  same initial weights in every method.

The runs
--------
* :func:`composer_fit` - one Composer ``Trainer.fit`` on this rank's shard: stock, padded, with
  ``UnevenJoin``, or stock plus UnevenJoin's per-step all-reduce alone (an ablation). Records
  per-step wall and CPU times at every ``BATCH_END``, whether the step was a shadow step, the
  fit's wall time, samples trained and the held-out loss.
* :func:`torch_join_fit` - the same training in a plain PyTorch loop under
  ``DistributedDataParallel.join``.
* :func:`count_collectives` - a short Composer fit that counts the collectives of every step.
* :func:`event_costs` - a fit with UnevenJoin's pieces (and Composer's engine around them) timed.
* :func:`collective_latency` - what one agreement all-reduce costs on its own.
* :func:`profile_fit` - a fit under cProfile (``run.py --profile``).
* :func:`warm_up` - throw-away fits before anything is timed.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import statistics
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from composer import Callback, Trainer
from composer.models import ComposerModel
from composer.utils import dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import composer_join.join.loader
from composer_join import CollectiveCounter, UnevenJoin, is_shadow_step
from composer_join.core.plan import RankStatus

_COLUMNS = len(RankStatus(True).row())  # the agreement tensor is world_size x _COLUMNS

BATCH = 32  # samples per rank per step
CLASSES = 10
IMAGE = (3, 24, 24)
HELD_OUT = 1024
LR = 0.02
NOISE = 6.0
WARMUP_STEPS = 3  # steps not counted by event_costs (common.WARMUP_STEPS: the driver skips as many in its timings)

# -- model and data --------------------------------------------------------------------------------


def make_module() -> nn.Module:
    """The benchmark's conv net, always with the same initial weights."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 6 * 6, 256),
        nn.ReLU(),
        nn.Linear(256, CLASSES),
    )


class Classifier(ComposerModel):
    """``make_module()`` with a cross-entropy loss and no metrics (so per-step overhead is visible)."""

    def __init__(self):
        super().__init__()
        self.module = make_module()

    def forward(self, batch):
        return self.module(batch[0])

    def loss(self, outputs, batch, *args, **kwargs):
        return F.cross_entropy(outputs, batch[1])


def _templates() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    coarse = torch.randn(CLASSES, IMAGE[0], 6, 6, generator=g)
    return F.interpolate(coarse, size=IMAGE[1:], mode='bilinear', align_corners=False)


def samples(pool: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` samples (images, labels) of pool ``pool`` (a rank's own data, or the held-out set)."""
    g = torch.Generator().manual_seed(1000 + pool)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = _templates()[y] + NOISE * torch.randn(n, *IMAGE, generator=g)
    return x, y


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    return samples(999, HELD_OUT)


class Batches:
    """Pre-made batches of one shard: an iterable with ``len()`` (Composer needs no sampler for it)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = BATCH):
        self.batch_size = batch_size  # Composer reads it to pick the microbatch size
        self.batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(y), batch_size)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def shard(rank: int, sizes: list[int], pad: bool = False) -> Batches:
    """This rank's shard, of ``sizes[rank]`` samples.

    ``pad=True`` is the padding baseline (like Accelerate's ``even_batches``): every rank gets as
    many samples as the longest rank by cycling its own samples; an empty rank borrows those of the
    lowest rank with data (as Accelerate wraps around to the start of the dataset).
    """
    n = sizes[rank]
    if not pad:
        return Batches(*samples(rank, n))
    longest = max(sizes)
    source = rank if n > 0 else next(r for r, s in enumerate(sizes) if s > 0)
    x, y = samples(source, sizes[source])
    index = torch.arange(longest) % len(y)
    return Batches(x[index], y[index])


def held_out_loss(module: nn.Module) -> float:
    """Mean cross-entropy of ``module`` (eval mode) on the held-out set."""
    x, y = (t.to(_device()) for t in held_out())
    was_training = module.training
    module.eval()
    with torch.no_grad():
        loss = float(F.cross_entropy(module(x), y))
    module.train(was_training)
    return loss


# -- callbacks ------------------------------------------------------------------------------------


class StepTimer(Callback):
    """Per step on this rank: wall time and main-thread CPU time between consecutive ``BATCH_END``s.

    The first step is timed from ``EPOCH_START``. ``shadow[i]`` is ``is_shadow_step`` at step ``i``.
    Main-thread CPU time (``time.thread_time``) excludes time spent blocked waiting for other
    ranks, so on a shadow rank it is the cost of the shadow step itself. ``process_cpu`` is the
    CPU time of the whole process (all threads: gloo's and DDP's too).
    """

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.process_cpu: list[float] = []
        self.shadow: list[bool] = []
        self._last = (0.0, 0.0, 0.0)

    @staticmethod
    def _now() -> tuple[float, float, float]:
        return time.perf_counter(), time.thread_time(), time.process_time()

    def epoch_start(self, state, logger):
        self._last = self._now()

    def batch_end(self, state, logger):
        now = self._now()
        self.wall.append(now[0] - self._last[0])
        self.cpu.append(now[1] - self._last[1])
        self.process_cpu.append(now[2] - self._last[2])
        self.shadow.append(is_shadow_step(state))
        self._last = now


class AgreementTap:
    """Finds UnevenJoin's agreements among ``torch.distributed.all_reduce`` calls, to time or fake it.

    The agreement is recognised by its tensor alone (int64, shape ``world x 7``), so this does not
    depend on how UnevenJoin's Python is organised (synchronous or overlapped). Use as a context
    manager around a fit.

    * ``mode='time'``: ``on_time(what, seconds)`` gets the time of each call (``'issue'``) and, for
      an ``async_op`` call, of the wait on its result (``'wait'``).
    * ``mode='fake'``: no communication; every row of the table becomes this rank's own row. That is
      exactly what the sum over ranks gives when every rank's status is the same (even shards of
      full batches), so UnevenJoin runs all of its own work except the collective.

    ``seen`` counts the agreements found (0 means UnevenJoin changed and nothing was timed or faked).
    """

    def __init__(self, mode: str, on_time=None):
        self.mode, self.on_time, self.seen = mode, on_time, 0
        self._original = None

    def __enter__(self):
        self._original = torch.distributed.all_reduce
        torch.distributed.all_reduce = self._all_reduce
        return self

    def __exit__(self, *exc):
        torch.distributed.all_reduce = self._original

    def _all_reduce(self, tensor, *args, **kwargs):
        world = torch.distributed.get_world_size()
        if not (
            isinstance(tensor, torch.Tensor)
            and tensor.dtype == torch.int64
            and tuple(tensor.shape) == (world, _COLUMNS)
        ):
            return self._original(tensor, *args, **kwargs)
        self.seen += 1
        if self.mode == 'fake':
            tensor.copy_(tensor[torch.distributed.get_rank()].clone().expand_as(tensor))
            return _Done() if kwargs.get('async_op') else None
        start = time.perf_counter()
        work = self._original(tensor, *args, **kwargs)
        self.on_time('issue', time.perf_counter() - start)
        return _TimedWait(work, self.on_time) if work is not None else None


class _Done:
    """A finished collective's handle."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


class _TimedWait:
    """A collective's handle whose ``wait`` is timed; everything else goes to the real handle."""

    def __init__(self, work, on_time):
        self._work, self._on_time = work, on_time

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._on_time('wait', time.perf_counter() - start)

    def __getattr__(self, name):
        return getattr(self._work, name)


# -- runs -----------------------------------------------------------------------------------------

DEVICE = os.environ.get('COMPOSER_JOIN_DEVICE', 'cpu')  # 'gpu' under make bench-gpu: one GPU per rank, NCCL


def _synchronize(tensor: torch.Tensor) -> None:
    """Wait until the GPU has finished the work queued so far (for timers; a no-op on the CPU)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _device() -> torch.device:
    return torch.device('cuda', torch.cuda.current_device()) if DEVICE == 'gpu' else torch.device('cpu')


def joined(join: bool, divide: bool = True) -> list:
    """The algorithms of a fit: ``UnevenJoin(divide_by_initial_world_size=divide)``, or none (stock Composer)."""
    return [UnevenJoin(divide_by_initial_world_size=divide)] if join else []


def make_trainer(
    loader,
    algorithms: list,
    callbacks: list,
    max_duration: str = '1ep',
    sync: Optional[str] = None,
    microbatch: Optional[int] = None,
) -> tuple[Trainer, Classifier]:
    """The benchmarks' ``Trainer`` (and its model): a fresh :class:`Classifier`, SGD with momentum, no loggers."""
    model = Classifier()
    return Trainer(
        model=model,
        train_dataloader=loader,
        max_duration=max_duration,
        optimizers=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        algorithms=algorithms,
        callbacks=callbacks,
        loggers=[],
        device=DEVICE,
        progress_bar=False,
        log_to_console=False,
        seed=0,
        ddp_sync_strategy=sync,
        device_train_microbatch_size=microbatch,
    ), model


def composer_fit(
    sizes: list[int],
    join: bool,
    pad: bool = False,
    divide: bool = True,
    fake_agreement: bool = False,
    evaluate: bool = True,
) -> dict[str, Any]:
    """One Composer fit of one epoch on this rank's shard (``sizes[rank]`` samples).

    ``join``: with ``UnevenJoin(divide_by_initial_world_size=divide)``; ``fake_agreement``: with
    UnevenJoin, its agreements computed locally instead of communicated (an ablation, even
    shards only, see :class:`AgreementTap`); ``pad``: the padding baseline's shards (see
    :func:`shard`); ``evaluate``: compute the held-out loss (``nan`` if not).

    Wall time is ``Trainer.fit`` alone (the Trainer is built before the clock starts). Samples
    trained are Composer's ``timestamp.sample`` (summed over ranks; UnevenJoin counts real samples
    only; padded samples count as trained).
    """
    rank = dist.get_global_rank()
    timer = StepTimer()
    trainer, model = make_trainer(shard(rank, sizes, pad), joined(join or fake_agreement, divide), [timer])
    tap = AgreementTap('fake') if fake_agreement else contextlib.nullcontext()
    dist.barrier()
    start = time.perf_counter()
    with tap:
        trainer.fit()
    wall = time.perf_counter() - start
    result = {
        'wall': wall,
        'steps': int(trainer.state.timestamp.batch),
        'samples': int(trainer.state.timestamp.sample),
        'loss': held_out_loss(model.module) if evaluate else float('nan'),
        'step_wall': timer.wall,
        'step_cpu': timer.cpu,
        'step_process_cpu': timer.process_cpu,
        'shadow': timer.shadow,
        'faked_agreements': tap.seen if fake_agreement else None,
    }
    trainer.close()
    return result


def torch_join_fit(sizes: list[int], pad: bool = False) -> dict[str, Any]:
    """The same training in a plain PyTorch loop with ``DistributedDataParallel.join`` (one epoch).

    Wall time covers the loop including ``join``'s final synchronisation; ``samples`` is this
    rank's real samples (summed over ranks by ``uneven.analyse``).
    """
    rank = dist.get_global_rank()
    module = make_module().to(_device())
    ddp = DistributedDataParallel(module)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    batches = shard(rank, sizes, pad)
    step_wall, seen = [], 0
    dist.barrier()
    start = time.perf_counter()
    last = start
    with ddp.join():
        for x, y in batches:
            x, y = x.to(_device()), y.to(_device())
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            seen += len(y)
            now = time.perf_counter()
            step_wall.append(now - last)
            last = now
    wall = time.perf_counter() - start
    return {
        'wall': wall,
        'steps': len(batches),
        'samples': seen,
        'loss': held_out_loss(module),
        'step_wall': step_wall,
        'step_cpu': [],
        'shadow': [],
    }


def count_collectives(sizes: list[int], join: bool, sync: str, microbatch: int) -> dict[str, Any]:
    """Collectives per step of a short Composer fit (per-step dicts of kind -> count, and shadow flags)."""
    rank = dist.get_global_rank()
    counter = CollectiveCounter()
    trainer, _ = make_trainer(shard(rank, sizes), joined(join), [counter], sync=sync, microbatch=microbatch)
    trainer.fit()
    trainer.close()
    return {'steps': counter.steps, 'shadow': counter.shadow}


def event_costs(
    sizes: list[int], join: bool = True, microbatch: Optional[int] = None, calls: bool = True
) -> dict[str, Any]:
    """A Composer fit whose per-step work is timed piece by piece (``perf_counter`` around each call).

    Timed: ``UnevenJoin.apply`` per event; ``UnevenJoin.match`` (Composer's engine asks it at every
    event; the events it matched are counted too, :data:`MATCHED`); Composer's ``Engine._run_algorithms`` (which calls both and keeps a trace per algorithm
    run); the agreement all-reduce, issuing it and waiting for it (:class:`AgreementTap`); the
    whole ``next`` of the ``JoinLoader`` (fetch, agreement, report). Each piece is summed per step
    and the median over steps is returned (so a garbage-collector pause landing in one call does
    not count). Pieces that cannot be found (the code moved) are left out. ``join=False``: a stock
    fit, only the engine timed. ``microbatch``: Composer's ``device_train_microbatch_size`` (None: one
    microbatch per step). ``calls=False``: UnevenJoin's ``apply`` and ``match`` not timed (their timing wrappers
    cost a few microseconds per event, which the engine's time then holds).
    """
    rank = dist.get_global_rank()
    counter = _StepCounter()
    trainer, _ = make_trainer(shard(rank, sizes), joined(join), [counter], microbatch=microbatch)
    costs: dict[str, dict[int, float]] = {}

    def add(name: str, seconds: float) -> None:
        per_step = costs.setdefault(name, {})
        per_step[counter.step] = per_step.get(counter.step, 0.0) + seconds

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                add(name, time.perf_counter() - t)

        return wrapper

    def iterate(self):
        inner = original_iter(self)
        while True:
            t = time.perf_counter()
            try:
                batch = next(inner)
            except StopIteration:
                return
            finally:
                add('JoinLoader next (fetch + agreement + report)', time.perf_counter() - t)
            yield batch

    engine = trainer.engine
    engine._run_algorithms = timed(ENGINE, engine._run_algorithms)
    algorithm = next((a for a in trainer.state.algorithms if isinstance(a, UnevenJoin)), None)
    original_iter = getattr(getattr(composer_join.join.loader, 'JoinLoader', None), '__iter__', None) if join else None
    if algorithm is not None and calls:
        original_apply, original_match = algorithm.apply, algorithm.match
        algorithm.apply = lambda event, state, logger: timed(f'apply {event.value}', original_apply)(
            event, state, logger
        )
        timed_match = timed('match (all events)', original_match)

        def match(event, state):
            matched = timed_match(event, state)
            add(MATCHED, float(bool(matched)))  # a count, not seconds
            return matched

        algorithm.match = match
    if original_iter is not None:
        composer_join.join.loader.JoinLoader.__iter__ = iterate
    tap = AgreementTap('time', lambda what, seconds: add(f'agreement all-reduce: {what}', seconds))
    try:
        with tap:
            trainer.fit()
    finally:
        del engine._run_algorithms
        if algorithm is not None and calls:
            del algorithm.apply, algorithm.match
        if original_iter is not None:
            composer_join.join.loader.JoinLoader.__iter__ = original_iter
    steps = int(trainer.state.timestamp.batch)
    trainer.close()
    timed_steps = range(min(WARMUP_STEPS, steps - 1), steps)
    return {
        'per_step': {
            name: statistics.median(per_step.get(i, 0.0) for i in timed_steps) for name, per_step in costs.items()
        },
        'steps': steps,
    }


ENGINE = 'Composer engine: _run_algorithms (incl. match + apply)'  # = breakdown.ENGINE
MATCHED = 'events matched (count)'  # = breakdown.MATCHED: how many events UnevenJoin.match said yes to


class _StepCounter(Callback):
    """``step``: the index of the training step running now (0-based), counted at ``BATCH_END``."""

    def __init__(self):
        self.step = 0

    def batch_end(self, state, logger):
        self.step += 1


def profile_fit(sizes: list[int], join: bool) -> dict[str, Any]:
    """One Composer fit under cProfile on every rank; returns the report as text (by cumulative and own time)."""
    rank = dist.get_global_rank()
    trainer, _ = make_trainer(shard(rank, sizes), joined(join), [])
    profiler = cProfile.Profile()
    profiler.enable()
    trainer.fit()
    profiler.disable()
    steps = int(trainer.state.timestamp.batch)
    trainer.close()
    out = io.StringIO()
    out.write(f'{"UnevenJoin" if join else "stock"} fit, shards {sizes}, rank {rank}, {steps} steps\n')
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats('cumulative').print_stats(60)
    stats.sort_stats('tottime').print_stats(30)
    stats.print_callers('deepcopy|_pre_forward|agree|apply')
    table = {f'{f[0]}:{f[1]}({f[2]})': (nc, tt, ct) for f, (cc, nc, tt, ct, callers) in stats.stats.items()}
    return {'text': out.getvalue(), 'steps': steps, 'table': table}


def warm_up(sizes: list[int]) -> dict[str, Any]:
    """A throw-away stock and UnevenJoin fit: first-use costs (imports, allocator, gloo buffers) land here."""
    composer_fit(sizes, join=False)
    composer_fit(sizes, join=True)
    return {}


def collective_latency(repeats: int = 300, late_ms: float = 10.0) -> dict[str, float]:
    """What one gloo ``all_reduce`` of UnevenJoin's agreement tensor (``W x 12`` int64) costs on this machine.

    * ``median``: wall time of one, back to back after a barrier (ranks already in step), median;
    * ``process_cpu`` / ``thread_cpu``: CPU time per call of the whole process / of the calling
      thread, in that loop;
    * ``waiting_cpu_per_ms``: CPU the *waiting* ranks burn per millisecond of waiting, measured
      while the last rank arrives ``late_ms`` late each time (1.0 = a whole core busy-waits).
    """
    table = torch.zeros(dist.get_world_size(), _COLUMNS, dtype=torch.int64, device=_device())
    times = []
    dist.barrier()
    cpu0 = (time.process_time(), time.thread_time())
    for _ in range(repeats):
        t = time.perf_counter()
        dist.all_reduce(table, reduce_operation='SUM')
        _synchronize(table)  # NCCL only enqueues the op: time it to completion
        times.append(time.perf_counter() - t)
    cpu1 = (time.process_time(), time.thread_time())
    times.sort()
    late = dist.get_global_rank() == dist.get_world_size() - 1
    waited, burnt = 0.0, 0.0
    for _ in range(20):
        dist.barrier()
        if late:
            time.sleep(late_ms / 1000)
        t, c = time.perf_counter(), time.process_time()
        dist.all_reduce(table, reduce_operation='SUM')
        _synchronize(table)
        waited, burnt = waited + time.perf_counter() - t, burnt + time.process_time() - c
    return {
        'median': times[len(times) // 2],
        'process_cpu': (cpu1[0] - cpu0[0]) / repeats,
        'thread_cpu': (cpu1[1] - cpu0[1]) / repeats,
        'waiting_cpu_per_ms': None if late else burnt / waited,
    }
