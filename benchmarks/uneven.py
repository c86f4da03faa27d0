"""Uneven inputs: steps, data kept, wall time and loss of UnevenJoin against the other ways (section 2 of results.md).

Shard ratios 1:1, 2:1, 4:1 (rank 0 has the longest shard, every other rank 1/r of it) and "one
empty" (the last rank has nothing). Methods: stock Composer (ends every epoch at the shortest
rank); padded, like Accelerate's ``even_batches`` (short ranks cycle their own samples up to the
longest shard, an empty rank borrows rank 0's; plain Composer); a plain PyTorch loop under
``DDP.join``; UnevenJoin. The *limit* is stock Composer on shards all as long as the longest (the
same steps, all real): no method that keeps every rank on its own data can take fewer steps. Wall
time = ``Trainer.fit`` (or the torch loop), max over ranks, median over repetitions; the limit is
the median of all its fits at that world size (at 1:1, stock and padded *are* the limit's
configuration, so its fits stand for them). Goal: UnevenJoin wall / limit <= 1.05. Held-out loss:
the final model's cross-entropy on 1024 held-out samples. Shadow-step cost: UnevenJoin's per-step
times split by ``composer_join.is_shadow_step`` (:func:`shadow_split`). Part of ``run.py``'s launch.
"""

from __future__ import annotations

from typing import Any

from common import BATCH, WARMUP_STEPS, Setup, case_sizes, mark, median, ms

CASES = ('1:1', '2:1', '4:1', 'one empty')
METHODS = ('limit', 'stock', 'padded', 'torch join', 'UnevenJoin')
NO_DIVIDE = 'UnevenJoin, divide_by_initial_world_size=False'  # loss only: one fit per uneven case at 2 ranks
GOAL = 1.05
SERIES = (('cpu', 'step_cpu'), ('wall', 'step_wall'), ('process_cpu', 'step_process_cpu'))  # shadow_split's keys
COLORS = {'stock': '#999999', 'padded': '#e3a33b', 'torch join': '#5a8fd6', 'UnevenJoin': '#2e9e5b'}


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


def calls(s: Setup) -> list[tuple[str, str, dict]]:
    """``uneven|<case>|<method>|<rep>``, methods in alternating order; with ``s.counts`` also one
    ``NO_DIVIDE`` fit per uneven case (for its loss)."""
    longest = s.batches * BATCH
    out = []
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
    return out


def _fits(res: dict, case: str, method: str, reps: int) -> list[list[dict]]:
    run = 'limit' if case == '1:1' and method in ('stock', 'padded') else method
    return [res[f'uneven|{case}|{run}|{rep}'] for rep in range(reps)]


def shadow_split(fits: list[list[dict]]) -> dict[bool, dict[str, list[float]]]:
    """UnevenJoin fits' per-step times (all ranks pooled, warm-up steps left out) by ``is_shadow_step``:
    ``{shadow: {'cpu' | 'wall' | 'process_cpu': [seconds, ...]}}``."""
    split: dict[bool, dict[str, list[float]]] = {flag: {key: [] for key, _ in SERIES} for flag in (True, False)}
    for fit in fits:
        for r in fit:
            for i in range(WARMUP_STEPS, len(r['shadow'])):
                for key, series in SERIES:
                    split[r['shadow'][i]][key].append(r[series][i])
    return split


def analyse(res: dict, s: Setup) -> list[dict[str, Any]]:
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
                split = shadow_split(fits)
                row['shadow_steps'] = len(split[True]['cpu'])
                for key, _ in SERIES:
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


def markdown(uneven: list[dict]) -> list[str]:
    """Section 2 (lines): a table per world size, then UnevenJoin against the limit and what a shadow step costs."""
    L = ['## 2. Uneven inputs\n']
    add = L.append
    add(
        'Rank 0 has the longest shard; "r:1": every other rank has 1/r of it; "one empty": the last rank has none. '
        '*limit*: stock Composer with every shard as long as the longest (same steps, all real), the least time '
        'for any method that keeps each rank on its own data; its wall time is the median of all its fits at that '
        'world size. Wall time: `fit` (or the torch loop), max over ranks, median over repetitions. At 1:1, stock '
        f"and padded are the limit's configuration (same fits). Goal: UnevenJoin wall / limit <= {GOAL}.\n"
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
            f'| {r["world"]} | {r["case"]} | **{r["vs_limit"]:.3f}** | {lo:.3f}-{hi:.3f} | {mark(r["vs_limit"] <= GOAL)} | '
            f'{r["shadow_steps"]} | {ms(r["real_cpu"])} / {ms(r["real_process_cpu"])} | '
            + (
                f'{ms(r["shadow_cpu"])} / {ms(r["shadow_process_cpu"])} | {r["shadow_cpu"] / r["real_cpu"]:.2f} | '
                f'{r["shadow_wall"] / r["real_wall"]:.2f} |'
                if shadow
                else '- | - | - |'
            )
        )
    add('')
    return L


def chart(axes: list, uneven: list[dict]) -> None:
    """Five panels: UnevenJoin wall / limit by world size and case; at the smallest world size, per case and
    method: wall / limit, own samples trained and repeated, held-out loss; shadow-step cost."""
    methods = ('stock', 'padded', 'torch join', 'UnevenJoin')
    colors = dict(COLORS)

    ax = axes[0]
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
    ax.axhline(GOAL, color='red', ls='--', label=f'goal {GOAL}')
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

    grouped(axes[1], lambda r: r['vs_limit'], f'Wall time / limit ({world} ranks)', 'ratio')
    axes[1].axhline(1.0, color='black', lw=0.8)
    axes[1].set_ylim(0, 1.4 * max(r['vs_limit'] for r in two if r['method'] in methods))
    axes[1].legend(fontsize=8, ncol=2, loc='upper left')

    ax = axes[2]
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
        axes[3],
        lambda r: r['loss'],
        f'Held-out loss after one epoch ({world} ranks)',
        'cross-entropy',
        with_no_divide,
    )
    axes[3].set_ylim(0, 1.45 * max(r['loss'] for r in two))
    axes[3].legend(fontsize=7, ncol=2, loc='upper left')

    ax = axes[4]
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
