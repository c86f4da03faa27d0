"""UnevenJoin's settings must be the same on every rank: checked in the fit's (or evaluation's) first agreement.

Ranks configured differently (a rank-dependent YAML override, say) would issue different
collectives and hang, or die in the backend. So every rank puts its settings (:func:`row`) in the
row it sends in the length agreement that starts every fit and evaluation
(:func:`~composer_join.core.exchange.agree_on_length`: no extra collective), and every rank checks the
table (:func:`check`): where they differ, every rank raises :class:`~composer_join.UnevenInputsError`
before the first step, naming each differing setting and the ranks that hold each value.

A rank with ``UnevenJoin(enable=False)`` takes part in that one agreement too (its only
collective), so a disabled rank among enabled ones is named like any other difference. A rank
without UnevenJoin at all runs none of this code: it issues Composer's first collective of the
epoch (a one-byte all-reduce) where the others issue the agreement, and the backend fails
(measured on gloo: the rank without UnevenJoin aborts with ``op.preamble.length <= op.nbytes``,
the others' agreement fails with ``Connection reset by peer`` within a second);
:func:`mismatch_error` turns the failure the UnevenJoin ranks see into an error that says so.

The same row carries what each rank's own objects decide about UnevenJoin's collectives (:class:`Facts`): whether
its trainer has other algorithms or its train ``DataSpec`` a ``batch_transforms``, whether its evaluation data repeats samples, how its train data keeps its
position. Every rank then decides from every rank's facts, never from its own alone (docs/how-it-works.md, "The
collectives, and what decides them"): :func:`check` stops every rank where they cannot be reconciled and returns
every rank's facts for the caller to decide the rest.

Example:
    >>> check([row(True, 'shadow', False, True), row(True, 'rebalance', False, True)])
    Traceback (most recent call last):
    ...
    composer_join.core.errors.UnevenInputsError: UnevenJoin is configured differently on different ranks: mode='shadow' on rank(s) [0], mode='rebalance' on rank(s) [1]. ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from composer_join.core.errors import UnevenInputsError

__all__ = ['MODES', 'SETTINGS', 'SHADOW_WAYS', 'Facts', 'check', 'mismatch_error', 'row']

MODES = ('shadow', 'rebalance')
SETTINGS = ('enable', 'mode', 'throw_on_early_termination', 'divide_by_initial_world_size')
SHADOW_WAYS = ('none', 'skip', 'zero', 'template')
"""How a rank's shadow microbatches run in a fit (:class:`Facts` ``shadow``): not wrapped or FSDP, then the ways of
:class:`composer_join.wrappers.ddp.ShadowWay` under DDP."""
_MARK = 19  # first column: a rank that runs UnevenJoin's agreement (anything else: garbage, not UnevenJoin)


def row(enable: bool, mode: str, throw_on_early_termination: bool, divide_by_initial_world_size: bool) -> list[int]:
    """This rank's settings as integers, for the agreement row."""
    return [_MARK, int(enable), MODES.index(mode), int(throw_on_early_termination), int(divide_by_initial_world_size)]


@dataclass(frozen=True)
class Facts:
    """What this rank's own objects decide about UnevenJoin's collectives at a start event, sent in its first agreement.

    Each rank sends its own; every rank gets every rank's back (:func:`check`) and decides from all of them alike.
    """

    others: int = 0
    """Algorithms besides UnevenJoin in this rank's trainer: where some rank has one, every rank re-gathers the
    step's counts at every ``AFTER_DATALOADER`` (:mod:`composer_join.interop.replan`), whatever each one matches."""
    repeats: bool = False
    """Evaluation and ``predict()``: this rank's dataloader shards with torch's ``DistributedSampler``, which repeats
    samples to even out the shards (Composer's evaluation drops them): left to Composer where every rank's does;
    the same on every rank, or every rank stops."""
    position: int = 0
    """Train: how this rank's data keeps its position (:class:`composer_join.data.positions.Kind`): gathered at
    checkpoints only where every rank's kind is the same."""
    shadow: int = 0
    """Train: how this rank's shadow microbatches run (an index of :data:`SHADOW_WAYS`, from its model: a
    ``SyncBatchNorm`` or a module marked ``shadow_forward = True`` makes them run the forward); the collectives of a
    shadow step follow from it: the same on every rank, or every rank stops."""
    overcounts: bool = False
    """This rank's dataloader may yield more batches than its ``len()``: an ``IterableDataset`` read by several
    ``DataLoader`` workers (each worker ends with its own partial batch, torch only warns). Where some rank's may,
    Composer's length cap is lifted while its loop starts (:func:`composer_join.join.loader.lift_cap`); elsewhere
    it stays, and a dataloader that yields more than the longest ``len()`` stops every rank with an error."""
    transforms: bool = False
    """Train: this rank's ``DataSpec`` has a ``batch_transforms`` of the user's, which Composer applies before it
    counts, so the batch it trains may hold other samples than the one the dataloader yielded (two views of each,
    say). Where some rank's has one, every rank counts again at every ``AFTER_DATALOADER``, after the transform, as
    for :attr:`others`."""
    forward: int = 0
    """Train, under DDP's default way (no model code in a shadow microbatch): what this rank's probes of the model's
    training forward found in the trainer's earlier fits (:class:`composer_join.shadow.shadow.ForwardProbe`): 0 never
    probed, else 1 + a bitmask of the collectives seen (:data:`composer_join.shadow.shadow.COLLECTIVES`). Where some
    rank saw one, every rank stops at the fit's first shadow step, also a rank that runs no forward in this fit."""
    fresh: bool = False
    """Train, under DDP's default way: this rank has seen no loss of the model yet (a new process, resumed from a
    checkpoint, say), so if it shadows at the fit's first step its shadow microbatch runs the model on the template
    (:class:`composer_join.wrappers.ddp.NoModelCode`), whose zero-weighted loss may reach a parameter no real sample
    of the step used: every rank then takes such gradients back on that step."""
    label: str = field(default='train', compare=False)
    """The dataloader's label, for messages (not sent)."""

    def row(self) -> list[int]:
        return [
            self.others,
            int(self.repeats),
            self.position,
            self.shadow,
            int(self.overcounts),
            int(self.transforms),
            self.forward,
            int(self.fresh),
        ]

    @classmethod
    def from_row(cls, values: Sequence[int], label: str = 'train') -> Facts:
        v = [int(x) for x in values]
        return cls(v[0], bool(v[1]), v[2], v[3], bool(v[4]), bool(v[5]), v[6], bool(v[7]), label)


def _value(name: str, code: int) -> str:
    if name == 'mode':
        return repr(MODES[code]) if 0 <= code < len(MODES) else f'<{code}>'
    return str(bool(code)) if code in (0, 1) else f'<{code}>'


def check(rows: Sequence[Sequence[int]], label: str = 'train') -> list[Facts]:
    """Every rank's :class:`Facts`, from every rank's :func:`row` followed by its :meth:`Facts.row`.

    Raises :class:`UnevenInputsError` (the same verdict on every rank) if the settings differ, or if the facts do
    where they cannot be reconciled: a ``label`` dataloader that repeats samples on some ranks only.
    """
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
    facts = [Facts.from_row(r[1 + len(SETTINGS) :], label) for r in rows]
    repeating = [rank for rank, f in enumerate(facts) if f.repeats]
    if repeating and len(repeating) < len(facts):
        others = [rank for rank, f in enumerate(facts) if not f.repeats]
        raise UnevenInputsError(
            f"the {label} dataloader of rank(s) {repeating} shards with torch's DistributedSampler, which repeats "
            f"samples to even out the shards (Composer's evaluation then drops the repeats), and that of rank(s) "
            f'{others} does not: UnevenJoin would leave the ones to Composer and join the others, and their '
            f'collectives would differ. Give every rank the same kind of {label} data: '
            f'composer_join.ExactDistributedSampler (no repeats; uneven shards are evaluated exactly) or the same '
            f'sampler everywhere.',
        )
    ways: dict[int, list[int]] = {}
    for rank, f in enumerate(facts):
        ways.setdefault(f.shadow, []).append(rank)
    if len(ways) > 1:
        held = ', '.join(f'{_way(w)} on rank(s) {ranks}' for w, ranks in ways.items())
        raise UnevenInputsError(
            f"UnevenJoin's shadow microbatches would run differently on different ranks ({held}), so their collectives "
            f'would differ: the way follows from the model (a torch.nn.SyncBatchNorm, or a module marked '
            f'shadow_forward = True, makes them run the forward on zero samples; DDP static_graph and a few other '
            f'settings on two template samples). Give every rank the same model, marks and DDP settings.',
        )
    return facts


def _way(code: int) -> str:
    return repr(SHADOW_WAYS[code]) if 0 <= code < len(SHADOW_WAYS) else f'<{code}>'


def mismatch_error(cause: str) -> UnevenInputsError:
    """The error for a first agreement that failed or made no sense: most likely some rank runs no UnevenJoin."""
    return UnevenInputsError(
        f"UnevenJoin's first agreement (at the start of fit or evaluation) failed: {cause}. The usual cause is a "
        f"rank whose Trainer has no UnevenJoin in its algorithms: it issues Composer's own collectives instead, "
        f'which do not match. Give every rank UnevenJoin with the same settings (enable=False to turn it off). '
        f'Otherwise a peer process is gone (killed, out of memory, its node lost; its own log says why).',
    )
