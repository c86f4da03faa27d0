"""Every multi-rank scenario again with its ranks rotated: which rank runs short must not matter.

A scenario config gives its ranks' data per rank: lists indexed by rank (``shards``,
``eval_shards``, ``batch_sizes``, ``batch_plan``, ``layout``), dicts keyed by rank (``claimed_len``,
``fail_at``, ``eval_fail_at``), lists of ranks (``unsized`` when it is a list: the ranks without
``len()``; the ``ranks`` of every ``oom`` rule, tests/scenarios_oom.py) and cut points (``cuts``: rank ``r`` gets
``perm[cuts[r]:cuts[r + 1]]``, tests/scenarios_resume.py); a config without ``shards`` or ``cuts`` may
give its ranks' batches instead (``formats``: rank ``r`` yields one batch per entry of ``formats[r]``,
with ``claimed``, a list by rank, its ``len()``; tests/scenarios_badinput.py), and ``per_rank`` is a
list by rank of ``UnevenJoin`` settings (tests/scenarios_ranks.py:with_settings). :func:`rotate` moves rank
``r``'s part of all of them to rank ``(r + k) % W`` at once, so a rotated scenario is the same
scenario with other ranks in each role; its reference follows, since every reference reads the
same config (rank ``r`` reads ``shard(r, shards[r])``). :func:`with_rotations` adds, per scenario,
the rotations that put its shortest rank (the empty one, if any) first, in the middle and last,
as ``'<name>@<k>'``; the tests parametrize over the result and group every rotation into the
launch of its world size. Not a test module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

PER_RANK_LISTS = ('shards', 'eval_shards', 'batch_sizes', 'batch_plan', 'layout', 'formats', 'claimed', 'per_rank')
PER_RANK_DICTS = ('claimed_len', 'fail_at', 'eval_fail_at')


def world_size(cfg: dict[str, Any]) -> int:
    return len(_train_sizes(cfg))


def _train_sizes(cfg: dict[str, Any]) -> list[int]:
    """Per rank, its train samples (``shards``, ``cuts``) or its batches (``formats``)."""
    if 'shards' in cfg:
        return list(cfg['shards'])
    if 'cuts' in cfg:
        return [b - a for a, b in zip(cfg['cuts'], cfg['cuts'][1:])]
    return [len(f) for f in cfg['formats']]


def rotate(cfg: dict[str, Any], k: int) -> dict[str, Any]:
    """``cfg`` with rank ``r``'s per-rank data given to rank ``(r + k) % W``."""
    w = world_size(cfg)
    out = dict(cfg)
    for key in PER_RANK_LISTS:
        if cfg.get(key) is not None:
            out[key] = [cfg[key][(i - k) % w] for i in range(w)]
    for key in PER_RANK_DICTS:
        if cfg.get(key):
            out[key] = {(r + k) % w: v for r, v in cfg[key].items()}
    if isinstance(cfg.get('unsized'), list):
        out['unsized'] = sorted((r + k) % w for r in cfg['unsized'])
    if cfg.get('oom'):
        out['oom'] = [dict(rule, ranks=sorted((r + k) % w for r in rule['ranks'])) for rule in cfg['oom']]
    if cfg.get('cuts') is not None:
        sizes = [b - a for a, b in zip(cfg['cuts'], cfg['cuts'][1:])]
        moved = [sizes[(i - k) % w] for i in range(w)]
        out['cuts'] = [sum(moved[:i]) for i in range(w + 1)]
    return out


def _shortest(cfg: dict[str, Any]) -> int:
    """The rank with the least data: fewest train samples, then fewest eval samples (the first such rank)."""
    w = world_size(cfg)
    evals = cfg.get('eval_shards') or [0] * w
    train = _train_sizes(cfg)
    sizes = [(n, e) for n, e in zip(train, evals)]
    return sizes.index(min(sizes))


def rotations(cfg: dict[str, Any]) -> list[int]:
    """The rotations ``k`` (not 0) that, with the original, put the shortest rank first, in the middle and last.

    Rotations that leave every per-rank field as it is (equal shards) are left out.
    """
    w = world_size(cfg)
    if w < 2:
        return []
    short = _shortest(cfg)
    middle = range(1, w - 1)
    wanted = sorted({0, w - 1} | (set() if short in middle or not middle else {w // 2}) - {short})
    ks = [(p - short) % w for p in wanted]
    return [k for k in ks if rotate(cfg, k) != cfg]


def rotated_name(name: str, k: int) -> str:
    return f'{name}@{k}'


def with_rotations(scenarios: dict[str, dict], names: Optional[Iterable[str]] = None) -> dict[str, dict]:
    """``scenarios`` and, for each of ``names`` (default: all), its :func:`rotations` as ``'<name>@<k>'``."""
    out = dict(scenarios)
    for name in scenarios if names is None else names:
        for k in rotations(scenarios[name]):
            out[rotated_name(name, k)] = rotate(scenarios[name], k)
    return out


def expand(names: Iterable[str], scenarios: dict[str, dict]) -> list[str]:
    """``names`` with each one's rotated variants present in ``scenarios`` after it (for ``parametrize``)."""
    out = []
    for name in names:
        out.append(name)
        out.extend(n for n in scenarios if n.startswith(name + '@'))
    return out


def base(name: str) -> str:
    """The scenario a (possibly rotated) name was made from."""
    return name.split('@')[0]
