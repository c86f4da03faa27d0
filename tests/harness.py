"""Run functions on several real ranks (processes, gloo on CPU) and bring their results back.

``launch(world_size, calls)`` starts ``world_size`` Python processes with the environment Composer's
launcher would give them, initialises one process group (gloo) in each, and runs every call of
``calls`` in order on every rank, so that many trainer runs share one process group. Each call is
``(name, function_name, kwargs)`` with the function in ``tests/rank_scenarios.py`` (or
``'module:function'`` for a function in another module of ``tests/``); its return value
(or the exception it raised) is sent back per rank.

Hangs fail fast: every collective times out after ``collective_timeout`` seconds, and the whole
launch is killed after ``timeout`` seconds with an error naming the call that was running.

With ``COMPOSER_JOIN_DEVICE=gpu`` (``make test-gpu``, see ``devices.py``) each rank uses its own GPU
with NCCL; a launch with more ranks than GPUs runs nothing and returns ``NotEnoughGPUs`` for every
call, which the tests report as skipped (NCCL cannot put two ranks on one GPU). With
``COMPOSER_JOIN_SHARED_GPU=1`` as well (``make test-gpu`` on a machine with one GPU), every rank uses
GPU 0 over gloo, with CUDA tensors wherever gloo takes them.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import devices

WORKER = Path(__file__).with_name('rank_worker.py')


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
        procs, logs = [], []
        for rank in range(world_size):
            log = open(Path(tmp, f'rank{rank}.log'), 'w+')
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(spec), str(Path(tmp, f'rank{rank}'))],
                    env=rank_env(rank, world_size, port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
            )
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running = Path(tmp, 'rank0.running')
            current = running.read_text() if running.exists() else '?'
            raise AssertionError(
                f'{world_size}-rank launch did not finish within {timeout:.0f} s (call running on rank 0: '
                f'{current}); output:\n{_tails(logs)}',
            ) from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        results: dict[str, list[Any]] = {name: [None] * world_size for name, _, _ in calls}
        for rank, proc in enumerate(procs):
            out = Path(tmp, f'rank{rank}.pt')
            if proc.returncode != 0 or not out.exists():
                raise AssertionError(f'rank {rank} exited with {proc.returncode}; output:\n{_tails(logs)}')
            for name, value in torch.load(out, weights_only=False).items():
                results[name][rank] = value
        return results


def _tails(logs, lines: int = 40) -> str:
    out = []
    for rank, log in enumerate(logs):
        log.flush()
        log.seek(0)
        text = log.read().splitlines()[-lines:]
        out.append(f'--- rank {rank} ---\n' + '\n'.join(text))
    return '\n'.join(out)
