"""Collectives per step for each DDP sync strategy, stock Composer and UnevenJoin (a table of section 1).

At 2 ranks (``Setup.counts``), microbatch size :data:`MICROBATCH` (2 microbatches per real step, so
that ``multi_auto_sync`` differs): stock Composer for 3 real steps everywhere; UnevenJoin for 6
steps where the last rank has 4 batches (steps 0-2 are planned from the lengths, 3 is its last
batch, 4 and 5 are shadow steps for it). Counted as in ``tests/rank_scenarios.py``
(``composer_join.CollectiveCounter``). Part of ``run.py``'s launch.
"""

from __future__ import annotations

from typing import Any

from common import BATCH, Setup, mark

SYNCS = ('single_auto_sync', 'multi_auto_sync', 'forced_sync')
MICROBATCH = 16  # 2 microbatches per real step in the collective counts, so multi_auto_sync differs
NAMES = {'all_reduce': 'all_reduce', 'ddp_grad_bucket': 'DDP grad bucket', '_broadcast_coalesced': 'buffer broadcast'}


def calls(s: Setup) -> list[tuple[str, str, dict]]:
    """``count|<sync>|stock`` and ``count|<sync>|UnevenJoin`` per sync strategy (none unless ``s.counts``)."""
    if not s.counts:
        return []
    out = []
    for sync in SYNCS:
        both = {'sync': sync, 'microbatch': MICROBATCH}
        out.append(
            (f'count|{sync}|stock', 'count_collectives', {'sizes': [3 * BATCH] * s.world, 'join': False, **both})
        )
        out.append(
            (
                f'count|{sync}|UnevenJoin',
                'count_collectives',
                {'sizes': [6 * BATCH] * (s.world - 1) + [4 * BATCH], 'join': True, **both},
            )
        )
    return out


def analyse(res: dict) -> list[dict[str, Any]]:
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


def fmt_counts(c: dict[str, int]) -> str:
    return f'**{sum(c.values())}**: ' + ', '.join(f'{NAMES.get(k, k)} {v}' for k, v in sorted(c.items()))


def markdown(rows: list[dict]) -> list[str]:
    """The table (lines), with what is counted; nothing if the counts were not run."""
    if not rows:
        return []
    L = [
        f'Collectives per step at 2 ranks, microbatch size {MICROBATCH} (a real step is 2 microbatches, a '
        "shadow step 1). `all_reduce`: Python-level `torch.distributed.all_reduce` calls (Composer's and "
        "UnevenJoin's); DDP grad bucket: DDP's gradient all-reduces (2 buckets per sync for this model); buffer "
        "broadcast: DDP's BatchNorm-buffer broadcast; broadcast: Composer's. A step's window runs from the "
        "previous `BATCH_END` to its own, so it also holds the next step's agreement, which starts a step ahead; "
        "the first agreed step (the last rank's last batch) starts its own. UnevenJoin's fit: 6 steps, the "
        'last rank has 4 batches, so 3 steps are agreed in all.\n',
        "| sync strategy | stock | UnevenJoin, before any rank's last batch | UnevenJoin, last rank's last batch "
        '| UnevenJoin, last rank shadowing | same on all ranks |',
        '|---|---|---|---|---|---|',
    ]
    for sync in SYNCS:
        by = {r['label']: r for r in rows if r['sync'] == sync}
        L.append(
            f'| {sync} | '
            + ' | '.join(fmt_counts(by[k]['counts']) for k in ('stock', 'real', 'last', 'shadow'))
            + f' | {mark(all(r["agree"] for r in by.values()))} |'
        )
    L.append('')
    return L
