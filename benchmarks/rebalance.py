"""Benchmark of ``UnevenJoin(mode='rebalance')``: epoch wall time against the balanced ideal, next to shadowing.

Run with the rest (``make bench`` = ``benchmarks/run.py``, which calls :func:`run`), or alone::

    .venv/bin/python benchmarks/rebalance.py            # full: 2, 3 and 4 ranks, ~10 min on 2 quiet cores
    .venv/bin/python benchmarks/rebalance.py --quick    # smoke run: 2 ranks, tiny shards (~30 s)

Options: ``--out DIR`` (default: benchmarks/, or a temporary directory with ``--quick``), where
``rebalance.md`` and ``rebalance.png`` go (from ``run.py``: section 3 of ``results.md``, and ``rebalance.png``).

What is measured, and how
-------------------------
The workload of ``workloads.py`` (a small conv net, 32 samples per rank per step, SGD with
momentum, one thread per rank, gloo), one epoch per fit, all fits of one world size in one launch
(``common.launch``) after a throw-away warm-up. Cases: rank 0 has ``L`` batches; "r:1": every other rank
``L / r``; "one empty": every rank ``L`` but the last, which has none. Methods, per case:

* **ideal**: stock Composer on *balanced* shards holding the same total, ``ceil(total / W)``
  batches per rank (every step real on every rank: the least time any method can take);
* **shadow**: ``UnevenJoin()`` (``mode='shadow'``): the longest rank's count of steps;
* **rebalance**: ``UnevenJoin(mode='rebalance')`` on the same shards with ``len()``: ``ceil(total / W)`` steps;
* **shadow, no len** and **rebalance, no len**: the same shards as iterables without ``len()`` (streams,
  filtered data, token budgets), with ``UnevenJoin()`` and ``UnevenJoin(mode='rebalance')`` (read-ahead
  rebalancing, :mod:`composer_join.rebalance.readahead`), run for the shards' samples (Composer refuses epochs
  without ``len()``).

Wall time = ``Trainer.fit``, max over ranks, median over repetitions (methods in alternating order).
Reported: wall / ideal (goal for rebalance: <= 1.10; without len(): <= 1.15), steps, bytes moved per epoch (the
epoch report's ``bytes_moved``: tensors plus headers), samples trained (all of them, in every method); for the
read-ahead scheme also the extra cost per step over the sized scheme (``(wall - wall_sized) / steps``), and
memory: the peak growth of each rank's resident set during the fit (sampled every 2 ms, max over ranks) against
stock Composer's (the ideal), and the read-ahead buffer's peak in batches and bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # (light: no torch import in the driver)
from common import case_sizes, median

CASES = ('2:1', '4:1', 'one empty')
METHODS = ('ideal', 'shadow', 'rebalance', 'shadow_nolen', 'rebalance_nolen')
GOAL = 1.10
GOAL_NOLEN = 1.15


@dataclass(frozen=True)
class Setup:
    world: int
    longest: int  # rank 0's batches; chosen so that the total divides by the world size in every case
    reps: int
    cases: tuple[str, ...] = CASES
    timeout: float = 300


# 21-36 steps per fit (rank 0 has 48 batches): shorter fits are dominated by noise (a few ms per step
# on 2 shared cores) and by the per-fit set-up; 7 repetitions, methods in alternating order.
FULL = (Setup(2, 48, reps=7, timeout=1500), Setup(3, 48, reps=7, timeout=1500), Setup(4, 48, reps=7, timeout=1800))
QUICK = (Setup(2, 6, reps=1, cases=('4:1', 'one empty'), timeout=150),)


def method_batches(method: str, batches: list[int]) -> list[int]:
    if method == 'ideal':
        return [math.ceil(sum(batches) / len(batches))] * len(batches)
    return batches


# -- on the ranks ---------------------------------------------------------------------------------


class Unsized:
    """A shard as an iterable without ``len()``."""

    def __init__(self, batches):
        self.batches = batches
        self.batch_size = batches.batch_size

    def __iter__(self):
        return iter(self.batches)


class PeakRSS:
    """Samples this process's resident set every 2 ms in a thread: ``peak - start`` in bytes."""

    def __enter__(self):
        import threading

        self.start = self.peak = common.rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, common.rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, common.rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def agreement_counter(join: Any) -> Any:
    """A callback counting the steps at which ``join``'s ranks exchanged an agreement (none for stock Composer)."""
    from composer import Callback

    class _Agreed(Callback):
        count = 0

        def batch_start(self, state, logger):
            plan = join.plan if join is not None else None
            self.count += int(plan is not None and plan.agreed)

    return _Agreed()


def fit(batches: list[int], mode: Optional[str]) -> dict[str, Any]:
    """One epoch on this rank's shard of ``batches[rank]`` batches; ``mode=None``: stock Composer.

    ``mode`` ending in ``_nolen``: the shard without ``len()``, run for the shards' samples.
    """
    from composer.utils import dist

    import workloads
    from composer_join import UnevenJoin

    rank = dist.get_global_rank()
    sizes = [n * workloads.BATCH for n in batches]
    nolen = mode is not None and mode.endswith('_nolen')
    mode = mode[: -len('_nolen')] if nolen else mode
    join = UnevenJoin(mode=mode) if mode is not None else None
    timer = workloads.StepTimer()
    agreed = agreement_counter(join)
    data = workloads.shard(rank, sizes)
    trainer, _ = workloads.make_trainer(
        Unsized(data) if nolen else data,
        [join] if join is not None else [],
        [timer, agreed],
        max_duration=f'{sum(sizes)}sp' if nolen else '1ep',
    )
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as rss:
        trainer.fit()
    wall = time.perf_counter() - start
    source = join.train_loader.source if join is not None and join.train_loader is not None else None
    report = join.reports[-1] if join is not None and join.reports else None
    result = {
        'wall': wall,
        'steps': int(trainer.state.timestamp.batch),
        'samples': int(trainer.state.timestamp.sample),
        'shadow_steps': sum(timer.shadow),
        'bytes_moved': report.bytes_moved if report is not None else 0,
        'received': report.received_batches if report is not None and report.rebalanced else [],
        'sent': getattr(source, 'bytes_sent', 0),
        'rss_growth': rss.growth,
        'peak_held': getattr(source, 'peak_held', 0),
        'peak_held_bytes': getattr(source, 'peak_held_bytes', 0),
        'agreed_steps': agreed.count,
    }
    trainer.close()
    return result


def warm_up(batches: list[int]) -> dict:
    for mode in (None, 'shadow', 'rebalance', 'rebalance_nolen'):
        fit(batches, mode)
    return {}


# -- driving and reporting ------------------------------------------------------------------------


def calls(s: Setup) -> list[tuple[str, str, dict]]:
    out = [('warm-up', 'rebalance:warm_up', {'batches': [4, 2] + [2] * (s.world - 2)})]
    for rep in range(s.reps):
        for case in s.cases:
            batches = case_sizes(case, s.world, s.longest)
            for method in METHODS if rep % 2 == 0 else METHODS[::-1]:
                mode = None if method == 'ideal' else method
                out.append(
                    (
                        f'{case}|{method}|{rep}',
                        'rebalance:fit',
                        {'batches': method_batches(method, batches), 'mode': mode},
                    )
                )
    out.append(('latency', 'workloads:collective_latency', {'repeats': 200}))  # the agreement all-reduce alone
    return out


def analyse(res: dict, s: Setup) -> list[dict[str, Any]]:
    rows = []
    for case in s.cases:
        walls = {m: [max(r['wall'] for r in res[f'{case}|{m}|{rep}']) for rep in range(s.reps)] for m in METHODS}
        ideal = median(walls['ideal'])
        for m in METHODS:
            last = res[f'{case}|{m}|{s.reps - 1}']
            rows.append(
                {
                    'world': s.world,
                    'case': case,
                    'method': m,
                    'batches': method_batches(m, case_sizes(case, s.world, s.longest)),
                    'steps': last[0]['steps'],
                    'samples': last[0]['samples'],
                    'wall': median(walls[m]),
                    'ratio': median(walls[m]) / ideal,
                    'range': (min(walls[m]) / ideal, max(walls[m]) / ideal),
                    'bytes': sum(r['sent'] for r in last),
                    'shadow_steps': sum(r['shadow_steps'] for r in last),
                    'rss': median(max(r['rss_growth'] for r in res[f'{case}|{m}|{rep}']) for rep in range(s.reps)),
                    'peak_held': max(r['peak_held'] for r in last),
                    'peak_held_bytes': max(r['peak_held_bytes'] for r in last),
                    'agreed_steps': last[0]['agreed_steps'],
                }
            )
    return rows


def markdown(rows: list[dict], info: dict) -> str:
    lines = [
        "## 3. Rebalancing (`UnevenJoin(mode='rebalance')`), with and without `len()`\n",
        f'`{info["command"]}`, {info["date"]}, {info["seconds"]:.0f} s; load average before: {info["load"]}, '
        f'after: {info.get("load_after", "?")}; composer_join {info["code"]}.\n',
        'One epoch of the workload above. *ideal*: stock Composer on balanced shards of the same total, '
        "`ceil(total / W)` batches per rank. *shadow*: `UnevenJoin()`; *rebalance*: `UnevenJoin(mode='rebalance')`; "
        '*no len*: the same shards as iterables without `len()` (rebalance: read-ahead rebalancing). '
        'Wall time: `fit`, max over ranks, median over repetitions; range over repetitions in brackets. '
        'Extra per step: `(wall(no len) - wall(len)) / steps` of rebalancing. Agreed steps: steps at which the '
        'ranks exchanged an agreement all-reduce. Bytes moved: per epoch, batches '
        'plus headers. RSS: peak growth of the resident set during the fit, max over ranks. '
        f'Goals: rebalance / ideal <= {GOAL:.2f}, without len() <= {GOAL_NOLEN:.2f}.\n',
        '| ranks | case (batches per rank) | ideal s | shadow / ideal | rebalance / ideal | shadow, no len / ideal | '
        '**rebalance, no len / ideal** | goal met | steps: shadow, rebalance, no len | extra ms per step, no len | '
        'agreed steps: len, no len | bytes moved: len, no len | RSS growth MB: stock, no len | read-ahead peak |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for world in sorted({r['world'] for r in rows}):
        for case in dict.fromkeys(r['case'] for r in rows if r['world'] == world):
            by = {r['method']: r for r in rows if r['world'] == world and r['case'] == case}
            i, sh, rb, shn, rbn = (by[m] for m in METHODS)
            extra = (rbn['wall'] - rb['wall']) / max(rbn['steps'], 1) * 1e3
            lines.append(
                f'| {world} | {case} ({"/".join(map(str, sh["batches"]))}) | {i["wall"]:.2f} | '
                f'{sh["ratio"]:.3f} | {rb["ratio"]:.3f} | {shn["ratio"]:.3f} | '
                f'**{rbn["ratio"]:.3f}** ({rbn["range"][0]:.2f}-{rbn["range"][1]:.2f}) | '
                f'{"yes" if rbn["ratio"] <= GOAL_NOLEN else "**no**"} | {sh["steps"]}, {rb["steps"]}, {rbn["steps"]} | '
                f'{extra:+.1f} | {rb["agreed_steps"]}, {rbn["agreed_steps"]} | '
                f'{rb["bytes"] / 1e6:.2f}, {rbn["bytes"] / 1e6:.2f} MB | '
                f'{i["rss"] / 1e6:.1f}, {rbn["rss"] / 1e6:.1f} | {rbn["peak_held"]} ({rbn["peak_held_bytes"] / 1e6:.2f} MB) |'
            )
    if info.get('latency'):
        lines.append(
            '\nThe agreement all-reduce alone (`W x 12` int64, gloo, back to back, median): '
            + ', '.join(f'{w} ranks {v * 1e3:.2f} ms' for w, v in sorted(info['latency'].items()))
            + '. Without `len()` it runs on '
            "every step (overlapped with the previous step's training); the sized scheme runs it only on the steps from "
            "the shortest assigned count's last batch on (one or two per epoch)."
        )
    return '\n'.join(lines) + '\n'


def chart(rows: list[dict], path: Path) -> None:
    """``rebalance.png``: wall time over the ideal of every method but the ideal, per world size and case."""
    groups = [
        (w, c)
        for w in sorted({r['world'] for r in rows})
        for c in dict.fromkeys(r['case'] for r in rows if r['world'] == w)
    ]
    with common.figure(path, 1, 1, (max(7, 1.6 * len(groups)), 4.0)) as ax:
        _bars(ax, rows, groups)


def _bars(ax, rows: list[dict], groups: list[tuple[int, str]]) -> None:
    shown = {
        'shadow': ('shadow', '#5a8fd6'),
        'rebalance': ('rebalance', '#2e9e5b'),
        'shadow_nolen': ('shadow, no len()', '#a9c4ea'),
        'rebalance_nolen': ('rebalance, no len()', '#e08a2c'),
    }
    width = 0.2
    for k, (method, (label, color)) in enumerate(shown.items()):
        values = [
            next(r['ratio'] for r in rows if (r['world'], r['case'], r['method']) == (w, c, method)) for w, c in groups
        ]
        xs = [g + (k - 1.5) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label, color=color)
    ax.axhline(1.0, color='black', lw=0.8)
    ax.axhline(GOAL, color='#2e9e5b', lw=0.8, ls='--', label=f'goal, rebalance ({GOAL:.2f})')
    ax.axhline(GOAL_NOLEN, color='#e08a2c', lw=0.8, ls='--', label=f'goal, no len() ({GOAL_NOLEN:.2f})')
    ax.set_xticks(range(len(groups)), [f'{w} ranks\n{c}' for w, c in groups], fontsize=8)
    ax.set(
        ylabel='epoch wall time / balanced ideal',
        title='Uneven shards: shadowing vs rebalancing, with and without len()',
    )
    ax.set_ylim(0, 1.35 * max(r['ratio'] for r in rows))
    ax.legend(fontsize=7, ncol=3, loc='upper center')


def run(quick: bool, out: Path, command: str = '', max_ranks: Optional[int] = None) -> str:
    """Run the benchmark, write ``rebalance.png`` into ``out``; return the markdown section.

    ``max_ranks``: only world sizes up to it (``make bench-gpu``: one GPU per rank); the section
    then says which world sizes were left out.
    """
    load = common.load_average()
    start = time.perf_counter()
    rows, latency = [], {}
    setups = [s for s in (QUICK if quick else FULL) if max_ranks is None or s.world <= max_ranks]
    left_out = sorted({s.world for s in (QUICK if quick else FULL)} - {s.world for s in setups})
    if not setups:
        return (
            f'## 3. Rebalancing\n\nNot run: every world size of this benchmark ({", ".join(map(str, left_out))} '
            f'ranks) is above --max-ranks {max_ranks}.\n'
        )
    for s in setups:
        print(f'rebalance: {s.world} ranks', flush=True)
        res = common.launch(s.world, calls(s), timeout=s.timeout)
        rows += analyse(res, s)
        latency[s.world] = median(r['median'] for r in res['latency'])
    info = {
        'command': command or ('.venv/bin/python benchmarks/rebalance.py' + (' --quick' if quick else '')),
        'date': common.now(),
        'seconds': time.perf_counter() - start,
        'load': load,
        'code': common.code_version(),
        'latency': latency,
        'load_after': common.load_average(),
    }
    chart(rows, out / 'rebalance.png')
    note = f'\n(Left out, above --max-ranks {max_ranks}: {", ".join(map(str, left_out))} ranks.)\n' if left_out else ''
    return markdown(rows, info) + note


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description='UnevenJoin rebalance benchmark (see the module docstring).')
    parser.add_argument('--quick', action='store_true', help='smoke run: 2 ranks, tiny shards')
    parser.add_argument('--out', type=Path, default=None, help='directory for rebalance.md and rebalance.png')
    args = parser.parse_args(argv)
    out = common.out_dir(args.out, args.quick, 'composer-join-rebalance-')
    text = run(args.quick, out)
    (out / 'rebalance.md').write_text(text)
    print(text)
    print(f'wrote {out / "rebalance.md"} and {out / "rebalance.png"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
