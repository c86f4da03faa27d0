"""A shadow step beside its floor, torch ``Join``'s joined iteration and a real step, in one launch (issue 52).

2 ranks (one thread each, gloo on CPU), an MLP of six parameter tensors at two sizes (2.3 M and 25.3 M
parameters, ``shadow_workloads.py``), batches of 64, SGD with momentum, DDP's default buckets. Rank 0 has
``long`` batches, rank 1 ``short``, so rank 1 runs ``long - short`` shadow steps. Per size, all in the same
processes (``shadow_workloads.py`` says what each measures):

* **shadow step**: rank 1's shadow steps of a Composer fit with ``UnevenJoin`` (``BATCH_START`` to ``BATCH_END``),
  its first two left out (the first makes what later ones reuse);
* **floor**: DDP's gradient buckets all-reduced bare, as the reducer issues them, plus ``optimizer.step()``;
  **zero fill**: filling those buckets with zeros, timed apart (gloo's all-reduce is in place: a rank that
  contributes zeros and keeps the result must write zeros the size of the model each step);
* **torch Join**: a plain DDP loop's joined iterations under ``DistributedDataParallel.join`` (no optimizer step);
* **real step**: rank 0's Composer steps with data (the first three left out);
* **allocated**: bytes allocated in rank 1's steps, with torch's profiler (``profile_memory=True``): its first shadow
  step and a later one; **peak**: rank 1's peak resident set in a step (Linux's ``VmHWM``, reset at the step's
  start), the median over its shadow steps after the first and over its real steps, in a fit of its own.

Times are CPU of the whole process (every thread: gloo's reduction runs in its own), medians over repetitions
pooled. ``--thread`` prints the main thread's CPU instead. Run from the tree to measure (the ranks import
``composer_join`` from the current directory before ``PYTHONPATH``)::

    cd /path/to/tree && PYTHONPATH=$PWD python benchmarks/shadow_cost.py

``--split`` gives the former table instead: ``run.py``'s 2-rank uneven fits (conv net), per-step main-thread CPU
split by ``is_shadow_step`` (``uneven.shadow_split``), shadow over real.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run
import uneven
from common import BATCH, case_sizes, launch, load_average, median

# parameters: (hidden, long, short); the smallest shows Composer's own per-step cost, about the same at every size
SIZES = {'7 k': (24, 30, 10), '2.3 M': (1400, 30, 10), '25.3 M': (4900, 16, 4)}
PARTS = ('composer_shadow', 'torch_join', 'floor')


def split(args: argparse.Namespace) -> None:
    """The former table: shadow / real of ``run.py``'s uneven fits."""
    setup = next(s for s in run.FULL if s.world == args.world)
    cases = tuple(c for c in setup.cases if c != '1:1')
    longest = setup.batches * BATCH
    calls = [('warm-up', 'warm_up', {'sizes': [4 * BATCH] * setup.world})]
    for rep in range(args.reps):
        for case in cases:
            calls.append((f'{case}|{rep}', *uneven.method_call('UnevenJoin', case_sizes(case, setup.world, longest))))
    res = launch(setup.world, calls, timeout=600, progress=False)
    print('| ranks | case | shadow steps timed | real step CPU ms | shadow step CPU ms | shadow / real, CPU |')
    print('|---|---|---|---|---|---|')
    for case in cases:
        parts = uneven.shadow_split([res[f'{case}|{rep}'] for rep in range(args.reps)])
        shadow, real = median(parts[True]['cpu']), median(parts[False]['cpu'])
        print(
            f'| {setup.world} | {case} | {len(parts[True]["cpu"])} | {1000 * real:.1f} | {1000 * shadow:.1f} | '
            f'{shadow / real:.2f} |'
        )


def profile(args: argparse.Namespace) -> None:
    """The shadowing rank's shadow steps under cProfile, at each size."""
    calls = [
        (name, 'shadow_workloads:composer_profile', {'hidden': h, 'long': long, 'short': short})
        for name, (h, long, short) in SIZES.items()
    ]
    res = launch(2, calls, timeout=900, progress=False)
    for name in SIZES:
        print(f'== {name}: {res[name][1]["steps"]} shadow steps')
        print(res[name][1]['text'])


def side_by_side(args: argparse.Namespace) -> None:
    calls = [('warm-up', 'shadow_workloads:composer_shadow', {'hidden': 256, 'long': 8, 'short': 3})]
    for rep in range(args.reps):
        for name, (hidden, long, short) in SIZES.items():
            kwargs = {'hidden': hidden, 'long': long, 'short': short}
            for part in PARTS if rep % 2 == 0 else PARTS[::-1]:
                calls.append((f'{name}|{part}|{rep}', f'shadow_workloads:{part}', kwargs))
    for name, (hidden, long, short) in SIZES.items():
        calls.append(
            (f'{name}|memory', 'shadow_workloads:composer_memory', {'hidden': hidden, 'long': long, 'short': short})
        )
    print(f'load average before: {load_average()}', flush=True)
    res = launch(2, calls, timeout=1800, progress=args.progress)
    print(f'load average after: {load_average()}; composer_join from {res["warm-up"][1]["composer_join"]}')
    key = 'thread' if args.thread else 'cpu'
    print(
        '| parameters | shadow step ms | floor ms | shadow / floor | zero fill ms | torch Join, joined iteration ms | '
        'real step ms | allocated per shadow step (first; later) | peak RSS: shadow step | peak RSS: real step |'
    )
    print('|---|---|---|---|---|---|---|---|---|---|')
    for name in SIZES:
        shadow: list[float] = []
        floor: list[float] = []
        zero: list[float] = []
        joined: list[float] = []
        real: list[float] = []
        for rep in range(args.reps):
            fit = res[f'{name}|composer_shadow|{rep}']
            flags = fit[1]['shadow']
            shadow_steps = [i for i, f in enumerate(flags) if f][2:]
            shadow += [fit[1][key][i] for i in shadow_steps]
            real += fit[0][key][3:]
            floor += res[f'{name}|floor|{rep}'][1][key]
            zero += res[f'{name}|floor|{rep}'][1]['zero'][key]
            joined.append(res[f'{name}|torch_join|{rep}'][1]['joined'][key])
        steps = res[f'{name}|memory'][1]['steps']
        shadows = [v for _, v in sorted(steps.items()) if v['shadow']]
        rss = sorted(res[f'{name}|memory'][1]['rss'].items())
        rss_shadow = median(v['peak_rss'] for i, v in rss if v['shadow'] and i > SIZES[name][2])
        rss_real = median(v['peak_rss'] for _, v in rss if not v['shadow'])
        s, f = median(shadow), median(floor)
        print(
            f'| {name} | {1000 * s:.2f} | {1000 * f:.2f} | **{s / f:.2f}** | {1000 * median(zero):.2f} | '
            f'{1000 * median(joined):.2f} | '
            f'{1000 * median(real):.1f} | {_mb(shadows[0]["allocated"])}; {_mb(shadows[-1]["allocated"])} | '
            f'{_mb(rss_shadow)} | {_mb(rss_real)} |'
        )
    if args.raw:
        print(res)


def _mb(n: int) -> str:
    return f'{n / 1e6:.2f} MB' if n >= 1e5 else f'{n / 1e3:.1f} kB'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--split', action='store_true', help="the former table: run.py's uneven fits, shadow / real")
    parser.add_argument('--world', type=int, default=2, choices=[s.world for s in run.FULL], help='(--split only)')
    parser.add_argument('--reps', type=int, default=2)
    parser.add_argument('--thread', action='store_true', help="the main thread's CPU instead of the process's")
    parser.add_argument('--progress', action='store_true')
    parser.add_argument('--profile', action='store_true', help='the shadow steps under cProfile instead')
    parser.add_argument('--raw', action='store_true', help='print every result too')
    args = parser.parse_args()
    split(args) if args.split else profile(args) if args.profile else side_by_side(args)


if __name__ == '__main__':
    main()
