"""Run functions on several real ranks (processes, gloo on CPU) and bring their results back.

``launch(world_size, calls)`` starts ``world_size`` Python processes with the environment Composer's
launcher would give them, initialises one process group (gloo) in each, and runs every call of
``calls`` in order on every rank, so that many trainer runs share one process group. Each call is
``(name, function_name, kwargs)`` with the function in ``tests/rank_scenarios.py`` (or
``'module:function'`` for a function in another module of ``tests/``); its return value
(or the exception it raised) is sent back per rank.

Hangs fail fast: every collective times out after ``collective_timeout`` seconds, and the whole
launch is killed after ``timeout`` seconds with an error naming the call that was running.

The ranks are forked from one server process per pytest session (``multiprocessing``'s forkserver)
that imported torch, Composer and ``composer_join`` once (:data:`PRELOAD`): importing Composer
costs ~8 s of CPU, which every launch of every rank would otherwise pay again. Each rank is a fresh
fork of that server, with nothing of an earlier launch in it, its own session (killed as a group
with its DataLoader workers) and the environment of the test process at the time of the launch.

The benchmarks launch their ranks here too (``benchmarks/common.py``), with two more things a launch
can do: report each call's name as rank 0 starts it (``progress``), and account for the CPU time the
ranks and the machine spent (``usage``), from which they tell how much other processes took meanwhile.

With ``COMPOSER_JOIN_DEVICE=gpu`` (``make test-gpu``, see ``devices.py``) each rank uses its own GPU
with NCCL; a launch with more ranks than GPUs runs nothing and returns ``NotEnoughGPUs`` for every
call, which the tests report as skipped (NCCL cannot put two ranks on one GPU). With
``COMPOSER_JOIN_SHARED_GPU=1`` as well (``make test-gpu`` on a machine with one GPU), every rank uses
GPU 0 over gloo, with CUDA tensors wherever gloo takes them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import devices  # (no torch: the benchmarks' driver imports this module and stays light until results come back)

# What the server imports before it forks any rank; set before it starts: read at interpreter start-up or import.
PRELOAD = ['torch', 'composer', 'composer_join', 'rank_worker']
# tests/ on the path of the server and of every rank: Python 3.11's forkserver ignores the parent's sys.path and skips
# a preload it cannot import without a word, so without it the server would not hold rank_worker (nor a rank's own
# DataLoader-worker forkserver its data module: tests/scenarios_pipelines.py).
TESTS = str(Path(__file__).parent)
SERVER_ENV = {'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'PYTHONWARNINGS': 'ignore'}


def with_tests_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`TESTS` first on ``PYTHONPATH``."""
    return {**env, 'PYTHONPATH': os.pathsep.join(p for p in (TESTS, env.get('PYTHONPATH')) if p)}


@dataclass
class RankError:
    """What a call raised on one rank."""

    type: str
    message: str

    def __str__(self) -> str:
        return f'{self.type}: {self.message}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK='0',
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED='1',
        OMP_NUM_THREADS='1',
        PYTHONWARNINGS='ignore',
    )
    return with_tests_on_path(env)


def launch(
    world_size: int,
    calls: list[tuple[str, str, dict]],
    timeout: float = 600,
    collective_timeout: float = 30,
    usage: Optional[dict] = None,
    progress: Optional[Callable[[str], None]] = None,
    may_be_killed: tuple[int, ...] = (),
) -> dict[str, list[Any]]:
    """Run ``calls`` on ``world_size`` ranks; return ``{name: [result of rank 0, rank 1, ...]}``.

    A result is whatever the function returned, or a :class:`RankError`. A rank of ``may_be_killed`` that dies by
    SIGKILL (a failover test kills it on purpose) gets ``RankError('Killed', ...)`` for every call; any other rank
    that dies fails the launch.

    ``progress``, if given, is called with each call's name as rank 0 starts it (looked at every 0.2 s, so
    a call shorter than that may go unreported). ``usage``, if given, is filled with ``elapsed`` (s, from
    the first rank's start to the last one's end), ``machine_busy`` (CPU s of the whole machine meanwhile,
    from /proc/stat) and ``ranks_cpu`` (CPU s of the rank processes meanwhile, and of the server they are
    forked from, which imports torch, Composer and ``composer_join`` for them at its start).
    """
    if devices.device() == 'gpu' and not devices.shared_gpu():  # a shared GPU takes any number of ranks
        missing = devices.too_few_gpus(world_size, f'a {world_size}-rank launch')
        if missing is not None:
            return {name: [RankError('NotEnoughGPUs', missing)] * world_size for name, _, _ in calls}
    with tempfile.TemporaryDirectory(prefix='composer-join-') as tmp:
        spec = Path(tmp, 'spec.pkl')
        spec.write_bytes(pickle.dumps({'calls': calls, 'collective_timeout': collective_timeout}))
        port = free_port()
        ctx = _server()
        server = _server_pid()
        started, busy, server_cpu = time.monotonic(), machine_busy_seconds(), process_cpu_seconds(server)
        procs = []
        for rank in range(world_size):
            procs.append(
                ctx.Process(
                    target=_run_rank,
                    args=(rank_env(rank, world_size, port), str(spec), str(Path(tmp, f'rank{rank}')), tmp),
                    name=f'rank{rank}',
                ),
            )
            procs[-1].start()
        logs = [Path(tmp, f'rank{rank}.log') for rank in range(world_size)]
        running = Path(tmp, 'rank0.running')
        deadline = time.monotonic() + timeout
        poll = None if usage is None and progress is None else 0.2  # else wake only when a rank ends
        ranks_cpu, reported = [0.0] * world_size, None
        try:
            while alive := [proc for proc in procs if proc.exitcode is None]:
                left = deadline - time.monotonic()
                if left <= 0:
                    current = running.read_text() if running.exists() else '?'
                    raise AssertionError(
                        f'{world_size}-rank launch did not finish within {timeout:.0f} s (call running on rank 0: '
                        f'{current}); output:\n{_tails(logs)}',
                    )
                if usage is not None:  # read while the ranks live: the server reaps them, and their times with them
                    ranks_cpu = [max(cpu, process_cpu_seconds(p.pid)) for cpu, p in zip(ranks_cpu, procs)]
                if progress is not None and running.exists() and (current := running.read_text()) not in ('', reported):
                    reported = current
                    progress(current)
                multiprocessing.connection.wait([p.sentinel for p in alive], timeout=min(left, poll or left))
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # the rank and its DataLoader workers
                    proc.join()
        if usage is not None:
            usage.update(
                elapsed=time.monotonic() - started,
                machine_busy=machine_busy_seconds() - busy,
                ranks_cpu=sum(ranks_cpu) + process_cpu_seconds(server) - server_cpu,
            )
        import torch

        results: dict[str, list[Any]] = {name: [None] * world_size for name, _, _ in calls}
        for rank, proc in enumerate(procs):
            out = Path(tmp, f'rank{rank}.pt')
            if rank in may_be_killed and proc.exitcode == -signal.SIGKILL and not out.exists():
                for name in results:
                    results[name][rank] = RankError('Killed', f'rank {rank} was killed with SIGKILL')
                continue
            if proc.exitcode != 0 or not out.exists():
                raise AssertionError(f'rank {rank} exited with {proc.exitcode}; output:\n{_tails(logs)}')
            for name, value in torch.load(out, weights_only=False).items():
                results[name][rank] = value
        return results


def _tails(logs: list[Path], lines: int = 40) -> str:
    out = []
    for rank, log in enumerate(logs):
        text = log.read_text(errors='replace').splitlines()[-lines:] if log.exists() else ['(no output)']
        out.append(f'--- rank {rank} ---\n' + '\n'.join(text))
    return '\n'.join(out)


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores), from /proc/stat."""
    fields = Path('/proc/stat').read_text().split('\n', 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf('SC_CLK_TCK')


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` (all its threads, not its children); 0 once it is gone."""
    try:
        fields = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def _server_pid() -> int:
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def _server() -> Any:
    """The forkserver context, its server started (once per process) with :data:`PRELOAD` imported."""
    ctx = multiprocessing.get_context('forkserver')
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_pid is None:  # not started yet: start it with SERVER_ENV
        ctx.set_forkserver_preload(PRELOAD)
        server_env = with_tests_on_path({**os.environ, **SERVER_ENV})
        saved = {k: os.environ.get(k) for k in server_env}
        os.environ.update(server_env)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx


def _run_rank(env: dict[str, str], spec: str, out_prefix: str, tmp: str) -> None:
    """In the forked rank: its own session, the launch's environment, output to its log; then the calls."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    log = os.open(out_prefix + '.log', os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    import rank_worker

    rank_worker.main(spec, out_prefix)
    rank_worker.leave()
