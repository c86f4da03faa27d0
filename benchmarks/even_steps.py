"""What an even step costs UnevenJoin in Composer's event loop, alone (to compare two code trees back to back).

On even shards (every step even: no rank shadows), ``run.py``'s 2-rank workload, one UnevenJoin fit and one stock
fit per round (``workloads.event_costs``), per step (median over the fit's steps, rank 0):

* the events ``UnevenJoin.match`` said yes to (Composer's engine asks it at every event, and runs ``apply`` and its
  own bookkeeping for each one matched: a trace, ``log_traces``, a debug-log string);
* the CPU in UnevenJoin's ``match`` and ``apply`` calls, with the timing wrappers' own cost (a few microseconds a
  call);
* **UnevenJoin in the event loop**: Composer's ``Engine._run_algorithms`` in a third fit, UnevenJoin's calls not
  timed, minus the same in the stock fit (everything UnevenJoin costs the engine: its calls, the algorithm pass and
  the bookkeeping for the events it matched);
* the ``JoinLoader``'s ``next`` (fetch and report; no agreement on these steps), outside the event loop.

``--overhead``: section 1's overhead rounds instead (:mod:`overhead`, 2 ranks: step time of stock, the faked
agreement and UnevenJoin), printed as UnevenJoin / stock. ``--microbatch 16`` splits each 32-sample batch into two
microbatches. Compare two trees by alternating runs, from a
directory outside both (the ranks import ``composer_join`` from the current directory before ``PYTHONPATH``)::

    cd /tmp && PYTHONPATH=/path/to/this/tree python /path/to/this/tree/benchmarks/even_steps.py --microbatch 16
    cd /tmp && PYTHONPATH=/path/to/other/tree python /path/to/this/tree/benchmarks/even_steps.py --microbatch 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead
from breakdown import ENGINE, MATCHED
from common import BATCH, Setup, launch

LOADER = 'JoinLoader next (fetch + agreement + report)'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--world', type=int, default=2)
    parser.add_argument('--batches', type=int, default=32, help='steps of the fit')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--microbatch', type=int, default=None)
    parser.add_argument('--overhead', action='store_true', help="section 1's overhead rounds instead")
    args = parser.parse_args()
    if args.overhead:
        setup = Setup(args.world, batches=args.batches, rounds=args.rounds, reps=1, cases=())
        warm = [('warm-up', 'warm_up', {'sizes': [4 * BATCH] * args.world})]
        out = overhead.analyse(launch(args.world, warm + overhead.calls(setup), timeout=900, progress=False), setup)
        join = out['UnevenJoin']
        print(
            f'stock {1e3 * out["stock"]["wall"]:.1f} ms/step, UnevenJoin {1e3 * join["wall"]:.1f}: '
            f'UnevenJoin / stock {join["ratio"]:.3f}, per round {join["round_median"]:.3f} '
            f'({join["round_min"]:.3f}-{join["round_max"]:.3f})'
        )
        return
    sizes = [args.batches * BATCH] * args.world
    kwargs = {'sizes': sizes, 'microbatch': args.microbatch}
    calls = [('warm-up', 'warm_up', {'sizes': [4 * BATCH] * args.world})]
    for r in range(args.rounds):
        calls += [
            (f'join|{r}', 'event_costs', kwargs),
            (f'loop|{r}', 'event_costs', {**kwargs, 'calls': False}),
            (f'stock|{r}', 'event_costs', {**kwargs, 'join': False}),
        ]
    res = launch(args.world, calls, timeout=900, progress=False)
    rows = []
    for r in range(args.rounds):
        join, loop, stock = (res[f'{kind}|{r}'][0]['per_step'] for kind in ('join', 'loop', 'stock'))
        calls_s = sum(v for k, v in join.items() if k.startswith(('apply', 'match')))
        rows.append((join.get(MATCHED, 0.0), calls_s, loop[ENGINE] - stock[ENGINE], loop.get(LOADER, 0.0)))
    print('| round | events matched | match + apply us | UnevenJoin in the event loop us | JoinLoader next us |')
    print('|---|---|---|---|---|')
    for r, (matched, calls_s, loop, loader) in enumerate(rows):
        print(f'| {r} | {matched:.0f} | {1e6 * calls_s:.0f} | {1e6 * loop:.0f} | {1e6 * loader:.0f} |')
    med = [statistics.median(row[i] for row in rows) for i in range(4)]
    print(f'| median | {med[0]:.0f} | {1e6 * med[1]:.0f} | {1e6 * med[2]:.0f} | {1e6 * med[3]:.0f} |')


if __name__ == '__main__':
    main()
