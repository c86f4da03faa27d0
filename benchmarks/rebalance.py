"""Benchmark of ``UnevenJoin(mode='rebalance')``: epoch wall time against the balanced ideal, next to shadowing.

Run with the rest (``make bench`` = ``benchmarks/run.py``, which calls :func:`run`), or alone::

    .venv/bin/python benchmarks/rebalance.py            # full: 2, 3 and 4 ranks, ~4 min on 2 quiet cores
    .venv/bin/python benchmarks/rebalance.py --quick    # smoke run: 2 ranks, tiny shards (~30 s)

Options: ``--out DIR`` (default: benchmarks/, or a temporary directory with ``--quick``), where
``rebalance.md`` and ``rebalance.png`` go (from ``run.py``: section 3 of ``results.md``, and ``rebalance.png``).

What is measured, and how
-------------------------
The workload of ``workloads.py`` (a small conv net, 32 samples per rank per step, SGD with
momentum, one thread per rank, gloo), one epoch per fit, all fits of one world size in one launch
(``ranks.py``) after a throw-away warm-up. Cases: rank 0 has ``L`` batches; "r:1": every other rank
``L / r``; "one empty": every rank ``L`` but the last, which has none. Methods, per case:

* **ideal**: stock Composer on *balanced* shards holding the same total, ``ceil(total / W)``
  batches per rank (every step real on every rank: the least time any method can take);
* **shadow**: ``UnevenJoin()`` (``mode='shadow'``): the longest rank's count of steps;
* **rebalance**: ``UnevenJoin(mode='rebalance')``: ``ceil(total / W)`` steps.

Wall time = ``Trainer.fit``, max over ranks, median over repetitions (methods in alternating order).
Reported: wall / ideal (goal for rebalance: <= 1.10), steps, bytes moved per epoch (the epoch
report's ``bytes_moved``: tensors plus headers), and samples trained (all of them, in every method).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CASES = ('2:1', '4:1', 'one empty')
METHODS = ('ideal', 'shadow', 'rebalance')
GOAL = 1.10


@dataclass(frozen=True)
class Setup:
    world: int
    longest: int  # rank 0's batches; chosen so that the total divides by the world size in every case
    reps: int
    cases: tuple[str, ...] = CASES
    timeout: float = 300


FULL = (Setup(2, 24, reps=3), Setup(3, 24, reps=2), Setup(4, 16, reps=2))
QUICK = (Setup(2, 6, reps=1, cases=('4:1', 'one empty'), timeout=150),)


def case_batches(case: str, world: int, longest: int) -> list[int]:
    """Per-rank batch counts of a case."""
    if case == 'one empty':
        return [longest] * (world - 1) + [0]
    return [longest] + [longest // int(case.split(':')[0])] * (world - 1)


def method_batches(method: str, batches: list[int]) -> list[int]:
    if method == 'ideal':
        return [math.ceil(sum(batches) / len(batches))] * len(batches)
    return batches


# -- on the ranks ---------------------------------------------------------------------------------


def fit(batches: list[int], mode: Optional[str]) -> dict[str, Any]:
    """One epoch on this rank's shard of ``batches[rank]`` batches; ``mode=None``: stock Composer."""
    import torch
    from composer import Trainer
    from composer.utils import dist

    import workloads
    from composer_join import UnevenJoin

    rank = dist.get_global_rank()
    sizes = [n * workloads.BATCH for n in batches]
    model = workloads.Classifier()
    join = UnevenJoin(mode=mode) if mode is not None else None
    timer = workloads.StepTimer()
    trainer = Trainer(
        model=model, train_dataloader=workloads.shard(rank, sizes), max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=workloads.LR, momentum=0.9),
        algorithms=[join] if join is not None else [], callbacks=[timer], loggers=[], device=workloads.DEVICE,
        progress_bar=False, log_to_console=False, seed=0,
    )
    dist.barrier()
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    report = join.reports[-1] if join is not None and join.reports else None
    result = {
        'wall': wall,
        'steps': int(trainer.state.timestamp.batch),
        'samples': int(trainer.state.timestamp.sample),
        'shadow_steps': sum(timer.shadow),
        'bytes_moved': report.bytes_moved if report is not None else 0,
        'received': report.received_batches if report is not None and report.rebalanced else [],
    }
    trainer.close()
    return result


def warm_up(batches: list[int]) -> dict:
    for mode in (None, 'shadow', 'rebalance'):
        fit(batches, mode)
    return {}


# -- driving and reporting ------------------------------------------------------------------------


def calls(s: Setup) -> list[tuple[str, str, dict]]:
    out = [('warm-up', 'rebalance:warm_up', {'batches': [4, 2] + [2] * (s.world - 2)})]
    for rep in range(s.reps):
        for case in s.cases:
            batches = case_batches(case, s.world, s.longest)
            for method in METHODS if rep % 2 == 0 else METHODS[::-1]:
                mode = None if method == 'ideal' else method
                out.append((f'{case}|{method}|{rep}', 'rebalance:fit',
                            {'batches': method_batches(method, batches), 'mode': mode}))
    return out


def analyse(res: dict, s: Setup) -> list[dict[str, Any]]:
    rows = []
    for case in s.cases:
        walls = {m: [max(r['wall'] for r in res[f'{case}|{m}|{rep}']) for rep in range(s.reps)] for m in METHODS}
        ideal = statistics.median(walls['ideal'])
        for m in METHODS:
            last = res[f'{case}|{m}|{s.reps - 1}']
            rows.append({
                'world': s.world, 'case': case, 'method': m,
                'batches': method_batches(m, case_batches(case, s.world, s.longest)),
                'steps': last[0]['steps'], 'samples': last[0]['samples'], 'wall': statistics.median(walls[m]),
                'ratio': statistics.median(walls[m]) / ideal,
                'range': (min(walls[m]) / ideal, max(walls[m]) / ideal),
                'bytes': last[0]['bytes_moved'], 'shadow_steps': sum(r['shadow_steps'] for r in last),
            })
    return rows


def markdown(rows: list[dict], info: dict) -> str:
    lines = [
        '## 3. Rebalancing (`UnevenJoin(mode=\'rebalance\')`)\n',
        f'`{info["command"]}`, {info["date"]}, {info["seconds"]:.0f} s; load average before: {info["load"]}; '
        f'composer_join {info["code"]}.\n',
        'One epoch of the workload above. *ideal*: stock Composer on balanced shards of the same total, '
        '`ceil(total / W)` batches per rank. *shadow*: `UnevenJoin()`; *rebalance*: `UnevenJoin(mode=\'rebalance\')`. '
        'Wall time: `fit`, max over ranks, median over repetitions; range over repetitions in brackets. '
        f'Bytes moved: per epoch, batches plus headers. Goal: rebalance / ideal <= {GOAL:.2f}.\n',
        '| ranks | case (batches per rank) | ideal s | shadow / ideal | **rebalance / ideal** | goal met | '
        'steps: shadow, rebalance | shadow steps (all ranks): shadow, rebalance | bytes moved per epoch |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    for world in sorted({r['world'] for r in rows}):
        for case in dict.fromkeys(r['case'] for r in rows if r['world'] == world):
            by = {r['method']: r for r in rows if r['world'] == world and r['case'] == case}
            i, sh, rb = by['ideal'], by['shadow'], by['rebalance']
            lines.append(
                f'| {world} | {case} ({"/".join(map(str, sh["batches"]))}) | {i["wall"]:.2f} | '
                f'{sh["ratio"]:.3f} ({sh["range"][0]:.2f}-{sh["range"][1]:.2f}) | '
                f'**{rb["ratio"]:.3f}** ({rb["range"][0]:.2f}-{rb["range"][1]:.2f}) | '
                f'{"yes" if rb["ratio"] <= GOAL else "**no**"} | {sh["steps"]}, {rb["steps"]} | '
                f'{sh["shadow_steps"]}, {rb["shadow_steps"]} | {rb["bytes"] / 1e6:.2f} MB |')
    return '\n'.join(lines) + '\n'


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    groups = [(w, c) for w in sorted({r['world'] for r in rows})
              for c in dict.fromkeys(r['case'] for r in rows if r['world'] == w)]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups)), 3.8))
    colors = {'shadow': '#5a8fd6', 'rebalance': '#2e9e5b'}
    for k, method in enumerate(('shadow', 'rebalance')):
        values = [next(r['ratio'] for r in rows if (r['world'], r['case'], r['method']) == (w, c, method))
                  for w, c in groups]
        xs = [g + (k - 0.5) * 0.38 for g in range(len(groups))]
        ax.bar(xs, values, 0.38, label=f'UnevenJoin, {method}', color=colors[method])
        if method == 'rebalance':  # bytes moved per epoch, above each bar
            moved = [next(r['bytes'] for r in rows if (r['world'], r['case'], r['method']) == (w, c, method))
                     for w, c in groups]
            for x, v, b in zip(xs, values, moved):
                ax.annotate(f'{b / 1e6:.1f} MB', (x, v), xytext=(0, 2), textcoords='offset points', ha='center',
                            fontsize=7)
    ax.axhline(1.0, color='black', lw=0.8)
    ax.axhline(GOAL, color='#2e9e5b', lw=0.8, ls='--', label=f'goal for rebalance ({GOAL:.2f})')
    ax.set_xticks(range(len(groups)), [f'{w} ranks\n{c}' for w, c in groups], fontsize=8)
    ax.set(ylabel='epoch wall time / balanced ideal',
           title='Uneven shards: shadowing vs rebalancing (labels: bytes moved per epoch)')
    ax.set_ylim(0, 1.35 * max(r['ratio'] for r in rows))
    ax.legend(fontsize=8, ncol=3, loc='upper center')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, out: Path, command: str = '', max_ranks: Optional[int] = None) -> str:
    """Run the benchmark, write ``rebalance.png`` into ``out``; return the markdown section.

    ``max_ranks``: only world sizes up to it (``make bench-gpu``: one GPU per rank); the section
    then says which world sizes were left out.
    """
    import datetime

    from ranks import launch
    from run import code_version

    load = ', '.join(f'{v:.2f}' for v in os.getloadavg())
    start = time.perf_counter()
    rows = []
    setups = [s for s in (QUICK if quick else FULL) if max_ranks is None or s.world <= max_ranks]
    left_out = sorted({s.world for s in (QUICK if quick else FULL)} - {s.world for s in setups})
    if not setups:
        return (f'## 3. Rebalancing\n\nNot run: every world size of this benchmark ({", ".join(map(str, left_out))} '
                f'ranks) is above --max-ranks {max_ranks}.\n')
    for s in setups:
        print(f'rebalance: {s.world} ranks', flush=True)
        t0 = time.perf_counter()
        res = launch(s.world, calls(s), timeout=s.timeout,
                     progress=lambda name: print(f'  {time.perf_counter() - t0:6.1f}s  {name}', flush=True))
        rows += analyse(res, s)
    info = {'command': command or ('.venv/bin/python benchmarks/rebalance.py' + (' --quick' if quick else '')),
            'date': datetime.datetime.now().strftime('%Y-%m-%d %H:%M'), 'seconds': time.perf_counter() - start,
            'load': load, 'code': code_version()}
    chart(rows, out / 'rebalance.png')
    note = f'\n(Left out, above --max-ranks {max_ranks}: {", ".join(map(str, left_out))} ranks.)\n' if left_out else ''
    return markdown(rows, info) + note


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description='UnevenJoin rebalance benchmark (see the module docstring).')
    parser.add_argument('--quick', action='store_true', help='smoke run: 2 ranks, tiny shards')
    parser.add_argument('--out', type=Path, default=None, help='directory for rebalance.md and rebalance.png')
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix='composer-join-rebalance-')) if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    text = run(args.quick, out)
    (out / 'rebalance.md').write_text(text)
    print(text)
    print(f'wrote {out / "rebalance.md"} and {out / "rebalance.png"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
