"""What every benchmark of benchmarks/ shares: launching ranks, timing, the machine's state, and output.

Light: importing this module imports no torch, so that the driver process stays out of the ranks' way.

* **Launch.** ``launch(world_size, calls, timeout)`` runs the calls on ``world_size`` ranks through the
  tests' launcher (``tests/harness.py``: the environment Composer's launcher would give each rank, one
  process group, one intra-op thread, a hard timeout after which every rank is killed; the ranks forked
  from one server that imported torch, Composer and ``composer_join`` once). A call is ``(name,
  function, kwargs)`` with ``function`` in ``workloads.py`` (or ``'module:function'`` for another module
  of benchmarks/); ``launch`` returns ``{name: [result of rank 0, rank 1, ...]}``, and raises if a call
  raised on any rank.
* **Timing.** The shape of a fit's per-step series (:data:`WARMUP_STEPS` untimed, :func:`timed`), medians.
* **Machine state.** Load average, waiting for a quiet machine, CPU taken by other processes
  during a launch (from the launch's accounting), a process's resident set, the machine and code measured.
* **Output.** Number formats of the tables, the date, the output directory, a chart's figure.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
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
TESTS = HERE.parent / 'tests'  # the launcher, tests/harness.py
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


def launch(
    world_size: int,
    calls: list[tuple[str, str, dict]],
    timeout: float,
    usage: dict | None = None,
    progress: bool = True,
) -> dict[str, list[Any]]:
    """Run ``calls`` on ``world_size`` fresh ranks (``tests/harness.py``); raise if a call raised on a rank.

    ``progress``: print each call's name, and the seconds since the launch, as rank 0 starts it.
    ``usage``, if given, is filled with ``elapsed`` (s), ``machine_busy`` (CPU s of the whole machine,
    from /proc/stat) and ``ranks_cpu`` (CPU s of the rank processes) over the launch, so that the
    caller can tell how much CPU other processes took meanwhile (:func:`others_cpu`).
    """
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))
    import harness  # (imports no torch; its ranks' server does)

    t0 = time.perf_counter()
    results = harness.launch(
        world_size,
        [(name, function if ':' in function else f'workloads:{function}', kwargs) for name, function, kwargs in calls],
        timeout=timeout,
        collective_timeout=120,
        usage=usage,
        progress=(lambda name: print(f'  {time.perf_counter() - t0:6.1f}s  {name}', flush=True)) if progress else None,
    )
    failed = [
        f'{name} on rank {rank}: {value}'
        for name, per_rank in results.items()
        for rank, value in enumerate(per_rank)
        if isinstance(value, harness.RankError)
    ]
    if failed:
        raise RuntimeError(f'{world_size}-rank launch: ' + '; '.join(failed))
    return results


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
