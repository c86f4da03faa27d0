"""A shadow step beside its floor, torch ``Join``'s joined iteration and a real step, in one launch (issue 52).

2 ranks (one thread each; gloo on CPU, or NCCL with one GPU each where ``COMPOSER_JOIN_DEVICE=gpu``), an MLP of six
parameter tensors at three sizes (7 k, 2.3 M and 25.3 M parameters, ``shadow_workloads.py``), batches of 64, SGD with
momentum, under DDP (its default buckets), FSDP1 and FSDP2 (Composer's, the model one unit). Rank 0 has ``long``
batches, rank 1 ``short``, so rank 1 runs ``long - short`` shadow steps. Per wrapper and size, all in the same
processes (``shadow_workloads.py`` says what each measures):

* **shadow step**: rank 1's shadow steps of a Composer fit with ``UnevenJoin`` (``BATCH_START`` to ``BATCH_END``),
  its first two left out (the first makes what later ones reuse);
* **floor**: DDP: its gradient buckets all-reduced bare, as the reducer issues them, plus ``optimizer.step()``;
  FSDP: the all-gathers and reduce-scatters FSDP's runtime issued in a stock real step (recorded), replayed bare on
  buffers of their shapes, plus ``optimizer.step()``. **zero fill** (DDP): filling the buckets with zeros, timed
  apart (gloo's all-reduce is in place: a rank that contributes zeros and keeps the result must write zeros the
  size of the model each step);
* **Composer's collectives**: the all-reduces and broadcast Composer itself issued in that recorded step (loss,
  samples, tokens), replayed bare; **stock step, 2 samples**: stock Composer's step on batches of two samples on
  every rank (what the wrapper and Composer cost a step that computes almost nothing);
* **torch Join** (DDP): a plain DDP loop's joined iterations under ``DistributedDataParallel.join`` (no optimizer step);
* **real step**: rank 0's Composer steps with data (the first three left out);
* **allocated**: bytes allocated in rank 1's steps, with torch's profiler (``profile_memory=True``; on a GPU the
  caching allocator's counters): its first shadow step, a later one, and a real step; **peak above the step
  start**: the most allocated at once in the step above what was at its start, a later shadow step and the real one
  (not the resident set: glibc keeps freed memory, so it follows the heap's high-water mark, not the tensors).

Times are CPU of the whole process (every thread: gloo's reduction runs in its own), on GPUs the device's (CUDA
events), medians over repetitions pooled; ``--key`` picks another. Run from the tree to measure (the ranks import
``composer_join`` from the current directory before ``PYTHONPATH``)::

    cd /path/to/tree && PYTHONPATH=$PWD python benchmarks/shadow_cost.py                 # ~15 min on 2 cores
    PYTHONPATH=$PWD python benchmarks/shadow_cost.py --kinds fsdp2 --sizes '2.3 M' --reps 1
    COMPOSER_JOIN_DEVICE=gpu PYTHONPATH=$PWD python benchmarks/shadow_cost.py             # 2 GPUs

``--profile`` prints the shadow steps under cProfile instead; ``--split`` the former table: ``run.py``'s 2-rank
uneven fits (conv net), per-step main-thread CPU split by ``is_shadow_step`` (``uneven.shadow_split``), shadow over real.
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
KINDS = ('ddp', 'fsdp1', 'fsdp2')


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
        (
            f'{kind} {name}',
            'shadow_workloads:composer_profile',
            {'hidden': h, 'long': long, 'short': short, 'kind': kind},
        )
        for kind in args.kinds
        for name, (h, long, short) in SIZES.items()
        if name in args.sizes
    ]
    res = launch(2, calls, timeout=900, progress=False)
    for name, _, _ in calls:
        print(f'== {name}: {res[name][1]["steps"]} shadow steps')
        print(res[name][1]['text'])


def _parts(kind: str) -> tuple[str, ...]:
    """What runs per size under ``kind``: the shadow fit, the floor, torch ``Join`` (DDP only: FSDP has none), and the
    recorded real step (FSDP's floor; Composer's own per-step collectives under every wrapper)."""
    return ('composer_shadow', 'torch_join', 'floor', 'recorded_floor', 'stock_small') if kind == 'ddp' else PARTS_FSDP


PARTS_FSDP = ('composer_shadow', 'recorded_floor', 'stock_small')


def side_by_side(args: argparse.Namespace) -> None:
    calls = [('warm-up', 'shadow_workloads:composer_shadow', {'hidden': 256, 'long': 8, 'short': 3})]
    sizes = {name: SIZES[name] for name in args.sizes}
    for rep in range(args.reps):
        for kind in args.kinds:
            for name, (hidden, long, short) in sizes.items():
                kwargs = {'hidden': hidden, 'long': long, 'short': short}
                if kind != 'ddp':
                    kwargs['kind'] = kind
                parts = _parts(kind)
                for part in parts if rep % 2 == 0 else parts[::-1]:
                    extra = {'kind': kind} if part in ('recorded_floor', 'stock_small') else {}
                    calls.append((f'{kind}|{name}|{part}|{rep}', f'shadow_workloads:{part}', {**kwargs, **extra}))
    for kind in args.kinds:
        for name, (hidden, long, short) in sizes.items():
            kwargs = {'hidden': hidden, 'long': long, 'short': short, **({'kind': kind} if kind != 'ddp' else {})}
            calls.append((f'{kind}|{name}|memory', 'shadow_workloads:composer_memory', kwargs))
    print(f'load average before: {load_average()}', flush=True)
    res = launch(2, calls, timeout=3600, progress=args.progress)
    print(f'load average after: {load_average()}; composer_join from {res["warm-up"][1]["composer_join"]}')
    key = args.key or ('device' if 'device' in res['warm-up'][0] else 'cpu')
    print(f'times: {key}')
    print(
        '| wrapper | parameters | shadow step ms | floor ms | **shadow / floor** | zero fill ms | '
        "Composer's collectives ms | stock step, 2 samples ms | torch Join, joined iteration ms | real step ms | "
        'allocated: shadow step (first; later); real step | peak above the step start: shadow step; real step |'
    )
    print('|---|---|---|---|---|---|---|---|---|---|---|---|')
    for kind in args.kinds:
        for name in sizes:
            got: dict[str, list[float]] = {
                k: [] for k in ('shadow', 'floor', 'zero', 'composer', 'small', 'joined', 'real')
            }
            for rep in range(args.reps):
                fit = res[f'{kind}|{name}|composer_shadow|{rep}']
                flags = fit[1]['shadow']
                shadow_steps = [i for i, f in enumerate(flags) if f][2:]
                got['shadow'] += [fit[1][key][i] for i in shadow_steps]
                got['real'] += fit[0][key][3:]
                recorded = res[f'{kind}|{name}|recorded_floor|{rep}'][1]
                got['composer'] += recorded['composer'][key]
                got['small'] += res[f'{kind}|{name}|stock_small|{rep}'][1][key][3:]
                if kind == 'ddp':
                    got['floor'] += res[f'{kind}|{name}|floor|{rep}'][1][key]
                    got['zero'] += res[f'{kind}|{name}|floor|{rep}'][1]['zero'][key]
                    got['joined'].append(res[f'{kind}|{name}|torch_join|{rep}'][1]['joined'][key])
                else:
                    got['floor'] += recorded['fsdp'][key]
            memory = res[f'{kind}|{name}|memory'][1]
            steps = sorted(memory['steps'].items())
            shadows = [v for _, v in steps if v['shadow']]
            real = next(v for _, v in steps if not v['shadow'])
            m = {k: median(v) for k, v in got.items()}
            print(
                f'| {kind} | {name} | {1000 * m["shadow"]:.2f} | {1000 * m["floor"]:.2f} | '
                f'**{m["shadow"] / m["floor"]:.2f}** | {_ms(m["zero"])} | {1000 * m["composer"]:.2f} | '
                f'{1000 * m["small"]:.2f} | {_ms(m["joined"])} | {1000 * m["real"]:.1f} | '
                f'{_mb(shadows[0]["allocated"])}; {_mb(shadows[-1]["allocated"])}; {_mb(real["allocated"])} | '
                f'{_mb(shadows[-1]["peak"])}; {_mb(real["peak"])} |'
            )
    if args.raw:
        print(res)


def _ms(seconds: float) -> str:
    return '-' if seconds != seconds else f'{1000 * seconds:.2f}'  # NaN: not measured under this wrapper


def _mb(n: int) -> str:
    return f'{n / 1e6:.2f} MB' if n >= 1e5 else f'{n / 1e3:.1f} kB'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--split', action='store_true', help="the former table: run.py's uneven fits, shadow / real")
    parser.add_argument('--world', type=int, default=2, choices=[s.world for s in run.FULL], help='(--split only)')
    parser.add_argument('--reps', type=int, default=2)
    parser.add_argument('--kinds', nargs='+', default=list(KINDS), choices=KINDS, help='the wrappers measured')
    parser.add_argument('--sizes', nargs='+', default=list(SIZES), choices=list(SIZES), help='the model sizes')
    parser.add_argument(
        '--key',
        choices=('cpu', 'thread', 'wall', 'device'),
        help="the time to tabulate: the process's CPU (default on the CPU), the main thread's, wall, or the GPU's "
        '(default on GPUs, COMPOSER_JOIN_DEVICE=gpu)',
    )
    parser.add_argument('--progress', action='store_true')
    parser.add_argument('--profile', action='store_true', help='the shadow steps under cProfile instead')
    parser.add_argument('--raw', action='store_true', help='print every result too')
    args = parser.parse_args()
    split(args) if args.split else profile(args) if args.profile else side_by_side(args)


if __name__ == '__main__':
    main()
