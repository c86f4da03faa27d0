"""Where one rank's batches come from, epoch by epoch: the one interface the join's loader reads through.

Three sources, chosen once per ``fit()`` or evaluation by :func:`composer_join.join.loader.batch_source`:

* :class:`OwnBatches`: this rank's own dataloader, batch by batch (``mode='shadow'``, and every evaluation);
* :class:`~composer_join.rebalance.rebalance.RebalancingLoader`: every rank's ``len()`` known, a planned
  schedule moves leftover batches to the ranks that ran out (``mode='rebalance'``);
* :class:`~composer_join.rebalance.readahead.ReadAheadRebalancer`: some rank has no ``len()``, batches move
  step by step from read-ahead buffers.

The :class:`~composer_join.join.iterator.JoinLoader` is built with one and calls, on every rank in the same
order::

    batches = source.epoch(start, open)   # an epoch's iteration starts (at step ``start`` of a resumed epoch)
    batch = next(batches)                 # per step: a batch, IDLE (nothing this step) or a Failed marker
    source.planned_locally()              # the step whose batch it just gave needs no agreement
    source.status_columns()               # this source's columns of that step's agreement row
    source.observe(plan)                  # that step's plan, once known
    source.make_transfers(batches, step)  # this rank stopped alone before ``step``: the transfers others made
    source.complete(report)               # EPOCH_END (collective where batches move)

and, for a checkpoint, :meth:`BatchSource.used` and :meth:`BatchSource.sent`; before a resumed epoch,
:meth:`BatchSource.resume`. ``open(resumed)`` is the loader's: ``iter()`` of the user's dataloader, for the
iteration that goes on with a restored position if ``resumed`` (its position adapter follows what is read).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Optional

from composer_join.core.plan import StepPlan
from composer_join.core.report import EpochReport

__all__ = ['IDLE', 'BatchSource', 'Failed', 'OwnBatches']


class _Idle:
    def __repr__(self) -> str:
        return 'IDLE'


IDLE = _Idle()
"""What a source yields for a step at which this rank has nothing to train but the epoch goes on (it shadows)."""


class Failed(NamedTuple):
    """What a source yields for a step it could not form (``error``: why), instead of raising.

    A rebalancer goes on through its schedule after a failure, making every later step's transfers
    (sending failures, discarding what it receives) for as long as it is asked, so that a rank that stops
    at a step nobody agreed on can still make the transfers the others made a step ahead.
    """

    error: BaseException


Opener = Callable[[bool], Iterator[Any]]


class BatchSource(abc.ABC):
    """One rank's batches, epoch by epoch (see the module docstring for who calls what, and when).

    Attributes:
        dataloader: this rank's own dataloader (the user's).
        own_length: batches of its own dataloader this rank contributes per epoch, if it differs from
            ``len(dataloader)`` (rebalancing: the first ``counts[rank]``); None otherwise.
        ends_with_own_data: this rank's batches end when its own dataloader does (no rebalancing, where the
            schedule decides): a resumed rank whose data had ended reads nothing more that epoch.
        reads_ahead: it reads into buffers that no checkpoint holds, so a position read as batches are read
            would not be where training stands (resumption replays the epoch instead).
    """

    own_length: Optional[int] = None
    ends_with_own_data = True
    reads_ahead = False

    def __init__(self, dataloader: Iterable):
        self.dataloader = dataloader

    @abc.abstractmethod
    def epoch(self, start: int, open: Opener) -> Iterator[Any]:
        """This rank's batch for every step of an epoch from step ``start`` (0, or where a resumed epoch goes on)."""

    def planned_locally(self) -> bool:
        """Whether the step whose batch :meth:`epoch` just gave needs no agreement (every rank known to have one)."""
        return False

    def status_columns(self) -> dict[str, Any]:
        """This source's columns of the agreement row of the step whose batch it just gave."""
        return {}

    def observe(self, plan: StepPlan) -> None:
        """Every step's plan, once known (agreed or planned locally)."""
        return None  # (nothing, for this source)

    def make_transfers(self, batches: Iterator[Any], step: int) -> None:
        """This rank stopped alone before ``step`` (a step planned from the lengths): make the transfers the others
        made for it a step ahead, so that none waits in a send or receive. ``batches``: :meth:`epoch`'s iterator."""
        return None  # (nothing, for this source)

    def complete(self, report: EpochReport) -> None:
        """At ``EPOCH_END``, on every rank: fill the report's fields this source knows (collective if it moves batches)."""
        return None  # (nothing, for this source)

    def used(self, steps: int, trained: int) -> int:
        """Samples of this rank's own dataloader used by the first ``steps`` steps of the epoch: trained here
        (``trained`` of them), or given to another rank; -1 if uncountable."""
        return trained

    def sent(self, steps: int) -> int:
        """Bytes this rank sent for the first ``steps`` steps of the epoch."""
        return 0

    def resume(self, used: int, sent: int) -> None:
        """Before the iteration of a resumed epoch: ``used`` own samples and ``sent`` bytes of it before the checkpoint."""
        return None  # (nothing, for this source)


class OwnBatches(BatchSource):
    """This rank's own dataloader, as it comes (``mode='shadow'``, evaluation, ``predict()``)."""

    def epoch(self, start: int, open: Opener) -> Iterator[Any]:
        return open(start > 0)
