"""The collectives UnevenJoin issues, on real ranks: rows of integers, small reductions, and two object ones.

Owns :class:`TorchExchange`, the :class:`~composer_join.core.protocol.Exchange` on real ranks (``torch.distributed``
through Composer's ``dist``), through which every collective of UnevenJoin's own goes, each named by its entry of
:mod:`composer_join.core.catalogue` (``what``, a :class:`~composer_join.core.catalogue.Said`), and the first agreement
of every fit, evaluation and ``predict()`` (:func:`agree_on_length`), which carries every rank's length, settings and
facts. :func:`listening` lets a diagnostic (or a test) hear every collective issued through it.

An exchange of rows is one ``all_reduce`` of a ``world_size x len(row)`` integer table in which each rank fills only
its own row, so the sum is every rank's row in place: ``8 * 13 * W`` bytes for a step's agreement, started
asynchronously so that it overlaps the previous step's training; a rank that finds a peer gone while it waits says
where (:func:`~composer_join.core.peers.lost_peer`). The object collectives (``all_gather_object``,
``broadcast_object_list``) run only where the protocol says so: on error paths, and once per rank that never saw a
batch (its template). :meth:`TorchExchange.host_sum` (FSDP's per-microbatch unit check) sums integers on the host in
``log2 W`` rounds of point-to-point messages from :data:`PAIRWISE_FROM` ranks on.

Example::

    exchange = TorchExchange(state.device.tensor_to_device)
    said = STEP_AGREEMENT.said('the agreement on batch 4 of epoch 0')
    table = exchange.rows([1, 8, 1], said).wait()  # every rank's row
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from composer.utils import dist

from composer_join.core.catalogue import FIRST_AGREEMENT
from composer_join.core.peers import lost_peer
from composer_join.core.protocol import Exchange, Pending, agreed_lengths
from composer_join.core.settings import Facts, mismatch_error
from composer_join.core.settings import check as check_settings

__all__ = ['PAIRWISE_FROM', 'TorchExchange', 'agree_on_length', 'listening']

ToDevice = Callable[[torch.Tensor], torch.Tensor]

_LISTENERS: list[Callable[[str], None]] = []
_OPS = {'max': torch.distributed.ReduceOp.MAX, 'sum': torch.distributed.ReduceOp.SUM}

PAIRWISE_FROM = 8
"""The world size from which :meth:`TorchExchange.host_sum` sums by pairwise exchanges (``ceil(log2 W)`` rounds, two
more where W is not a power of two) instead of gloo's all-reduce (a ring: ``2 (W - 1)`` hops in a row for any
payload). Below it the ring is at most 12 hops (0.3 ms at 25 us a hop) and one call into gloo, and the check's
all-reduce stays what :class:`~composer_join.collectives.CollectiveCounter` counts (docs/benchmarks.md, "At scale";
``benchmarks/fsdp_check.py``). The world size is the same on every rank, so every rank picks the same way."""
_PAIRWISE_TAG = 0x4A4E  # gloo send/recv tag of the pairwise sum's messages (its slots are apart from collectives')


@contextlib.contextmanager
def listening(listener: Callable[[str], None]) -> Iterator[None]:
    """Within the block, ``listener(what)`` is called in this process as each collective is issued through the
    exchange, before it runs (``what``: the call's :class:`~composer_join.core.catalogue.Said`, which names its
    catalogue entry). Cost: nothing outside the block."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)


def _issue(what: str) -> None:
    for listener in _LISTENERS:
        listener(what)


class TorchExchange(Exchange):
    """The real exchange: ``torch.distributed`` on the default process group (or ``group``), tensors on the trainer's
    device.

    ``to_device``: the trainer's ``state.device.tensor_to_device`` (NCCL takes CUDA tensors only); ``group``: a
    process group of every rank (FSDP's host group: gloo beside NCCL, :func:`composer_join.wrappers.fsdp.host_group`).
    """

    def __init__(self, to_device: ToDevice = lambda t: t, group: Any = None):
        self.to_device, self.group = to_device, group
        self.rank, self.world = dist.get_global_rank(), dist.get_world_size()

    def rows(self, row: Sequence[int], what: str) -> Pending:
        _issue(what)
        table, work = _exchange_rows(row, self.to_device)
        return _Rows(table, work, what)

    def reduce(self, values: torch.Tensor, op: str, what: str) -> torch.Tensor:
        """``values`` moved to the device (``to_device``), then reduced in place over every rank (blocking)."""
        _issue(what)
        values = self.to_device(values)
        with lost_peer(what):
            torch.distributed.all_reduce(values, op=_OPS[op], group=self.group)
        return values

    def host_sum(self, values: torch.Tensor, what: str, pairwise_from: Optional[int] = None) -> torch.Tensor:
        """``values`` (integers on the host, the same shape on every rank) summed over every rank, on the exchange's
        ``group`` (gloo), blocking: the sum, a new tensor.

        Under :data:`PAIRWISE_FROM` ranks (``pairwise_from``: another threshold, for tests), one all-reduce; from it,
        recursive doubling over gloo ``isend``/``irecv``: ``ceil(log2 W)`` rounds in which each rank swaps its partial
        sum with one partner, plus, where W is not a power of two, a first round in which the first ``2 (W - P)``
        ranks fold in pairs (``P``: the largest power of two below W) and a last one in which they get the sum
        back. Its latency grows with ``log2 W`` where gloo's ring grows with W. Integers only: their sum does not
        depend on the order of the additions, so every rank gets exactly the same sum.
        """
        if values.is_floating_point() or values.is_complex():
            raise TypeError(f'host_sum sums integers only (the same sum in any order), not {values.dtype}')
        _issue(what)
        threshold = PAIRWISE_FROM if pairwise_from is None else pairwise_from
        values = values.clone()
        with lost_peer(what):
            if self.world < max(threshold, 2):
                torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.SUM, group=self.group)
                return values
            return _pairwise_sum(values, self.rank, self.world, self.group)

    def gather(self, obj: Any, what: str) -> list[Any]:
        _issue(what)
        with lost_peer(what):
            return dist.all_gather_object(obj)

    def broadcast(self, obj: Any, src: int, what: str) -> Any:
        _issue(what)
        box = [obj]
        with lost_peer(what):
            dist.broadcast_object_list(box, src=src)
        return box[0]


def _pairwise_sum(values: torch.Tensor, rank: int, world: int, group: Any) -> torch.Tensor:
    """Recursive doubling (:meth:`TorchExchange.host_sum`): ``values`` summed over the ``world`` ranks of ``group``.

    Through the process group's own ``send``/``recv`` (``torch.distributed.isend`` and ``irecv`` check and map their
    arguments in Python first, which doubled the host's time per round); the group holds every rank, in order."""
    pg: Any = torch.distributed.group.WORLD if group is None else group
    incoming = torch.empty_like(values)
    power = 1 << (world.bit_length() - 1)  # the largest power of two <= world
    folded = world - power  # ranks 0, 2, ..., 2 * folded - 2 give their values to the next rank and wait for the sum
    if rank < 2 * folded and rank % 2 == 0:
        pg.send([values], rank + 1, _PAIRWISE_TAG).wait()
        pg.recv([values], rank + 1, _PAIRWISE_TAG).wait()
        return values
    if rank < 2 * folded:
        pg.recv([incoming], rank - 1, _PAIRWISE_TAG).wait()
        values += incoming
    own = rank // 2 if rank < 2 * folded else rank - folded  # this rank among the ``power`` that double
    bit = 1
    while bit < power:
        other = own ^ bit
        peer = 2 * other + 1 if other < folded else other + folded
        sent, got = pg.send([values], peer, _PAIRWISE_TAG), pg.recv([incoming], peer, _PAIRWISE_TAG)
        sent.wait()
        got.wait()
        values += incoming
        bit <<= 1
    if rank < 2 * folded:
        pg.send([values], rank - 1, _PAIRWISE_TAG).wait()
    return values


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
    _issue(FIRST_AGREEMENT.said(f'the first agreement of {facts.label!r}'))
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
