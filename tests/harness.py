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

With ``COMPOSER_JOIN_DEVICE=gpu`` (``make test-gpu``, see ``devices.py``) each rank uses its own GPU
with NCCL; a launch with more ranks than GPUs runs nothing and returns ``NotEnoughGPUs`` for every
call, which the tests report as skipped (NCCL cannot put two ranks on one GPU). With
``COMPOSER_JOIN_SHARED_GPU=1`` as well (``make test-gpu`` on a machine with one GPU), every rank uses
GPU 0 over gloo, with CUDA tensors wherever gloo takes them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import devices

# What the server imports before it forks any rank; set before it starts: read at interpreter start-up or import.
PRELOAD = ['torch', 'composer', 'composer_join', 'rank_worker']
SERVER_ENV = {'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'PYTHONWARNINGS': 'ignore'}


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
    return env


def launch(
    world_size: int,
    calls: list[tuple[str, str, dict]],
    timeout: float = 600,
    collective_timeout: float = 30,
) -> dict[str, list[Any]]:
    """Run ``calls`` on ``world_size`` ranks; return ``{name: [result of rank 0, rank 1, ...]}``.

    A result is whatever the function returned, or a :class:`RankError`.
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
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.join(timeout=max(0.1, deadline - time.monotonic()))
                if proc.exitcode is None:
                    running = Path(tmp, 'rank0.running')
                    current = running.read_text() if running.exists() else '?'
                    raise AssertionError(
                        f'{world_size}-rank launch did not finish within {timeout:.0f} s (call running on rank 0: '
                        f'{current}); output:\n{_tails(logs)}',
                    )
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # the rank and its DataLoader workers
                    proc.join()
        results: dict[str, list[Any]] = {name: [None] * world_size for name, _, _ in calls}
        for rank, proc in enumerate(procs):
            out = Path(tmp, f'rank{rank}.pt')
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


def _server() -> Any:
    """The forkserver context, its server started (once per process) with :data:`PRELOAD` imported."""
    ctx = multiprocessing.get_context('forkserver')
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_pid is None:  # not started yet: start it with SERVER_ENV
        ctx.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.get(k) for k in SERVER_ENV}
        os.environ.update(SERVER_ENV)
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
