"""The join's own cost at W = 8..4,096 ranks, measured by simulation on one core (``tests/scaled.py``).

Run alone (not part of ``make bench``)::

    .venv/bin/python benchmarks/scale.py                      # W = 8 .. 4,096, shards of 1,000 batches (~minutes)
    .venv/bin/python benchmarks/scale.py --worlds 64 1024 --mean 100

What is measured, and how
-------------------------
Shards as in issue #48: ``mean`` batches +-10% per rank, 1% of ranks (at least one) empty, 1% with twice the data,
4 samples per batch (the last of each shard partial). One rank's real ``JoinLoader``, ``Protocol`` and rebalancer
run; the other ranks' rows are supplied as the agreement would (``tests/scaled.py``, cross-checked against every
rank simulated at once in ``tests/test_scaled.py``). Per world size:

* **decision CPU per agreed step** (``mode='shadow'``, where one empty shard makes every step agreed): the rank's
  CPU time (``time.thread_time``: on a shared machine, what other processes take is not in it) in ``next()`` and in
  the record reads the algorithm makes, the simulated exchange's tables excluded;
  median over the epoch's steps, and per planned step (``mode='rebalance'``, with ``len()``);
* **bytes per step**: the agreement's all-reduce payload, ``8 x 13 x W``;
* **steps vs ideal**: ``mode='shadow'`` runs the longest shard's count, ``mode='rebalance'`` ``ceil(total / W)``;
* **batches moved** by the sized rebalance schedule, and its most receivers per donor in one step;
* **fit-start setup**: building the rank's ``RebalancingLoader`` (the sized schedule), seconds;
* **read-ahead rule** (:func:`~composer_join.rebalance.readahead.assign`) per step, median / max over an epoch of
  the rule driven by a model of the ranks' buffers (levels 0..2, refilled after each step);
* **report**: the pickled ``EpochReport`` of the ``mode='shadow'`` epoch, bytes, and the CPU time of the copy a
  checkpoint makes of it (the least of ``repeat`` copies);
* **checkpoint positions** (:func:`checkpoint_positions`, a table of its own; ``--positions-only``: that table
  alone) for a global-order sampler (``ExactDistributedSampler``: ``GlobalOrderPosition``), mid-epoch (every rank
  half way through its shard) and inside an epoch resumed elastically (from as many ranks: the layout): each
  rank's entry built as ``RankPositions.gather`` builds it (the adapter's ``save`` on each simulated rank,
  pickled and unpickled as ``all_gather_object`` does, then the adapter's ``kept`` where it has one), the
  positions' bytes in UnevenJoin's checkpoint state (pickled with ``torch.save``'s protocol 2), and the bytes each
  rank receives from the gather (``all_gather_object`` pads every rank's pickled entry to the largest: ``W`` times
  the largest).

Where a cost passes 1% of a 100 ms step (1 ms), from the measured points (linear in W between them) and, for
the agreement's all-reduce, paper estimates stated in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import copy
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests'))

import numpy as np

from composer_join.rebalance.readahead import READ_AHEAD

try:
    from composer_join.rebalance.readahead import assign_levels
except ImportError:  # before #48: the rule on lists of rows
    from composer_join.rebalance.readahead import assign

    def assign_levels(held: Any, drained: Any, transfers: bool = True) -> Any:
        cells = assign(list(zip(held.tolist(), drained.tolist())), transfers)
        return None if cells is None else np.array([-1 if c is None else c for c in cells])


from scaled import Shards, run_rank

try:
    from composer_join.rebalance import planning as _planning
except ImportError:  # before #48
    _planning = None  # type: ignore[assignment]


def readahead_epoch(shards: Shards, limit: float = 120.0) -> dict[str, Any]:
    """The read-ahead rule over one epoch: per step its time; the steps, batches moved, most receivers per donor."""
    rem = shards.n.copy()
    buf = np.minimum(rem, READ_AHEAD)
    rem -= buf
    times: list[float] = []
    moved, most, steps = 0, 0, 0
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        drained = rem == 0
        t0 = time.thread_time()
        cell = assign_levels(buf, drained)  # what the rebalancer runs per step, on the agreement's columns
        times.append(time.thread_time() - t0)
        if cell is None:
            break
        steps += 1
        ranks = np.arange(shards.world)
        buf -= cell == ranks  # each trains its own first
        receivers = (cell >= 0) & (cell != ranks)
        donors, given = np.unique(cell[receivers], return_counts=True)
        moved += int(receivers.sum())
        most = max(most, int(given.max(initial=0)))
        for d, g in zip(donors.tolist(), given.tolist()):
            from_buffer = min(g, int(buf[d]))
            buf[d] -= from_buffer
            fresh = min(g - from_buffer, int(rem[d]))
            rem[d] -= fresh
            moved -= g - from_buffer - fresh  # receivers left idle: the donor's data ended
        take = np.minimum(READ_AHEAD - buf, rem)
        buf += take
        rem -= take
    ms = [t * 1e3 for t in times]
    return {'steps': steps, 'moved': moved, 'most': most, 'median': statistics.median(ms), 'max': max(ms)}


def measure(
    world: int, mean: int, seed: int = 0, sized: bool = True, rule: bool = True, repeat: int = 3
) -> dict[str, Any]:
    """One world size's row; ``repeat`` runs of each, the least of each figure kept (the machine is shared: what
    other processes add is noise, never the join's cost)."""
    shards = Shards.spread(world, mean, seed)
    rank = int(np.argmax(shards.n))  # a rank with data to the end: it takes every step's decisions with a batch
    out: dict[str, Any] = {'W': world, 'total': shards.total(), 'ideal': -(-shards.total() // world)}
    runs = [run_rank(shards, rank) for _ in range(repeat)]
    out['agreed_ms'] = min(statistics.median(r.agreed_seconds) for r in runs) * 1e3
    out['agreed_max_ms'] = min(max(r.agreed_seconds) for r in runs) * 1e3
    shadow = runs[0]
    out['shadow_steps'] = len(shadow.epochs[0])
    out['bytes_step'] = 8 * 13 * world
    report = shadow.loader.report  # type: ignore[union-attr]
    out['report_bytes'] = len(pickle.dumps(report))
    vars(report)  # (its lists made current)
    copies = []
    for _ in range(repeat):
        t0 = time.thread_time()
        report.state() if hasattr(report, 'state') else copy.deepcopy(vars(report))  # what a checkpoint copies
        copies.append(time.thread_time() - t0)
    out['report_copy_s'] = min(copies)
    if sized:
        donors = []
        for _ in range(repeat):
            if _planning is not None:
                _planning._cached.cache_clear()  # the schedule is computed once per process: time its computing
            donors.append(run_rank(shards, rank, mode='rebalance'))
        donor = donors[0]
        loader = donor.loader.source  # type: ignore[union-attr]
        out['setup_s'] = min(d.setup for d in donors)
        out['rebalance_steps'] = len(donor.epochs[0])
        out['planned_ms'] = min(statistics.median(d.planned_seconds) for d in donors) * 1e3
        counts = loader.counts_per_rank()
        out['moved'] = sum(counts['received_batches'])
        out['most_receivers'] = _most_receivers(loader)
    if rule:
        rules = [readahead_epoch(shards) for _ in range(repeat)]
        out['rule'] = {**rules[0], 'median': min(r['median'] for r in rules), 'max': min(r['max'] for r in rules)}
    return out


def checkpoint_positions(world: int, mean: int, seed: int = 0) -> dict[str, int]:
    """UnevenJoin's checkpoint state for the positions of ``world`` ranks read through ``ExactDistributedSampler``
    (shards as :class:`Shards` spreads them, every rank half way through its own), mid-epoch (``mid_*``) and in an
    epoch resumed elastically from as many ranks (``resumed_*``): the state's bytes (``*_state``) and what each rank
    receives from the gather (``*_received``). The entries are built as ``RankPositions.gather`` builds them."""
    from dataclasses import asdict
    from unittest import mock

    from composer.utils import dist

    from composer_join.data.elastic import GlobalOrder, GlobalOrderPosition, layout_of

    shards = Shards.spread(world, mean, seed)
    samples = [4 * int(n) for n in shards.n]  # 4 samples per batch (the last partial: an upper bound here)
    order = GlobalOrder('exact', sum(samples), True, 17, False, 0)
    used = [s // 2 for s in samples]
    out: dict[str, int] = {}
    old = [{'used': u, 'dataset': {'order': asdict(order)}} for u in used]  # the entries of the checkpoint resumed
    for name, layout in (('mid', None), ('resumed', layout_of(old))):
        position = GlobalOrderPosition(None, None, order, layout)
        sent = []
        for rank in range(world):
            with mock.patch.object(dist, 'get_global_rank', return_value=rank):
                mine = {'trained': used[rank], 'used': used[rank], 'sent': 0, 'ended': False}
                mine['dataset'] = position.save(used[rank])
            sent.append(pickle.dumps(mine))  # all_gather_object's pickler
        gathered = [pickle.loads(b) for b in sent]
        kept = position.kept(gathered) if hasattr(position, 'kept') else gathered
        out[f'{name}_state'] = len(pickle.dumps(kept, protocol=2))  # torch.save's protocol
        out[f'{name}_received'] = world * max(len(b) for b in sent)  # padded to the largest entry
    return out


def positions_table(rows: list[dict[str, Any]]) -> str:
    head = (
        '| W | checkpoint positions, mid-epoch: state / received per rank | in an epoch resumed elastically: '
        'state / received per rank |\n|---|---|---|'
    )
    lines = [head]
    for r in rows:
        p = r['positions']
        lines.append(
            f'| {r["W"]:,} | {p["mid_state"]:,} B / {p["mid_received"]:,} B | '
            f'{p["resumed_state"]:,} B / {p["resumed_received"]:,} B |'
        )
    return '\n'.join(lines)


def _most_receivers(loader: Any) -> int:
    schedule = getattr(loader, 'steps', None)
    if schedule is None:
        return loader.plan.most_receivers()  # type: ignore[no-any-return]
    most = 0
    for row in schedule:
        owners = [c[0] for q, c in enumerate(row) if c is not None and c[0] != q]
        if owners:
            most = max(most, max(np.bincount(owners)))
    return int(most)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        '| W | decision CPU per agreed step (median / max) | per planned step | bytes per step | steps: shadow / '
        'rebalance / ideal | batches moved (most receivers per donor-step) | sized schedule at fit start | '
        'read-ahead rule per step (median / max) | read-ahead steps (most gifts per donor-step) | EpochReport pickled, '
        'copied at a checkpoint |'
        '\n|' + '---|' * 10
    )
    lines = [head]
    for r in rows:
        rule = r.get('rule')
        sized = f'{r["moved"]} ({r["most_receivers"]}) | {r["setup_s"]:.3f} s | ' if 'setup_s' in r else '- | - | '
        lines.append(
            f'| {r["W"]:,} | {r["agreed_ms"]:.3f} / {r["agreed_max_ms"]:.2f} ms | {r.get("planned_ms", 0):.3f} ms | '
            f'{r["bytes_step"]:,} | {r["shadow_steps"]} / {r.get("rebalance_steps", "-")} / {r["ideal"]} | {sized}'
            + (
                f'{rule["median"]:.3f} / {rule["max"]:.2f} ms | {rule["steps"]} ({rule["most"]}) | '
                if rule
                else '- | - | '
            )
            + f'{r["report_bytes"]:,} B, {r["report_copy_s"] * 1e3:.3f} ms |'
        )
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--worlds', type=int, nargs='*', default=[8, 64, 256, 1024, 4096])
    parser.add_argument('--mean', type=int, default=1000)
    parser.add_argument('--no-sized', action='store_true', help='skip the sized schedule (slow before #48)')
    parser.add_argument('--no-rule', action='store_true', help='skip the read-ahead rule')
    parser.add_argument('--positions-only', action='store_true', help='the checkpoint positions table alone')
    parser.add_argument('--repeat', type=int, default=3, help='runs of each measurement; the least figure is kept')
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        t0 = time.perf_counter()
        if args.positions_only:
            row: dict[str, Any] = {'W': world}
        else:
            row = measure(world, args.mean, sized=not args.no_sized, rule=not args.no_rule, repeat=args.repeat)
        row['positions'] = checkpoint_positions(world, args.mean)
        rows.append(row)
        print(f'W={world}: {time.perf_counter() - t0:.1f} s {rows[-1]}', file=sys.stderr, flush=True)
    if not args.positions_only:
        print(table(rows))
        print()
    print(positions_table(rows))


if __name__ == '__main__':
    main()
