"""Where UnevenJoin's time goes: its per-step pieces, timed, and the bare cost of one agreement all-reduce.

At every world size of ``run.py``'s launch, on even shards: one UnevenJoin fit and one stock fit
with their events timed (``workloads.event_costs``: ``perf_counter`` around each ``UnevenJoin.apply``
/ ``match`` call, around Composer's ``Engine._run_algorithms``, around the JoinLoader's ``next``, and
around issuing and waiting for the agreement all-reduce), and one agreement all-reduce on its own
(``workloads.collective_latency``). The table's last rows split section 1's measured overhead
(:mod:`overhead`) into the collective and the rest. ``even_steps.py`` runs the event-loop part alone, to compare
two code trees back to back.
"""

from __future__ import annotations

from typing import Any

from common import BATCH, Setup, us
from overhead import FAKED

ENGINE = 'Composer engine: _run_algorithms (incl. match + apply)'  # = workloads.ENGINE
MATCHED = 'events matched (count)'  # = workloads.MATCHED


def calls(s: Setup) -> list[tuple[str, str, dict]]:
    even = [s.batches * BATCH] * s.world
    return [
        ('events', 'event_costs', {'sizes': even}),
        ('events|stock', 'event_costs', {'sizes': even, 'join': False}),
        ('latency', 'collective_latency', {}),
    ]


def analyse(res: dict) -> dict[str, Any]:
    """Rank 0's per-step pieces, the all-reduce's cost, and the stock fit's engine time per step."""
    return {
        'per_step': res['events'][0]['per_step'],
        'latency': res['latency'][0],
        'stock_engine': res['events|stock'][0]['per_step'].get(ENGINE, 0.0),
    }


def markdown(events: dict[int, dict], overheads: list[dict]) -> list[str]:
    """The section (lines): one column per world size of ``events`` (``{world: analyse(...)}``)."""
    L = ["## Where UnevenJoin's time goes\n"]
    add = L.append
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
    row('events UnevenJoin matched (count, not us)', [f'{per[w].get(MATCHED, 0):.0f}' for w in worlds])
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
    return L
