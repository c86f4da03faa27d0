"""What every benchmark of benchmarks/ shares: launching ranks, timing, the machine's state, and output.

Light: importing this module imports no torch, so that the driver process stays out of the ranks' way.

* **Launch.** ``launch(world_size, calls, timeout)`` starts one Python process per rank with the
  environment Composer's launcher would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` = a fresh free port),
  one intra-op thread (``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``), and a hard timeout
  after which every rank is killed. Each rank runs this file as a script (:func:`_rank_main`):
  it initialises one process group and runs every call of ``calls`` in order, so that all runs of a
  launch share the process group. A call is ``(name, function, kwargs)`` with ``function`` in
  ``workloads.py`` (or ``'module:function'`` for another module of benchmarks/); ``launch``
  returns ``{name: [result of rank 0, rank 1, ...]}``.
* **Timing.** The shape of a fit's per-step series (:data:`WARMUP_STEPS` untimed, :func:`timed`), medians.
* **Machine state.** Load average, waiting for a quiet machine, CPU taken by other processes
  during a launch (from /proc), a process's resident set, the machine and code measured.
* **Output.** Number formats of the tables, the date, the output directory, a chart's figure.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
BATCH = 32  # samples per rank per step (= workloads.BATCH; not imported, to keep torch out of the driver)
WARMUP_STEPS = 3  # per fit, not timed (= workloads.WARMUP_STEPS)
DISTURBED = 0.15  # cores taken by other processes during a launch above which results.md warns


@dataclass(frozen=True)
class Setup:
    """What runs at one world size in ``run.py``'s launch (overhead, uneven, counts, breakdown)."""

    world: int
    batches: int  # the longest shard, in batches of BATCH samples
    rounds: int  # overhead rounds (one fit of each mode per round)
    reps: int  # repetitions of every (case, method)
    cases: tuple[str, ...]
    counts: bool = False  # collective counts per sync strategy, and UnevenJoin's loss with divide=False
    timeout: float = 300  # hard limit for the whole launch, seconds


def case_sizes(case: str, world: int, longest: int) -> list[int]:
    """Per-rank shard sizes of a case (in samples or batches, as ``longest``); rank 0 has ``longest``.

    ``'r:1'``: every other rank has ``longest // r``; ``'one empty'``: every rank ``longest`` but the last, 0.
    """
    if case == 'one empty':
        return [longest] * (world - 1) + [0]
    return [longest] + [longest // int(case.split(':')[0])] * (world - 1)


# -- launch ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def launch(
    world_size: int,
    calls: list[tuple[str, str, dict]],
    timeout: float,
    usage: dict | None = None,
    progress: bool = True,
) -> dict[str, list[Any]]:
    """Run ``calls`` on ``world_size`` fresh ranks; raise with the ranks' output if one fails or time runs out.

    ``progress``: print each call's name, and the seconds since the launch, as rank 0 starts it.
    ``usage``, if given, is filled with ``elapsed`` (s), ``machine_busy`` (CPU s of the whole machine,
    from /proc/stat) and ``ranks_cpu`` (CPU s of the rank processes) over the launch, so that the
    caller can tell how much CPU other processes took meanwhile (:func:`others_cpu`).
    """
    t0 = time.perf_counter()
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
                    [sys.executable, str(Path(__file__).resolve()), str(spec), str(Path(tmp, f'rank{rank}'))],
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
                if progress and running.exists():
                    current = running.read_text()
                    if current != seen:
                        seen = current
                        print(f'  {time.perf_counter() - t0:6.1f}s  {current}', flush=True)
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


# -- timing ---------------------------------------------------------------------------------------


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float('nan')


def timed(result: dict, key: str = 'step_wall') -> list[float]:
    """A fit's per-step values, without the warm-up steps."""
    return result[key][WARMUP_STEPS:]


# -- machine state --------------------------------------------------------------------------------


def load_average(values: Optional[tuple[float, ...]] = None) -> str:
    """The load average (1, 5, 15 min), now or as ``os.getloadavg()`` gave it earlier, as results.md writes it."""
    return ', '.join(f'{v:.2f}' for v in (values or os.getloadavg()))


def wait_for_quiet(max_seconds: float, threshold: float = 0.7) -> None:
    """Wait, at most ``max_seconds``, for the 1-minute load average to drop below ``threshold``."""
    deadline = time.monotonic() + max_seconds
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        print(f'waiting for a quiet machine: load average {os.getloadavg()[0]:.2f}', flush=True)
        time.sleep(15)


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


def others_cpu(usage: dict, world: int) -> tuple[float, str]:
    """Cores other processes took during a launch (``launch``'s ``usage``), and results.md's sentence on it."""
    foreign = (usage['machine_busy'] - usage['ranks_cpu']) / usage['elapsed']
    return foreign, (
        f'{foreign:.2f} cores during the {world}-rank launch ({usage["elapsed"]:.0f} s; the ranks used '
        f'{usage["ranks_cpu"] / usage["elapsed"]:.2f})'
    )


def rss_bytes() -> int:
    """This process's resident set now, in bytes (from /proc/self/statm)."""
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def machine() -> str:
    """Cores, architecture and the versions that matter."""
    return (
        f'{os.cpu_count()} CPU cores ({platform.machine()}), torch {version("torch")}, '
        f'composer {version("mosaicml")}, Python {platform.python_version()}'
    )


def code_version() -> str:
    """The composer_join code measured: git commit, and whether composer_join/ has uncommitted changes (read-only git)."""
    root = HERE.parent
    try:
        commit = subprocess.run(
            ['git', 'rev-parse', '--short', 'HEAD'], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ['git', '--no-optional-locks', 'status', '--porcelain', '--', 'composer_join'],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return 'unknown (no git)'
    changed = [p for p in dirty if p.startswith('composer_join')]
    return f'commit {commit}' + (f' plus uncommitted changes in {", ".join(changed)}' if changed else '')


# -- output ---------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f'{1000 * seconds:.1f}'


def us(seconds: float) -> str:
    return f'{1e6 * seconds:.0f}'


def mark(ok: bool) -> str:
    return 'yes' if ok else '**no**'


def now() -> str:
    """The date and time results.md gives a run."""
    return datetime.datetime.now().strftime('%Y-%m-%d %H:%M')


def out_dir(out: Optional[Path], quick: bool, prefix: str) -> Path:
    """Where a benchmark writes: ``out``; else a fresh temporary directory for ``--quick``, else benchmarks/."""
    path = out or (Path(tempfile.mkdtemp(prefix=prefix)) if quick else HERE)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def figure(path: Path, rows: int, columns: int, size: tuple[float, float]) -> Iterator[Any]:
    """A matplotlib figure of ``rows`` x ``columns`` panels (the axes, as ``plt.subplots`` gives them), saved to ``path``."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, columns, figsize=size)
    yield axes
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == '__main__':
    _rank_main(sys.argv[1], sys.argv[2])
