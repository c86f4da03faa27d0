"""UnevenJoin's settings must be the same on every rank: checked in the fit's (or evaluation's) first agreement.

Ranks configured differently (a rank-dependent YAML override, say) would issue different
collectives and hang, or die in the backend. So every rank puts its settings (:func:`row`) in the
row it sends in the length agreement that starts every fit and evaluation
(:func:`~composer_join.core.plan.agree_on_length`: no extra collective), and every rank checks the
table (:func:`check`): where they differ, every rank raises :class:`~composer_join.UnevenInputsError`
before the first step, naming each differing setting and the ranks that hold each value.

A rank with ``UnevenJoin(enable=False)`` takes part in that one agreement too (its only
collective), so a disabled rank among enabled ones is named like any other difference. A rank
without UnevenJoin at all runs none of this code: it issues Composer's first collective of the
epoch (a one-byte all-reduce) where the others issue the agreement, and the backend fails
(measured on gloo: the rank without UnevenJoin aborts with ``op.preamble.length <= op.nbytes``,
the others' agreement fails with ``Connection reset by peer`` within a second);
:func:`mismatch_error` turns the failure the UnevenJoin ranks see into an error that says so.

Example:
    >>> check([row(True, 'shadow', False, True), row(True, 'rebalance', False, True)])
    Traceback (most recent call last):
    ...
    composer_join.core.errors.UnevenInputsError: UnevenJoin is configured differently on different ranks: mode='shadow' on rank(s) [0], mode='rebalance' on rank(s) [1]. ...
"""

from __future__ import annotations

from collections.abc import Sequence

from composer_join.core.errors import UnevenInputsError

__all__ = ['MODES', 'SETTINGS', 'check', 'mismatch_error', 'row']

MODES = ('shadow', 'rebalance')
SETTINGS = ('enable', 'mode', 'throw_on_early_termination', 'divide_by_initial_world_size')
_MARK = 19  # first column: a rank that runs UnevenJoin's agreement (anything else: garbage, not UnevenJoin)


def row(enable: bool, mode: str, throw_on_early_termination: bool, divide_by_initial_world_size: bool) -> list[int]:
    """This rank's settings as integers, for the agreement row."""
    return [_MARK, int(enable), MODES.index(mode), int(throw_on_early_termination), int(divide_by_initial_world_size)]


def _value(name: str, code: int) -> str:
    if name == 'mode':
        return repr(MODES[code]) if 0 <= code < len(MODES) else f'<{code}>'
    return str(bool(code)) if code in (0, 1) else f'<{code}>'


def check(rows: Sequence[Sequence[int]]) -> None:
    """Raise :class:`UnevenInputsError` if the ranks' :func:`row` s differ (the same verdict on every rank)."""
    if any(r[0] != _MARK for r in rows):
        raise mismatch_error(f'rank(s) {[i for i, r in enumerate(rows) if r[0] != _MARK]} sent no UnevenJoin settings')
    differences = []
    for column, name in enumerate(SETTINGS, start=1):
        holders: dict[int, list[int]] = {}
        for rank, r in enumerate(rows):
            holders.setdefault(int(r[column]), []).append(rank)
        if len(holders) > 1:
            differences.append(
                ', '.join(f'{name}={_value(name, v)} on rank(s) {ranks}' for v, ranks in holders.items())
            )
    if differences:
        raise UnevenInputsError(
            f'UnevenJoin is configured differently on different ranks: {"; ".join(differences)}. Every rank must '
            f'run UnevenJoin with the same settings (their collectives would differ and the run would hang); '
            f'check rank-dependent config overrides.',
        )


def mismatch_error(cause: str) -> UnevenInputsError:
    """The error for a first agreement that failed or made no sense: most likely some rank runs no UnevenJoin."""
    return UnevenInputsError(
        f"UnevenJoin's first agreement (at the start of fit or evaluation) failed: {cause}. The usual cause is a "
        f"rank whose Trainer has no UnevenJoin in its algorithms: it issues Composer's own collectives instead, "
        f'which do not match. Give every rank UnevenJoin with the same settings (enable=False to turn it off). '
        f'Otherwise a peer process is gone (killed, out of memory, its node lost; its own log says why).',
    )
