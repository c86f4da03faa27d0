"""The activation-checkpointing matrix of docs/shadow-steps.md: UnevenJoin and stock Composer beside one process.

Runs the scenarios of ``tests/test_activation_checkpointing.py`` (their first rank order) with UnevenJoin and
without it (stock Composer), one launch per world size and way (each scenario expected to stop every rank in a
launch of its own: on older code, and in stock Composer, gloo aborts the process), and prints per scenario the largest
difference of any rank's parameters from the single-process reference over the union of each step's real
samples, the samples trained of all, or the error. The code under test is the tree ``PYTHONPATH`` names, so
two trees compare back to back::

    PYTHONPATH=. .venv/bin/python benchmarks/checkpointing.py                       # this tree, and stock
    PYTHONPATH=/path/to/other/tree .venv/bin/python benchmarks/checkpointing.py --no-stock
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests'))

import test_activation_checkpointing as cases
from harness import RankError, launch
from reference import max_abs_diff


def measure(join: bool) -> dict[str, str]:
    """Per scenario, what the ranks ended with, as a table cell."""
    names = [n for n in cases.ALL if '@' not in n]
    cells = {}
    for world in (2, 3):
        plain = [n for n in names if len(cases.ALL[n]['shards']) == world and n not in cases.STOPS]
        stops = [[n] for n in names if len(cases.ALL[n]['shards']) == world and n in cases.STOPS]
        for group in [plain, *stops] if plain else stops:
            try:
                results = launch(world, cases.calls_of(group, join), timeout=900)
            except AssertionError as e:  # a rank died (gloo aborts the process on mismatched collectives)
                why = [line.strip() for line in str(e).splitlines() if 'what()' in line or 'exited' in line]
                cells.update(dict.fromkeys(group, f'process died: {why[-1][:80] if why else e}'))
                continue
            cells.update({name: cell(name, per_rank) for name, per_rank in results.items()})
    return cells


def cell(name: str, per_rank: list) -> str:
    errors = [str(r) if isinstance(r, RankError) else r['error'] for r in per_rank]
    if any(errors):
        return next(e for e in errors if e).split('.')[0][:90]
    cfg = cases.ALL[name]
    ref = cases.expected(name)
    diff = max(max_abs_diff(r['params'], ref) for r in per_rank)
    return f'{diff:.1e}, {per_rank[0]["samples"]} of {sum(cfg["shards"]) * cfg["epochs"]} samples'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--no-stock', action='store_true', help='only the tree under test')
    args = parser.parse_args()
    ours = measure(join=True)
    stock = {} if args.no_stock else measure(join=False)
    print('| scenario | UnevenJoin | stock Composer |')
    print('|---|---|---|')
    for name in ours:
        print(f'| {name} | {ours[name]} | {stock.get(name, "")} |')


if __name__ == '__main__':
    main()
