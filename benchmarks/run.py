"""Benchmarks for UnevenJoin: overhead, data kept and time, against stock Composer and torch's ``DDP.join``.

Run from the repository root::

    .venv/bin/python benchmarks/run.py            # full run (= make bench), ~4.5 min on 2 CPU cores;
                                                  # writes benchmarks/results.md and benchmarks/results.png
    .venv/bin/python benchmarks/run.py --quick    # smoke run (< 1 min), into a temporary directory

Options: ``--out DIR`` (where results.md / results.png go), ``--wait-quiet SECONDS`` (first wait,
at most that long, for the 1-minute load average to drop below 0.7), ``--profile`` (also profile a
stock and an UnevenJoin fit with cProfile at 2 ranks; writes ``profile.txt`` beside the results).

What is measured, and how
-------------------------
Ranks are real processes (one per rank, gloo on CPU, one thread each, see ``ranks.py``); all runs
of one world size share one process group, after a throw-away warm-up fit of each kind. The
workload (``workloads.py``): a small conv net, 32 samples per rank per step, one epoch, SGD with
momentum. Step time = ``time.perf_counter`` delta between consecutive ``BATCH_END`` events; the
first ``WARMUP_STEPS`` steps of every fit are not timed.

1. **Overhead on even inputs.** Fits on equal shards in rounds, one fit per mode, order rotating
   from round to round: stock Composer; UnevenJoin with its agreement all-reduces faked
   (a local copy of this rank's row, which is what the sum gives on even shards: an ablation,
   everything of UnevenJoin but that collective); and UnevenJoin. Reported: median step time on
   rank 0 over all rounds, the ratios to stock (goal for UnevenJoin: <= 1.01), the median and
   range of per-round ratios, and CPU time per step of the main thread and of the whole process.
   At 2 ranks also: collectives per step for each DDP sync strategy, stock and UnevenJoin
   (counted as in ``tests/rank_scenarios.py``).
2. **Uneven inputs.** Shard ratios 1:1, 2:1, 4:1 (rank 0 has the longest shard, every other rank
   1/r of it) and "one empty" (the last rank has nothing). Methods: stock Composer (ends every
   epoch at the shortest rank); padded, like Accelerate's ``even_batches`` (short ranks cycle
   their own samples up to the longest shard, an empty rank borrows rank 0's; plain Composer);
   a plain PyTorch loop under ``DDP.join``; UnevenJoin. The *limit* is stock Composer on shards
   all as long as the longest (the same steps, all real): no method that keeps every rank on its
   own data can take fewer steps. Wall time = ``Trainer.fit`` (or the torch loop), max over ranks,
   median over repetitions; the limit is the median of all its fits at that world size (at 1:1,
   stock and padded *are* the limit's configuration, so its fits stand for them). Goal: UnevenJoin
   wall / limit <= 1.05. Held-out loss: the final model's cross-entropy on 1024 held-out samples.
   Shadow-step cost: UnevenJoin's per-step times split by ``composer_join.is_shadow_step``.
3. **Scaling.** Overhead and the 4:1 and one-empty cases at 3 and 4 ranks too (more ranks than
   cores: ranks share cores, so collectives wait for the scheduler).

4. **Rebalancing** (``rebalance.py``, section 3 of results.md and ``rebalance.png``): epoch wall time
   of ``UnevenJoin(mode='rebalance')`` and of shadowing over the balanced ideal, and bytes moved.

Where the time goes: at every world size, one UnevenJoin fit with its events and agreement timed
(``workloads.event_costs``) and the bare cost of one agreement all-reduce
(``workloads.collective_latency``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rebalance  # noqa: E402  (section 3: UnevenJoin(mode='rebalance'); light too)
from ranks import launch  # noqa: E402  (light: no torch import in this process)

ENGINE = 'Composer engine: _run_algorithms (incl. match + apply)'  # = workloads.ENGINE
BATCH = 32  # samples per rank per step (= workloads.BATCH; not imported, to keep torch out of this process)
WARMUP_STEPS = 3  # per fit, not timed
CASES = ('1:1', '2:1', '4:1', 'one empty')
METHODS = ('limit', 'stock', 'padded', 'torch join', 'UnevenJoin')
NO_DIVIDE = 'UnevenJoin, divide_by_initial_world_size=False'  # loss only: one fit per uneven case at 2 ranks
FAKED = 'UnevenJoin, agreement faked'  # UnevenJoin with its agreement computed locally (ablation, even shards)
MODES = ('stock', FAKED, 'UnevenJoin')  # the overhead rounds
MODE_ARGS = {'stock': {'join': False}, FAKED: {'join': True, 'fake_agreement': True}, 'UnevenJoin': {'join': True}}
SYNCS = ('single_auto_sync', 'multi_auto_sync', 'forced_sync')
DISTURBED = 0.15  # cores taken by other processes during a launch above which results.md warns
COUNT_MICROBATCH = 16  # 2 microbatches per real step in the collective counts, so multi_auto_sync differs


@dataclass(frozen=True)
class Setup:
    """What runs at one world size."""

    world: int
    batches: int  # the longest shard, in batches of BATCH samples
    rounds: int  # overhead rounds (one fit of each mode per round)
    reps: int  # repetitions of every (case, method)
    cases: tuple[str, ...]
    counts: bool = False  # collective counts per sync strategy, and UnevenJoin's loss with divide=False
    modes: tuple[str, ...] = MODES
    timeout: float = 300  # hard limit for the whole launch, seconds


FULL = (
    Setup(2, batches=32, rounds=6, reps=4, cases=CASES, counts=True, timeout=300),
    Setup(3, batches=14, rounds=4, reps=2, cases=('4:1', 'one empty'), timeout=200),
    Setup(4, batches=10, rounds=4, reps=2, cases=('4:1', 'one empty'), timeout=200),
)
QUICK = (Setup(2, batches=6, rounds=1, reps=1, cases=('4:1', 'one empty'), counts=True, timeout=120),)


def case_sizes(case: str, world: int, longest: int) -> list[int]:
    """Per-rank shard sizes (samples) of a case; rank 0 has ``longest``."""
    if case == 'one empty':
        return [longest] * (world - 1) + [0]
    ratio = int(case.split(':')[0])
    return [longest] + [longest // ratio] * (world - 1)


def method_call(method: str, sizes: list[int]) -> tuple[str, dict]:
    """(workload function, kwargs) of one method on shards ``sizes``."""
    if method == 'limit':
        return 'composer_fit', {'sizes': [max(sizes)] * len(sizes), 'join': False}
    if method == 'torch join':
        return 'torch_join_fit', {'sizes': sizes}
    if method == NO_DIVIDE:
        return 'composer_fit', {'sizes': sizes, 'join': True, 'divide': False}
    return 'composer_fit', {'sizes': sizes, 'join': method == 'UnevenJoin', 'pad': method == 'padded'}


def runs_of(case: str) -> tuple[str, ...]:
    """Methods that need their own fits in a case (at 1:1, stock and padded are the limit's configuration)."""
    return ('limit', 'torch join', 'UnevenJoin') if case == '1:1' else METHODS


def calls(s: Setup, profile: bool) -> list[tuple[str, str, dict]]:
    """Every run of one launch, in order; names are ``part|...`` keys read back by the ``analyse_*`` functions."""
    longest = s.batches * BATCH
    even = [longest] * s.world
    out = [('warm-up', 'warm_up', {'sizes': [4 * BATCH] * s.world})]
    n = len(s.modes)
    for r in range(s.rounds):
        for mode in s.modes[r % n :] + s.modes[: r % n]:
            out.append((f'overhead|{mode}|{r}', 'composer_fit', {'sizes': even, 'evaluate': False, **MODE_ARGS[mode]}))
    for rep in range(s.reps):
        for case in s.cases:
            methods = runs_of(case)
            for method in methods if rep % 2 == 0 else methods[::-1]:
                out.append((f'uneven|{case}|{method}|{rep}', *method_call(method, case_sizes(case, s.world, longest))))
    if s.counts:  # (2 ranks) also the loss of UnevenJoin's other gradient scaling
        for case in s.cases:
            if case != '1:1':
                out.append(
                    (f'uneven|{case}|{NO_DIVIDE}|0', *method_call(NO_DIVIDE, case_sizes(case, s.world, longest)))
                )
        for sync in SYNCS:
            # stock: 3 real steps everywhere; UnevenJoin: the last rank runs out after 4 of 6 steps (steps 0-2
            # are planned from the lengths, 3 is its last batch, 4 and 5 are shadow steps for it).
            common = {'sync': sync, 'microbatch': COUNT_MICROBATCH}
            out.append(
                (f'count|{sync}|stock', 'count_collectives', {'sizes': [3 * BATCH] * s.world, 'join': False, **common})
            )
            out.append(
                (
                    f'count|{sync}|UnevenJoin',
                    'count_collectives',
                    {'sizes': [6 * BATCH] * (s.world - 1) + [4 * BATCH], 'join': True, **common},
                )
            )
    out.append(('events', 'event_costs', {'sizes': even}))
    out.append(('events|stock', 'event_costs', {'sizes': even, 'join': False}))
    out.append(('latency', 'collective_latency', {}))
    if profile and s.world == 2:
        out.append(('profile|stock', 'profile_fit', {'sizes': even, 'join': False}))
        out.append(('profile|UnevenJoin', 'profile_fit', {'sizes': even, 'join': True}))
    return out


# -- analysis -------------------------------------------------------------------------------------


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float('nan')


def timed(result: dict, key: str = 'step_wall') -> list[float]:
    """A fit's per-step values, without the warm-up steps."""
    return result[key][WARMUP_STEPS:]


def analyse_overhead(res: dict, s: Setup) -> dict[str, Any]:
    """Per mode: median step time and CPU per step on rank 0 (all rounds pooled); ratios to stock."""
    out: dict[str, Any] = {'world': s.world, 'rounds': s.rounds}
    for mode in s.modes:
        fits = [res[f'overhead|{mode}|{r}'][0] for r in range(s.rounds)]
        if mode == FAKED and not all(f['faked_agreements'] for f in fits):  # UnevenJoin changed: nothing faked
            continue
        out[mode] = {
            'wall': median(v for f in fits for v in timed(f)),
            'cpu': median(v for f in fits for v in timed(f, 'step_cpu')),
            'process_cpu': median(v for f in fits for v in timed(f, 'step_process_cpu')),
            'per_round': [median(timed(f)) for f in fits],
            'steps': sum(len(timed(f)) for f in fits),
        }
    for mode in (m for m in s.modes[1:] if m in out):
        rounds = [a / b for a, b in zip(out[mode]['per_round'], out['stock']['per_round'])]
        out[mode].update(
            ratio=out[mode]['wall'] / out['stock']['wall'],
            round_median=median(rounds),
            round_min=min(rounds),
            round_max=max(rounds),
        )
    return out


def _fits(res: dict, case: str, method: str, reps: int) -> list[list[dict]]:
    run = 'limit' if case == '1:1' and method in ('stock', 'padded') else method
    return [res[f'uneven|{case}|{run}|{rep}'] for rep in range(reps)]


def analyse_uneven(res: dict, s: Setup) -> list[dict[str, Any]]:
    """One row per (case, method): steps, samples trained / dropped / repeated, wall time, loss, shadow cost."""
    longest = s.batches * BATCH
    limit_walls = [max(r['wall'] for r in fit) for case in s.cases for fit in _fits(res, case, 'limit', s.reps)]
    limit = median(limit_walls)
    rows = []
    for case in s.cases:
        sizes = case_sizes(case, s.world, longest)
        total = sum(sizes)
        for method in METHODS:
            fits = _fits(res, case, method, s.reps)
            last = fits[-1]
            if method == 'torch join':
                trained, steps = sum(r['samples'] for r in last), max(r['steps'] for r in last)
            else:
                trained, steps = last[0]['samples'], last[0]['steps']
            walls = [max(r['wall'] for r in fit) for fit in fits]
            row = {
                'world': s.world,
                'case': case,
                'sizes': sizes,
                'method': method,
                'steps': steps,
                'trained': trained,
                'total': total,
                'distinct': min(trained, total),
                'dropped': max(total - trained, 0),
                'repeated': max(trained - total, 0),
                'wall': median(walls) if method != 'limit' else limit,
                'limit_fits': len(limit_walls),
                'loss': last[0]['loss'],
            }
            row['vs_limit'] = row['wall'] / limit
            row['vs_limit_range'] = (min(walls) / limit, max(walls) / limit)
            if method == 'UnevenJoin':
                split: dict[bool, dict[str, list]] = {
                    flag: {'cpu': [], 'wall': [], 'process_cpu': []} for flag in (True, False)
                }
                for fit in fits:
                    for r in fit:
                        for i in range(WARMUP_STEPS, len(r['shadow'])):
                            for key, series in (
                                ('cpu', 'step_cpu'),
                                ('wall', 'step_wall'),
                                ('process_cpu', 'step_process_cpu'),
                            ):
                                split[r['shadow'][i]][key].append(r[series][i])
                row['shadow_steps'] = len(split[True]['cpu'])
                for key in ('cpu', 'wall', 'process_cpu'):
                    row[f'shadow_{key}'], row[f'real_{key}'] = median(split[True][key]), median(split[False][key])
            rows.append(row)
            if method == 'UnevenJoin' and f'uneven|{case}|{NO_DIVIDE}|0' in res:
                fit = res[f'uneven|{case}|{NO_DIVIDE}|0']
                rows.append(
                    dict(
                        row,
                        method=NO_DIVIDE,
                        trained=fit[0]['samples'],
                        loss=fit[0]['loss'],
                        shadow_steps=0,
                        wall=max(r['wall'] for r in fit),
                        vs_limit=max(r['wall'] for r in fit) / limit,
                    )
                )
    return rows


def analyse_counts(res: dict) -> list[dict[str, Any]]:
    """Collectives of one step, by kind, for: stock (step 1); UnevenJoin on a step before any rank's
    last batch (step 1, planned from the lengths); UnevenJoin at the last rank's last batch (the step
    before its first shadow step); UnevenJoin with the last rank shadowing (its first shadow step).
    Step 0 is skipped (DDP's first step rebuilds its buckets). ``agree``: every rank counted the same."""
    rows = []
    for sync in SYNCS:
        stock, join = res[f'count|{sync}|stock'], res[f'count|{sync}|UnevenJoin']
        shadow_step = join[-1]['shadow'].index(True)
        for label, per_rank, step in (
            ('stock', stock, 1),
            ('real', join, 1),
            ('last', join, shadow_step - 1),
            ('shadow', join, shadow_step),
        ):
            counts = [r['steps'][step] for r in per_rank]
            rows.append(
                {'sync': sync, 'label': label, 'counts': counts[0], 'agree': all(c == counts[0] for c in counts)}
            )
    return rows


# -- output ---------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f'{1000 * seconds:.1f}'


def us(seconds: float) -> str:
    return f'{1e6 * seconds:.0f}'


def mark(ok: bool) -> str:
    return 'yes' if ok else '**no**'


def fmt_counts(c: dict[str, int]) -> str:
    names = {
        'all_reduce': 'all_reduce',
        'ddp_grad_bucket': 'DDP grad bucket',
        '_broadcast_coalesced': 'buffer broadcast',
    }
    return f'**{sum(c.values())}**: ' + ', '.join(f'{names.get(k, k)} {v}' for k, v in sorted(c.items()))


def markdown(info: dict, overheads: list, uneven: list, counts: list, events: dict) -> str:
    """results.md: the tables, with what was measured and how."""
    L: list[str] = []
    add = L.append
    add('# UnevenJoin benchmarks\n')
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

    add('## 1. Overhead on even inputs\n')
    add(
        f'Fits on equal shards in rounds, one fit of each mode per round, order rotating: **stock** Composer; '
        f"**{FAKED}**: UnevenJoin with its agreement all-reduces (on even shards only the last step's) replaced "
        f"by a local copy of this rank's row (exact on even shards, where every rank's row is the same): all of "
        f'UnevenJoin except that collective; '
        f'**UnevenJoin**. Median step time on rank 0 over all rounds; ratio to stock; median and range of the '
        f'per-round ratios. Goal: UnevenJoin / stock <= 1.01.\n'
    )
    add(
        f'| ranks | steps timed (each) | stock ms/step | {FAKED} | UnevenJoin | **UnevenJoin / stock** | '
        f'per round: median (range) | goal met | {FAKED} / stock |'
    )
    add('|---|---|---|---|---|---|---|---|---|')
    for o in overheads:
        j = o['UnevenJoin']
        faked = (ms(o[FAKED]['wall']), f'{o[FAKED]["ratio"]:.3f}') if FAKED in o else ('not run', 'not run')
        add(
            f'| {o["world"]} | {o["stock"]["steps"]} | {ms(o["stock"]["wall"])} | {faked[0]} | {ms(j["wall"])} | '
            f'**{j["ratio"]:.3f}** | {j["round_median"]:.3f} ({j["round_min"]:.3f}-{j["round_max"]:.3f}) | '
            f'{mark(j["ratio"] <= 1.01)} | {faked[1]} |'
        )
    add('')
    add(
        'CPU time per step (median, rank 0): main thread (`thread_time`) / whole process (`process_time`, which '
        "includes gloo's and DDP's threads), ms.\n"
    )
    add('| ranks | ' + ' | '.join(MODES) + ' |')
    add('|---|' + '---|' * len(MODES))
    for o in overheads:
        add(
            f'| {o["world"]} | '
            + ' | '.join(f'{ms(o[m]["cpu"])} / {ms(o[m]["process_cpu"])}' if m in o else 'not run' for m in MODES)
            + ' |'
        )
    add('')
    if counts:
        add(
            f'Collectives per step at 2 ranks, microbatch size {COUNT_MICROBATCH} (a real step is 2 microbatches, a '
            "shadow step 1). `all_reduce`: Python-level `torch.distributed.all_reduce` calls (Composer's and "
            "UnevenJoin's); DDP grad bucket: DDP's gradient all-reduces (2 buckets per sync for this model); buffer "
            "broadcast: DDP's BatchNorm-buffer broadcast; broadcast: Composer's. A step's window runs from the "
            "previous `BATCH_END` to its own, so it also holds the next step's agreement, which starts a step ahead; "
            "the first agreed step (the last rank's last batch) starts its own. UnevenJoin's fit: 6 steps, the "
            'last rank has 4 batches, so 3 steps are agreed in all.\n'
        )
        add(
            "| sync strategy | stock | UnevenJoin, before any rank's last batch | UnevenJoin, last rank's last batch "
            '| UnevenJoin, last rank shadowing | same on all ranks |'
        )
        add('|---|---|---|---|---|---|')
        for sync in SYNCS:
            rows = {r['label']: r for r in counts if r['sync'] == sync}
            add(
                f'| {sync} | '
                + ' | '.join(fmt_counts(rows[k]['counts']) for k in ('stock', 'real', 'last', 'shadow'))
                + f' | {mark(all(r["agree"] for r in rows.values()))} |'
            )
        add('')

    add('## 2. Uneven inputs\n')
    add(
        'Rank 0 has the longest shard; "r:1": every other rank has 1/r of it; "one empty": the last rank has none. '
        '*limit*: stock Composer with every shard as long as the longest (same steps, all real), the least time '
        'for any method that keeps each rank on its own data; its wall time is the median of all its fits at that '
        'world size. Wall time: `fit` (or the torch loop), max over ranks, median over repetitions. At 1:1, stock '
        "and padded are the limit's configuration (same fits). Goal: UnevenJoin wall / limit <= 1.05.\n"
    )
    for world in sorted({r['world'] for r in uneven}):
        add(f'### {world} ranks\n')
        add(
            '| case (samples per rank) | method | steps | own samples trained | dropped | repeated | wall s | '
            'wall / limit | held-out loss |'
        )
        add('|---|---|---|---|---|---|---|---|---|')
        for r in (r for r in uneven if r['world'] == world):
            sizes = '/'.join(str(v) for v in r['sizes'])
            if r['method'] == 'limit':
                add(
                    f'| {r["case"]} ({sizes}) | limit | {r["steps"]} | ({r["trained"]}, longer shards) | | | '
                    f'{r["wall"]:.2f} | 1 | |'
                )
                continue
            if r['method'] == NO_DIVIDE:
                add(
                    f'| {r["case"]} ({sizes}) | {r["method"]} (one fit, for the loss) | {r["steps"]} | {r["distinct"]} of '
                    f'{r["total"]} | {r["dropped"]} | {r["repeated"]} | ({r["wall"]:.2f}) | ({r["vs_limit"]:.3f}) | {r["loss"]:.3f} |'
                )
                continue
            name = f'**{r["method"]}**' if r['method'] == 'UnevenJoin' else r['method']
            add(
                f'| {r["case"]} ({sizes}) | {name} | {r["steps"]} | {r["distinct"]} of {r["total"]} | {r["dropped"]} | '
                f'{r["repeated"]} | {r["wall"]:.2f} | {r["vs_limit"]:.3f} | {r["loss"]:.3f} |'
            )
        add('')
    add(
        "UnevenJoin against the limit, and what a shadow step costs (UnevenJoin's per-step times split by "
        "`is_shadow_step`, all ranks and repetitions pooled, medians). CPU = the rank's main thread "
        '(`thread_time`; leaves out time blocked waiting for other ranks); process = all its threads; wall = '
        '`BATCH_END` to `BATCH_END`, which on a shadow rank includes waiting for the ranks with data.\n'
    )
    add(
        '| ranks | case | **UnevenJoin wall / limit** | range over reps | goal met | shadow steps timed | '
        'real step CPU / process ms | shadow step CPU / process ms | shadow / real, CPU | shadow / real, wall |'
    )
    add('|---|---|---|---|---|---|---|---|---|---|')
    for r in (r for r in uneven if r['method'] == 'UnevenJoin'):  # (not NO_DIVIDE)
        lo, hi = r['vs_limit_range']
        shadow = r['shadow_steps'] > 0
        add(
            f'| {r["world"]} | {r["case"]} | **{r["vs_limit"]:.3f}** | {lo:.3f}-{hi:.3f} | {mark(r["vs_limit"] <= 1.05)} | '
            f'{r["shadow_steps"]} | {ms(r["real_cpu"])} / {ms(r["real_process_cpu"])} | '
            + (
                f'{ms(r["shadow_cpu"])} / {ms(r["shadow_process_cpu"])} | {r["shadow_cpu"] / r["real_cpu"]:.2f} | '
                f'{r["shadow_wall"] / r["real_wall"]:.2f} |'
                if shadow
                else '- | - | - |'
            )
        )
    add('')

    add("## Where UnevenJoin's time goes\n")
    add(
        'Per step (median over steps), rank 0, even shards. Pieces timed in one UnevenJoin fit and one stock fit '
        "(`workloads.event_costs`: `perf_counter` around each `UnevenJoin.apply` / `match` call, around Composer's "
        "`Engine._run_algorithms`, around the JoinLoader's `next`, and around issuing and waiting for the "
        'agreement all-reduce, found by its tensor). Waiting for the agreement includes waiting for the slower '
        'rank. Then one agreement all-reduce on its own, back to back after a barrier. The last rows come from '
        'section 1.\n'
    )
    worlds = sorted(events)
    per = {w: events[w]['per_step'] for w in worlds}
    calls_us = {w: sum(v for k, v in per[w].items() if k.startswith(('apply', 'match'))) for w in worlds}
    add('| us per step | ' + ' | '.join(f'{w} ranks' for w in worlds) + ' |')
    add('|---|' + '---|' * len(worlds))

    def row(label, values):
        add(f'| {label} | ' + ' | '.join(values) + ' |')

    for key in sorted({k for w in worlds for k in per[w] if k.startswith(('JoinLoader', 'agreement'))}):
        row(key, [us(per[w].get(key, 0)) for w in worlds])
    for key in sorted(
        {k for w in worlds for k in per[w] if k.startswith(('apply', 'match'))}, key=lambda k: -per[worlds[0]].get(k, 0)
    ):
        if any(per[w].get(key, 0) > 0 for w in worlds):
            row(f'`{key}`', [us(per[w].get(key, 0)) for w in worlds])
    row('**all `apply` + `match` calls**', [us(calls_us[w]) for w in worlds])
    if all(ENGINE in per[w] for w in worlds):
        row(
            "**Composer's engine bookkeeping for them** (`_run_algorithms` minus `apply`/`match`, minus the same in "
            'a stock fit: per-event traces, `log_traces`, debug-log strings)',
            [us(per[w][ENGINE] - calls_us[w] - events[w]['stock_engine']) for w in worlds],
        )
    latency = {w: events[w]['latency'] for w in worlds}
    row('one agreement all-reduce alone: wall', [us(latency[w]['median']) for w in worlds])
    row(
        '... its CPU: whole process / calling thread',
        [f'{us(latency[w]["process_cpu"])} / {us(latency[w]["thread_cpu"])}' for w in worlds],
    )
    row(
        'CPU a rank burns while blocked in it waiting for a late rank (cores)',
        [f'{latency[w]["waiting_cpu_per_ms"]:.2f}' for w in worlds],
    )
    by_world = {o['world']: o for o in overheads}
    row(
        '**measured overhead: UnevenJoin - stock** (median step, section 1)',
        [us(by_world[w]['UnevenJoin']['wall'] - by_world[w]['stock']['wall']) for w in worlds],
    )
    row(
        f'... of which all but the collective: {FAKED} - stock',
        [
            us(by_world[w][FAKED]['wall'] - by_world[w]['stock']['wall']) if FAKED in by_world[w] else 'not run'
            for w in worlds
        ],
    )
    row(
        f'... of which the collective: UnevenJoin - {FAKED}',
        [
            us(by_world[w]['UnevenJoin']['wall'] - by_world[w][FAKED]['wall']) if FAKED in by_world[w] else 'not run'
            for w in worlds
        ],
    )
    add('')
    if info.get('profile'):
        add(
            f'cProfile of a stock and an UnevenJoin fit at 2 ranks, rank 0, and the functions whose own time grew '
            f'most: `{info["profile"].name}` (beside this file).\n'
        )
    return '\n'.join(L) + '\n'


def write_chart(path: Path, overheads: list, uneven: list) -> None:
    """Six panels: overhead ratios by world size; UnevenJoin wall / limit by world size and case; at 2 ranks,
    per case and method: wall / limit, own samples trained and repeated, held-out loss; shadow-step cost."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    methods = ('stock', 'padded', 'torch join', 'UnevenJoin')
    colors = {'stock': '#999999', 'padded': '#e3a33b', 'torch join': '#5a8fd6', 'UnevenJoin': '#2e9e5b'}
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))

    ax = axes[0][0]
    shown = ((FAKED, '#9fd8b4'), ('UnevenJoin', colors['UnevenJoin']))
    width = 0.8 / len(shown)
    values = []
    for i, (mode, color) in enumerate(shown):
        xs = [x for x, o in enumerate(overheads) if mode in o]
        ys = [o[mode]['ratio'] for o in overheads if mode in o]
        values += ys
        ax.bar([x + (i - (len(shown) - 1) / 2) * width for x in xs], ys, width, color=color, label=mode)
    ax.axhline(1.0, color='black', lw=0.8)
    ax.axhline(1.01, color='red', ls='--', label='goal 1.01')
    ax.set_xticks(range(len(overheads)), [f'{o["world"]} ranks' for o in overheads])
    ax.set_ylim(min(0.95, min(values) - 0.02), max(1.05, max(values) + 0.02))
    ax.set(title='Even inputs: median step time / stock', ylabel='ratio')
    ax.legend(fontsize=8)

    ax = axes[0][1]
    join_rows = [r for r in uneven if r['method'] == 'UnevenJoin']
    cases = [c for c in CASES if any(r['case'] == c for r in join_rows)]
    worlds = sorted({r['world'] for r in join_rows})
    width = 0.8 / len(worlds)
    for i, world in enumerate(worlds):
        rows = [r for r in join_rows if r['world'] == world]
        ax.bar(
            [cases.index(r['case']) + i * width for r in rows],
            [r['vs_limit'] for r in rows],
            width,
            label=f'{world} ranks',
        )
    ax.axhline(1.0, color='black', lw=0.8)
    ax.axhline(1.05, color='red', ls='--', label='goal 1.05')
    ax.set_xticks([c + (len(worlds) - 1) * width / 2 for c in range(len(cases))], cases)
    values = [r['vs_limit'] for r in join_rows]
    ax.set_ylim(min(0.8, min(values) - 0.05), max(1.15, max(values) + 0.05))
    ax.set(title='UnevenJoin wall time / limit', ylabel='ratio')
    ax.legend(fontsize=8)

    world = min(r['world'] for r in uneven)
    two = [r for r in uneven if r['world'] == world]
    cases2 = [c for c in CASES if any(r['case'] == c for r in two)]

    def grouped(ax, value, title, ylabel, shown=methods):
        width = 0.8 / len(shown)
        for i, m in enumerate(shown):
            rows = {r['case']: r for r in two if r['method'] == m}
            ax.bar(
                [c + i * width for c in range(len(cases2)) if cases2[c] in rows],
                [value(rows[c]) for c in cases2 if c in rows],
                width,
                label=m,
                color=colors[m],
            )
        ax.set_xticks([c + (len(shown) - 1) * width / 2 for c in range(len(cases2))], cases2)
        ax.set(title=title, ylabel=ylabel)

    grouped(axes[0][2], lambda r: r['vs_limit'], f'Wall time / limit ({world} ranks)', 'ratio')
    axes[0][2].axhline(1.0, color='black', lw=0.8)
    axes[0][2].set_ylim(0, 1.4 * max(r['vs_limit'] for r in two if r['method'] in methods))
    axes[0][2].legend(fontsize=8, ncol=2, loc='upper left')

    ax = axes[1][0]
    grouped(ax, lambda r: r['distinct'] / r['total'], f'Own samples trained ({world} ranks)', 'fraction of all samples')
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        rows = {r['case']: r for r in two if r['method'] == m}
        ax.bar(
            [c + i * width for c in range(len(cases2))],
            [rows[c]['repeated'] / rows[c]['total'] for c in cases2],
            width,
            bottom=[rows[c]['distinct'] / rows[c]['total'] for c in cases2],
            color='none',
            edgecolor=colors[m],
            hatch='//',
            label='repeated (padding)' if m == 'padded' else None,
        )
    ax.legend(fontsize=8)

    with_no_divide = methods + ((NO_DIVIDE,) if any(r['method'] == NO_DIVIDE for r in two) else ())
    colors[NO_DIVIDE] = '#9fd8b4'
    grouped(
        axes[1][1],
        lambda r: r['loss'],
        f'Held-out loss after one epoch ({world} ranks)',
        'cross-entropy',
        with_no_divide,
    )
    axes[1][1].set_ylim(0, 1.45 * max(r['loss'] for r in two))
    axes[1][1].legend(fontsize=7, ncol=2, loc='upper left')

    ax = axes[1][2]
    shadow_rows = [r for r in join_rows if r['shadow_steps'] > 0]
    xs = range(len(shadow_rows))
    ax.bar(
        [x - 0.2 for x in xs], [r['shadow_cpu'] / r['real_cpu'] for r in shadow_rows], 0.4, label='main-thread CPU time'
    )
    ax.bar([x + 0.2 for x in xs], [r['shadow_wall'] / r['real_wall'] for r in shadow_rows], 0.4, label='wall time')
    ax.set_xticks(list(xs), [f'{r["world"]} ranks\n{r["case"]}' for r in shadow_rows], fontsize=8)
    ax.set(title='UnevenJoin: shadow step / real step', ylabel='ratio')
    ax.set_ylim(0, 1.35)
    ax.legend(fontsize=8, ncol=2, loc='upper left')

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile_text(res: dict) -> str:
    """Both cProfile reports (rank 0), preceded by the functions whose own time grew most with UnevenJoin."""
    stock, join = res['profile|stock'][0], res['profile|UnevenJoin'][0]
    keys = set(stock['table']) | set(join['table'])

    def own(table, key):
        return table.get(key, (0, 0.0, 0.0))

    grown = sorted(keys, key=lambda k: own(stock['table'], k)[1] - own(join['table'], k)[1])[:30]
    lines = [
        'Functions whose own time (tottime) per step grew most, UnevenJoin fit minus stock fit, rank 0, both profiled:',
        f'{"us/step":>9} {"calls/step stock -> UnevenJoin":>32}  function',
    ]
    for k in grown:
        (n0, t0, _), (n1, t1, _) = own(stock['table'], k), own(join['table'], k)
        lines.append(
            f'{1e6 * (t1 / join["steps"] - t0 / stock["steps"]):9.0f} '
            f'{n0 / stock["steps"]:15.1f} -> {n1 / join["steps"]:<14.1f}  {k}'
        )
    return '\n'.join(lines) + '\n\n' + stock['text'] + '\n\n' + join['text']


# -- main -----------------------------------------------------------------------------------------


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


def wait_for_quiet(max_seconds: float, threshold: float = 0.7) -> None:
    deadline = time.monotonic() + max_seconds
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        print(f'waiting for a quiet machine: load average {os.getloadavg()[0]:.2f}', flush=True)
        time.sleep(15)


def main(argv: Optional[list[str]] = None) -> int:
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
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix='composer-join-bench-')) if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    setups = tuple(s for s in (QUICK if args.quick else FULL) if args.max_ranks is None or s.world <= args.max_ranks)
    if not setups:  # e.g. make bench-gpu on fewer GPUs than the smallest world size: say so in the results
        (out / 'results.md').write_text(
            f'# UnevenJoin benchmarks\n\nNot run: every world size ({", ".join(str(s.world) for s in (QUICK if args.quick else FULL))} '
            f'ranks) is above --max-ranks {args.max_ranks}.\n'
        )
        print(f'wrote {out / "results.md"}: nothing to run with --max-ranks {args.max_ranks}')
        return 0

    if args.wait_quiet:
        wait_for_quiet(args.wait_quiet)
    load_before = os.getloadavg()
    if load_before[0] > 1.0:
        print(f'warning: load average {load_before[0]:.2f}: other processes will disturb the timings', flush=True)
    start = time.perf_counter()
    overheads, uneven, counts, events, others, disturbed, raw = [], [], [], {}, [], [], {}
    profile = None
    for s in setups:
        usage: dict = {}
        planned = calls(s, args.profile)
        print(f'{s.world} ranks: {len(planned)} runs', flush=True)
        t0 = time.perf_counter()
        res = launch(
            s.world,
            planned,
            timeout=s.timeout,
            usage=usage,
            progress=lambda name: print(f'  {time.perf_counter() - t0:6.1f}s  {name}', flush=True),
        )
        foreign = (usage['machine_busy'] - usage['ranks_cpu']) / usage['elapsed']
        disturbed += [s.world] if foreign > DISTURBED else []
        others.append(
            f'{foreign:.2f} cores during the {s.world}-rank launch ({usage["elapsed"]:.0f} s; the ranks used '
            f'{usage["ranks_cpu"] / usage["elapsed"]:.2f})'
        )
        if args.save_raw:
            raw[s.world] = res
        overheads.append(analyse_overhead(res, s))
        uneven += analyse_uneven(res, s)
        if s.counts:
            counts = analyse_counts(res)
        events[s.world] = {
            'per_step': res['events'][0]['per_step'],
            'latency': res['latency'][0],
            'stock_engine': res['events|stock'][0]['per_step'].get(ENGINE, 0.0),
        }
        if 'profile|stock' in res:
            profile = out / 'profile.txt'
            profile.write_text(profile_text(res))
        print(f'  done in {usage["elapsed"]:.0f} s', flush=True)

    info = {
        'command': ' '.join(['.venv/bin/python benchmarks/run.py'] + (argv if argv is not None else sys.argv[1:])),
        'date': datetime.datetime.now().strftime('%Y-%m-%d %H:%M'),
        'seconds': time.perf_counter() - start,
        'machine': f'{os.cpu_count()} CPU cores ({platform.machine()}), torch {version("torch")}, '
        f'composer {version("mosaicml")}, Python {platform.python_version()}',
        'load_before': ', '.join(f'{v:.2f}' for v in load_before),
        'load_after': ', '.join(f'{v:.2f}' for v in os.getloadavg()),
        'others': '; '.join(others),
        'disturbed': disturbed,
        'setups': setups,
        'profile': profile,
        'code': code_version(),
    }
    if args.save_raw:
        args.save_raw.write_bytes(pickle.dumps(raw))
    text = markdown(info, overheads, uneven, counts, events)
    text += '\n' + rebalance.run(args.quick, out, info['command'], args.max_ranks)  # section 3, and rebalance.png
    (out / 'results.md').write_text(text)
    write_chart(out / 'results.png', overheads, uneven)
    print(text)
    print(
        f'wrote {out / "results.md"}, {out / "results.png"} and {out / "rebalance.png"} in '
        f'{time.perf_counter() - start:.0f} s'
    )
    return 0


if __name__ == '__main__':
    sys.exit(main())
