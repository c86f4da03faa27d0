"""Benchmarks for UnevenJoin: overhead, data kept and time, against stock Composer and torch's ``DDP.join``.

Run from the repository root::

    .venv/bin/python benchmarks/run.py            # full run (= make bench), ~4.5 min on 2 CPU cores;
                                                  # writes benchmarks/results.md and benchmarks/results.png
    .venv/bin/python benchmarks/run.py --quick    # smoke run (< 1 min), into a temporary directory

Options: ``--out DIR`` (where results.md / results.png go), ``--wait-quiet SECONDS`` (first wait,
at most that long, for the 1-minute load average to drop below 0.7), ``--profile`` (also profile a
stock and an UnevenJoin fit with cProfile at 2 ranks; writes ``profile.txt`` beside the results).

This is the driver: it runs every benchmark and writes their sections into results.md (and the
charts). One module per benchmark, each with its method in its docstring:

1. **Overhead on even inputs** (``overhead.py``), with the collectives per step for each DDP sync
   strategy at 2 ranks (``counts.py``).
2. **Uneven inputs** (``uneven.py``): shard ratios 1:1 to one empty rank, stock, padded, torch's
   ``DDP.join`` and UnevenJoin against the limit. **Scaling**: overhead and the 4:1 and one-empty
   cases at 3 and 4 ranks too (more ranks than cores: ranks share cores, so collectives wait for the
   scheduler).
3. **Rebalancing** (``rebalance.py``, section 3 of results.md and ``rebalance.png``): epoch wall time
   of ``UnevenJoin(mode='rebalance')`` and of shadowing over the balanced ideal, and bytes moved.

Where the time goes (``breakdown.py``): at every world size, one UnevenJoin fit with its events and
agreement timed and the bare cost of one agreement all-reduce. ``--profile``: ``profiling.py``.

How: ranks are real processes (one per rank, gloo on CPU, one thread each, launched by
``common.py`` through the tests' launcher ``tests/harness.py``; ``common.py`` also holds the timing,
machine-state and output helpers every benchmark shares); the benchmarks of sections 1, 2 and the breakdown run in one launch per world size, so
that they share one process group, after a throw-away warm-up fit of each kind. The workload
(``workloads.py``, the code the ranks run): a small conv net, 32 samples per rank per step, one
epoch, SGD with momentum. Step time = ``time.perf_counter`` delta between consecutive ``BATCH_END``
events; the first ``WARMUP_STEPS`` steps of every fit are not timed.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import breakdown  # (every benchmark module is light: no torch import in this process)
import common
import counts
import overhead
import profiling
import rebalance
import uneven
from common import BATCH, DISTURBED, WARMUP_STEPS, Setup

FULL = (
    Setup(2, batches=32, rounds=6, reps=4, cases=uneven.CASES, counts=True, timeout=300),
    Setup(3, batches=14, rounds=4, reps=2, cases=('4:1', 'one empty'), timeout=200),
    Setup(4, batches=10, rounds=4, reps=2, cases=('4:1', 'one empty'), timeout=200),
)
QUICK = (Setup(2, batches=6, rounds=1, reps=1, cases=('4:1', 'one empty'), counts=True, timeout=120),)


def calls(s: Setup, profile: bool) -> list[tuple[str, str, dict]]:
    """Every run of one launch, in order; names are ``part|...`` keys read back by each benchmark's ``analyse``."""
    warm_up = ('warm-up', 'warm_up', {'sizes': [4 * BATCH] * s.world})
    return [
        warm_up,
        *overhead.calls(s),
        *uneven.calls(s),
        *counts.calls(s),
        *breakdown.calls(s),
        *profiling.calls(s, profile),
    ]


def header(info: dict) -> list[str]:
    """results.md's title and what was run, on what, under which load (lines)."""
    L = ['# UnevenJoin benchmarks\n']
    add = L.append
    add(
        f'`{info["command"]}`, {info["date"]}, {info["seconds"]:.0f} s. {info["machine"]}. composer_join: '
        f'{info["code"]}.\n'
    )
    add(
        f'Machine load: load average (1, 5, 15 min) {info["load_before"]} before the run, {info["load_after"]} after '
        f"it (that one includes the benchmark's own ranks). CPU taken by *other* processes while the ranks ran "
        f"(machine busy time minus the ranks', from /proc): {info['others']}.\n"
    )
    if info['disturbed']:
        add(
            f'**Warning: other processes took more than {DISTURBED} of a core during the launches at '
            f'{", ".join(str(w) for w in info["disturbed"])} ranks; their timings are disturbed.**\n'
        )
    add(
        f'Workload: a small conv net (BatchNorm, 0.62 M parameters), {BATCH} samples per rank per step, one epoch, '
        f'SGD with momentum, one thread per rank, gloo. Longest shard: '
        + ', '.join(f'{s.batches} batches at {s.world} ranks' for s in info['setups'])
        + f'. Step time: `perf_counter` between consecutive `BATCH_END`s; the first {WARMUP_STEPS} steps of '
        'every fit are not timed. With more ranks than the 2 cores, ranks share cores.\n'
    )
    return L


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='UnevenJoin benchmarks (see the module docstring).')
    parser.add_argument('--quick', action='store_true', help='smoke run: 2 ranks, tiny shards (< 1 min)')
    parser.add_argument(
        '--out',
        type=Path,
        default=None,
        help='directory for results.md and results.png (default: benchmarks/, or a temporary directory with --quick)',
    )
    parser.add_argument(
        '--wait-quiet',
        type=float,
        default=0,
        metavar='SECONDS',
        help='first wait up to SECONDS for the 1-minute load average to drop below 0.7',
    )
    parser.add_argument(
        '--max-ranks',
        type=int,
        default=None,
        metavar='N',
        help='only world sizes up to N (make bench-gpu: the number of GPUs, one per rank)',
    )
    parser.add_argument(
        '--profile', action='store_true', help='also cProfile a stock and an UnevenJoin fit (profile.txt)'
    )
    parser.add_argument(
        '--save-raw',
        type=Path,
        default=None,
        metavar='FILE',
        help="also pickle every rank's raw results (per-step times etc.) to FILE",
    )
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    out = common.out_dir(args.out, args.quick, 'composer-join-bench-')
    setups = tuple(s for s in (QUICK if args.quick else FULL) if args.max_ranks is None or s.world <= args.max_ranks)
    if not setups:  # e.g. make bench-gpu on fewer GPUs than the smallest world size: say so in the results
        (out / 'results.md').write_text(
            f'# UnevenJoin benchmarks\n\nNot run: every world size ({", ".join(str(s.world) for s in (QUICK if args.quick else FULL))} '
            f'ranks) is above --max-ranks {args.max_ranks}.\n'
        )
        print(f'wrote {out / "results.md"}: nothing to run with --max-ranks {args.max_ranks}')
        return 0

    if args.wait_quiet:
        common.wait_for_quiet(args.wait_quiet)
    load_before = os.getloadavg()
    if load_before[0] > 1.0:
        print(f'warning: load average {load_before[0]:.2f}: other processes will disturb the timings', flush=True)
    start = time.perf_counter()
    overheads, uneven_rows, count_rows, events, others, disturbed, raw = [], [], [], {}, [], [], {}
    profile = None
    for s in setups:
        usage: dict = {}
        planned = calls(s, args.profile)
        print(f'{s.world} ranks: {len(planned)} runs', flush=True)
        res = common.launch(s.world, planned, timeout=s.timeout, usage=usage)
        foreign, sentence = common.others_cpu(usage, s.world)
        disturbed += [s.world] if foreign > DISTURBED else []
        others.append(sentence)
        if args.save_raw:
            raw[s.world] = res
        overheads.append(overhead.analyse(res, s))
        uneven_rows += uneven.analyse(res, s)
        if s.counts:
            count_rows = counts.analyse(res)
        events[s.world] = breakdown.analyse(res)
        profile = profiling.write(res, out) or profile
        print(f'  done in {usage["elapsed"]:.0f} s', flush=True)

    info = {
        'command': ' '.join(['.venv/bin/python benchmarks/run.py'] + (argv if argv is not None else sys.argv[1:])),
        'date': common.now(),
        'seconds': time.perf_counter() - start,
        'machine': common.machine(),
        'load_before': common.load_average(load_before),
        'load_after': common.load_average(),
        'others': '; '.join(others),
        'disturbed': disturbed,
        'setups': setups,
        'code': common.code_version(),
    }
    if args.save_raw:
        args.save_raw.write_bytes(pickle.dumps(raw))
    lines = (
        header(info)
        + overhead.markdown(overheads)
        + counts.markdown(count_rows)
        + uneven.markdown(uneven_rows)
        + breakdown.markdown(events, overheads)
        + profiling.markdown(profile)
    )
    text = '\n'.join(lines) + '\n'
    text += '\n' + rebalance.run(args.quick, out, info['command'], args.max_ranks)  # section 3, and rebalance.png
    (out / 'results.md').write_text(text)
    with common.figure(out / 'results.png', 2, 3, (16, 8.5)) as axes:
        overhead.chart(axes[0][0], overheads)
        uneven.chart([axes[0][1], axes[0][2], axes[1][0], axes[1][1], axes[1][2]], uneven_rows)
    print(text)
    print(
        f'wrote {out / "results.md"}, {out / "results.png"} and {out / "rebalance.png"} in '
        f'{time.perf_counter() - start:.0f} s'
    )
    return 0


if __name__ == '__main__':
    sys.exit(main())
