"""The collectives the join's agreements ride on, on real ranks: one all-reduce of a row per rank, and two object ones.

Owns :class:`TorchExchange`, the :class:`~composer_join.core.protocol.Exchange` the loader is given on real ranks
(``torch.distributed`` through Composer's ``dist``), and the first agreement of every fit, evaluation and
``predict()`` (:func:`agree_on_length`), which carries every rank's length, settings and facts.

An exchange of rows is one ``all_reduce`` of a ``world_size x len(row)`` integer table in which each rank fills only
its own row, so the sum is every rank's row in place: ``8 * 13 * W`` bytes for a step's agreement, started
asynchronously so that it overlaps the previous step's training; a rank that finds a peer gone while it waits says
where (:func:`~composer_join.core.peers.lost_peer`). The object collectives (``all_gather_object``,
``broadcast_object_list``) run only where the protocol says so: on error paths, and once per rank that never saw a
batch (its template).

Example::

    exchange = TorchExchange(state.device.tensor_to_device)
    table = exchange.rows([1, 8, 1], 'the agreement on batch 4 of epoch 0').wait()  # every rank's row
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from composer.utils import dist

from composer_join.core.peers import lost_peer
from composer_join.core.protocol import Exchange, Pending, agreed_lengths
from composer_join.core.settings import Facts, mismatch_error
from composer_join.core.settings import check as check_settings

__all__ = ['TorchExchange', 'agree_on_length']

ToDevice = Callable[[torch.Tensor], torch.Tensor]


class TorchExchange(Exchange):
    """The real exchange: ``torch.distributed`` on the default process group, tensors on the trainer's device.

    ``to_device``: the trainer's ``state.device.tensor_to_device`` (NCCL takes CUDA tensors only).
    """

    def __init__(self, to_device: ToDevice = lambda t: t):
        self.to_device = to_device
        self.rank, self.world = dist.get_global_rank(), dist.get_world_size()

    def rows(self, row: Sequence[int], what: str) -> Pending:
        table, work = _exchange_rows(row, self.to_device)
        return _Rows(table, work, what)

    def gather(self, obj: Any) -> list[Any]:
        return dist.all_gather_object(obj)

    def broadcast(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


class _Rows(Pending):
    def __init__(self, table: torch.Tensor, work: Any, what: str):
        self.table, self.work, self.what = table, work, what

    def wait(self) -> list[list[int]]:
        with lost_peer(self.what):
            self.work.wait()
        return self.table.cpu().tolist()

    def array(self) -> Any:  # the agreement's table as it arrived, no Python object per rank
        with lost_peer(self.what):
            self.work.wait()
        return self.table.cpu().numpy()


def agree_on_length(
    own_len: Optional[int],
    current_len: Optional[int],
    to_device: ToDevice = lambda t: t,
    settings: Sequence[int] = (),
    facts: Optional[Facts] = None,
) -> tuple[Optional[int], bool, list[Optional[int]], list[Facts]]:
    """The number of batches every rank runs per epoch: the longest rank's (one collective, per fit or evaluation).

    Args:
        own_len: ``len()`` of this rank's dataloader, or None if it has none.
        current_len: the trainer's ``dataloader_len`` for it (smaller when a subset was asked for).
        settings: this rank's UnevenJoin settings (:func:`composer_join.core.settings.row`), carried in the
            same collective with ``facts``; if given, every rank raises where they differ between ranks, or where
            the collective fails (a rank without UnevenJoin issued a different one).
        facts: what this rank's own objects decide about the collectives that follow
            (:class:`~composer_join.core.settings.Facts`), sent with ``settings``.

    Returns:
        ``(shared, check_overflow, own_lens, facts)``: :func:`~composer_join.core.protocol.agreed_lengths` of every
        rank's lengths, and every rank's facts (none without ``settings``).
    """
    facts = facts if facts is not None else Facts()
    extra = [*settings, *facts.row()] if settings else []
    table, work = _exchange_rows(
        [-1 if own_len is None else own_len, -1 if current_len is None else current_len, *extra], to_device
    )
    try:
        work.wait()
    except RuntimeError as e:  # gloo: 'Connection reset by peer' once a rank without UnevenJoin aborted, or a peer died
        if not settings:
            raise
        raise mismatch_error(f'{type(e).__name__}: {e}') from e  # names both causes: they look the same from here
    every = check_settings(table.cpu()[:, 2:].tolist(), facts.label) if settings else []
    own_lens, cur_lens = ([int(v) for v in column] for column in table.cpu().T[:2])
    shared, check_overflow, per_rank = agreed_lengths(own_lens, cur_lens)
    return shared, check_overflow, per_rank, every


def _exchange_rows(row: Sequence[int], to_device: ToDevice) -> tuple[torch.Tensor, Any]:
    """Start an all-reduce that gives every rank a ``world_size x len(row)`` table of all ranks' rows.

    Each rank fills only its own row of a zero table, so the sum is every rank's row in place.
    Returns the table (valid once the work is waited for) and the work.
    """
    table = torch.zeros(dist.get_world_size(), len(row), dtype=torch.int64)
    table[dist.get_global_rank()] = torch.tensor(list(row), dtype=torch.int64)
    table = to_device(table)
    return table, torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.SUM, async_op=True)
