"""Overhead on even inputs: UnevenJoin's step time against stock Composer's (section 1 of results.md).

Fits on equal shards in rounds, one fit per mode, order rotating from round to round: stock
Composer; UnevenJoin with its agreement all-reduces faked (a local copy of this rank's row, which
is what the sum gives on even shards: an ablation, everything of UnevenJoin but that collective);
and UnevenJoin. Reported: median step time on rank 0 over all rounds, the ratios to stock (goal for
UnevenJoin: <= 1.01), the median and range of per-round ratios, and CPU time per step of the main
thread and of the whole process. Part of ``run.py``'s launch (:func:`calls`, :func:`analyse`,
:func:`markdown`, :func:`chart`).
"""

from __future__ import annotations

from typing import Any

from common import BATCH, Setup, mark, median, ms, timed

FAKED = 'UnevenJoin, agreement faked'  # UnevenJoin with its agreement computed locally (ablation, even shards)
MODES = ('stock', FAKED, 'UnevenJoin')  # the overhead rounds
MODE_ARGS = {'stock': {'join': False}, FAKED: {'join': True, 'fake_agreement': True}, 'UnevenJoin': {'join': True}}
GOAL = 1.01


def calls(s: Setup) -> list[tuple[str, str, dict]]:
    """The rounds: ``overhead|<mode>|<round>``, modes in rotating order."""
    even = [s.batches * BATCH] * s.world
    n = len(MODES)
    return [
        (f'overhead|{mode}|{r}', 'composer_fit', {'sizes': even, 'evaluate': False, **MODE_ARGS[mode]})
        for r in range(s.rounds)
        for mode in MODES[r % n :] + MODES[: r % n]
    ]


def analyse(res: dict, s: Setup) -> dict[str, Any]:
    """Per mode: median step time and CPU per step on rank 0 (all rounds pooled); ratios to stock."""
    out: dict[str, Any] = {'world': s.world, 'rounds': s.rounds}
    for mode in MODES:
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
    for mode in (m for m in MODES[1:] if m in out):
        rounds = [a / b for a, b in zip(out[mode]['per_round'], out['stock']['per_round'])]
        out[mode].update(
            ratio=out[mode]['wall'] / out['stock']['wall'],
            round_median=median(rounds),
            round_min=min(rounds),
            round_max=max(rounds),
        )
    return out


def markdown(overheads: list[dict]) -> list[str]:
    """Section 1's heading and tables (lines): step times and ratios, then CPU per step."""
    L = ['## 1. Overhead on even inputs\n']
    add = L.append
    add(
        f'Fits on equal shards in rounds, one fit of each mode per round, order rotating: **stock** Composer; '
        f"**{FAKED}**: UnevenJoin with its agreement all-reduces (on even shards only the last step's) replaced "
        f"by a local copy of this rank's row (exact on even shards, where every rank's row is the same): all of "
        f'UnevenJoin except that collective; '
        f'**UnevenJoin**. Median step time on rank 0 over all rounds; ratio to stock; median and range of the '
        f'per-round ratios. Goal: UnevenJoin / stock <= {GOAL}.\n'
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
            f'{mark(j["ratio"] <= GOAL)} | {faked[1]} |'
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
    return L


def chart(ax, overheads: list[dict]) -> None:
    """One panel: the faked-agreement and UnevenJoin step-time ratios to stock, by world size."""
    shown = ((FAKED, '#9fd8b4'), ('UnevenJoin', '#2e9e5b'))
    width = 0.8 / len(shown)
    values = []
    for i, (mode, color) in enumerate(shown):
        xs = [x for x, o in enumerate(overheads) if mode in o]
        ys = [o[mode]['ratio'] for o in overheads if mode in o]
        values += ys
        ax.bar([x + (i - (len(shown) - 1) / 2) * width for x in xs], ys, width, color=color, label=mode)
    ax.axhline(1.0, color='black', lw=0.8)
    ax.axhline(GOAL, color='red', ls='--', label=f'goal {GOAL}')
    ax.set_xticks(range(len(overheads)), [f'{o["world"]} ranks' for o in overheads])
    ax.set_ylim(min(0.95, min(values) - 0.02), max(1.05, max(values) + 0.02))
    ax.set(title='Even inputs: median step time / stock', ylabel='ratio')
    ax.legend(fontsize=8)
