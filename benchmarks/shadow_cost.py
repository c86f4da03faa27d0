"""A shadow step's CPU time over a real step's, alone (the "shadow / real, CPU" column of ``run.py``'s results).

Runs only UnevenJoin's uneven fits of ``run.py``'s 2-rank setup (or ``--world 3`` / ``4``: that setup),
and splits their per-step main-thread CPU times by ``composer_join.is_shadow_step`` with
``uneven.shadow_split``, as ``uneven.analyse`` does (warm-up steps left out, all ranks and repetitions
pooled, medians).
Useful to compare two code trees back to back on a busy machine, run from a directory outside both (the ranks
import ``composer_join`` from the current directory before ``PYTHONPATH``)::

    cd /tmp && PYTHONPATH=/path/to/this/tree python /path/to/this/tree/benchmarks/shadow_cost.py
    cd /tmp && PYTHONPATH=/path/to/other/tree python /path/to/this/tree/benchmarks/shadow_cost.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run
import uneven
from common import BATCH, case_sizes, launch, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--world', type=int, default=2, choices=[s.world for s in run.FULL])
    parser.add_argument('--reps', type=int, default=2)
    args = parser.parse_args()
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
        split = uneven.shadow_split([res[f'{case}|{rep}'] for rep in range(args.reps)])
        shadow, real = median(split[True]['cpu']), median(split[False]['cpu'])
        print(
            f'| {setup.world} | {case} | {len(split[True]["cpu"])} | {1000 * real:.1f} | {1000 * shadow:.1f} | '
            f'{shadow / real:.2f} |'
        )


if __name__ == '__main__':
    main()
