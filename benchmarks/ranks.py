"""Start the ranks of one benchmark launch, and (run as a script) be one of them.

``launch(world_size, calls, timeout)`` starts one Python process per rank with the environment
Composer's launcher would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` = a fresh free port), one intra-op thread
(``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``), and a hard timeout after which every
rank is killed. Each rank initialises one gloo process group and runs every call of ``calls`` in
order, so that all runs of a launch share the process group. A call is ``(name, function, kwargs)``
with ``function`` in ``workloads.py`` (or ``'module:function'`` for another module of benchmarks/);
``launch`` returns ``{name: [result of rank 0, rank 1, ...]}``.
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def launch(
    world_size: int, calls: list[tuple[str, str, dict]], timeout: float, progress=None, usage: dict | None = None
) -> dict[str, list[Any]]:
    """Run ``calls`` on ``world_size`` fresh ranks; raise with the ranks' output if one fails or time runs out.

    ``progress``, if given, is called with each call's name as rank 0 starts it. ``usage``, if
    given, is filled with ``elapsed`` (s), ``machine_busy`` (CPU s of the whole machine, from
    /proc/stat) and ``ranks_cpu`` (CPU s of the rank processes) over the launch, so that the
    caller can tell how much CPU other processes took meanwhile.
    """
    with tempfile.TemporaryDirectory(prefix='composer-join-bench-') as tmp:
        spec = Path(tmp, 'spec.pkl')
        spec.write_bytes(pickle.dumps(calls))
        port = free_port()
        procs, logs = [], []
        for rank in range(world_size):
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
                MKL_NUM_THREADS='1',
                PYTHONWARNINGS='ignore',
            )
            log = open(Path(tmp, f'rank{rank}.log'), 'w+')
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / 'ranks.py'), str(spec), str(Path(tmp, f'rank{rank}'))],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        running = Path(tmp, 'rank0.running')
        seen = None
        started, busy = time.monotonic(), machine_busy_seconds()
        ranks_cpu = [0.0] * world_size
        try:
            while any(p.poll() is None for p in procs):
                ranks_cpu = [max(c, process_cpu_seconds(p.pid)) for c, p in zip(ranks_cpu, procs)]
                if time.monotonic() > deadline:
                    current = running.read_text() if running.exists() else '?'
                    raise RuntimeError(
                        f'{world_size}-rank launch did not finish within {timeout:.0f} s '
                        f'(running: {current}); output:\n{_tails(logs)}'
                    )
                if progress is not None and running.exists():
                    current = running.read_text()
                    if current != seen:
                        seen = current
                        progress(current)
                time.sleep(0.2)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if usage is not None:
            usage.update(
                elapsed=time.monotonic() - started, machine_busy=machine_busy_seconds() - busy, ranks_cpu=sum(ranks_cpu)
            )
        results: dict[str, list[Any]] = {name: [None] * world_size for name, _, _ in calls}
        for rank, proc in enumerate(procs):
            out = Path(tmp, f'rank{rank}.pkl')
            if not out.exists():
                raise RuntimeError(f'rank {rank} exited with {proc.returncode}; output:\n{_tails(logs)}')
            if proc.returncode != 0:  # results complete, the exit itself failed
                print(f'note: rank {rank} exited with {proc.returncode} after saving its results', file=sys.stderr)
            for name, value in pickle.loads(out.read_bytes()).items():
                results[name][rank] = value
        return results


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores), from /proc/stat."""
    fields = Path('/proc/stat').read_text().split('\n', 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf('SC_CLK_TCK')


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` (all its threads); 0 once it is gone."""
    try:
        fields = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def _tails(logs, lines: int = 30) -> str:
    out = []
    for rank, log in enumerate(logs):
        log.flush()
        log.seek(0)
        out.append(f'--- rank {rank} ---\n' + '\n'.join(log.read().splitlines()[-lines:]))
    return '\n'.join(out)


def _rank_main(spec_path: str, out_prefix: str) -> None:
    """One rank: join the process group, run the calls in order, pickle the results."""
    import importlib
    import logging
    import warnings

    warnings.filterwarnings('ignore')
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(HERE))
    import torch
    from composer.utils import dist

    import workloads

    torch.set_num_threads(1)
    dist.initialize_dist(workloads.DEVICE, timeout=120)  # 'gpu' (NCCL) under make bench-gpu
    results = {}
    for name, function, kwargs in pickle.loads(Path(spec_path).read_bytes()):
        Path(out_prefix + '.running').write_text(name)
        module, _, function = function.rpartition(':')  # 'function' in workloads.py, or 'module:function'
        results[name] = getattr(importlib.import_module(module) if module else workloads, function)(**kwargs)
    Path(out_prefix + '.pkl').write_bytes(pickle.dumps(results))
    dist.barrier()  # leave together: a rank exiting while gloo still talks to it can abort the others
    torch.distributed.destroy_process_group()


if __name__ == '__main__':
    _rank_main(sys.argv[1], sys.argv[2])
