"""``run.py --profile``: a stock and an UnevenJoin fit under cProfile at 2 ranks, into ``profile.txt``.

Rank 0's two reports (``workloads.profile_fit``), preceded by the functions whose own time per
step grew most with UnevenJoin. (Not named ``profile.py``: that would hide the standard library's
``profile``, which ``cProfile`` imports, on the ranks.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from common import BATCH, Setup


def calls(s: Setup, profile: bool) -> list[tuple[str, str, dict]]:
    """The two profiled fits, if ``profile`` and at 2 ranks."""
    if not (profile and s.world == 2):
        return []
    even = [s.batches * BATCH] * s.world
    return [
        ('profile|stock', 'profile_fit', {'sizes': even, 'join': False}),
        ('profile|UnevenJoin', 'profile_fit', {'sizes': even, 'join': True}),
    ]


def write(res: dict, out: Path) -> Optional[Path]:
    """``out/profile.txt`` from a launch that ran :func:`calls`' fits; its path (None if they did not run)."""
    if 'profile|stock' not in res:
        return None
    path = out / 'profile.txt'
    path.write_text(text(res))
    return path


def text(res: dict) -> str:
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


def markdown(path: Optional[Path]) -> list[str]:
    """results.md's pointer to ``profile.txt`` (lines; none if it was not written)."""
    if not path:
        return []
    return [
        f'cProfile of a stock and an UnevenJoin fit at 2 ranks, rank 0, and the functions whose own time grew '
        f'most: `{path.name}` (beside this file).\n'
    ]
