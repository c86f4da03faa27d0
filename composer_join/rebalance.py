"""Rebalancing: ranks that run out of data train batches that other ranks still have, so no rank idles.

:class:`RebalancingLoader` sits *beneath* the :class:`~composer_join.loader.JoinLoader`: it wraps
one rank's own dataloader and yields the batches this rank trains, its own and those handed to it
by other ranks. Its ``len()`` is this rank's assigned count, so the JoinLoader above it (per-step
agreement, shadowing of the last step, gradient weighting) works unchanged.

The schedule (:func:`schedule`) is computed identically on every rank from every rank's batch
count ``n_r`` (their ``len()``, exchanged once per fit), with no further communication:

    ``R_r = n_r`` batches remain on rank ``r``. At each step, while some ``R_r > 0``:

    1. every rank with ``R_r >= 1`` trains its next own batch (``R_r -= 1``);
    2. every other rank (it had ``R_r = 0``), in increasing rank order, is given one batch by the
       rank with the most batches remaining now (ties to the lowest rank), if that is at least
       one: the donor's next own batch (``R_donor -= 1``); if no rank has one left, it shadows.

Each step trains ``min(W, batches remaining)`` batches, so an epoch lasts ``ceil(sum n_r / W)``
steps, and only its last step can have shadowing ranks. A donor reads its own batches in order:
first the one it trains, then those it gives, to the receivers in increasing rank order.

Transfers happen inside ``next()``, which the JoinLoader calls once per step on every rank that
still has assigned batches (for step ``t + 1``, during step ``t``): the donor sends, the receiver
receives, point to point, in the order above. A transfer is a length prefix, a small pickled
header (the batch's structure, its non-tensor content, each tensor's shape and dtype) and one
``send`` per tensor, on the trainer's device (``state.device.tensor_to_device``: the CPU for gloo,
the GPU for NCCL), so the received batch is already where the trainer wants it. Non-tensor
content (e.g. lists of strings) travels in the header. If a donor cannot read or pickle a batch
it sends a failure header instead, and both ranks raise; the JoinLoader's agreement then stops
every rank, so nothing hangs.

Example (what :func:`~composer_join.loader.join_dataloader` does in ``mode='rebalance'``)::

    loader = RebalancingLoader(own_dataloader, counts=[10, 5], own_len=len(own_dataloader))
    loader.length  # 8 steps per epoch on every rank: ceil(15 / 2)
    len(loader)    # this rank's batches: 8 on rank 0 (2 of its 10 given away), 7 on rank 1 (2 received)
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from composer.utils import dist

from composer_join.batches import map_tensors
from composer_join.errors import UnevenInputsError
from composer_join.plan import len_or_none
from composer_join.report import EpochReport

__all__ = ['RebalancingLoader', 'rebalanced', 'schedule']

log = logging.getLogger(__name__)

Cell = Optional[tuple[int, int]]  # (owner rank, index of the batch in the owner's shard), or None: shadow


def schedule(counts: list[int]) -> list[list[Cell]]:
    """Who trains which batch at every step of an epoch (the rules in the module docstring).

    Returns, per step, per rank, ``(owner, index)`` of the batch that rank trains, or ``None``
    if it shadows. Cost: ``O(steps * W^2)``, once per fit.

    Example:
        >>> schedule([3, 0])
        [[(0, 0), (0, 1)], [(0, 2), None]]
    """
    world = len(counts)
    taken = [0] * world  # batches of each rank's shard handed out so far
    steps = []
    while any(t < n for t, n in zip(taken, counts)):
        row: list[Cell] = [None] * world
        idle = []
        for r in range(world):
            if taken[r] < counts[r]:
                row[r] = (r, taken[r])
                taken[r] += 1
            else:
                idle.append(r)
        for r in idle:
            donor = max(range(world), key=lambda d: (counts[d] - taken[d], -d))
            if counts[donor] > taken[donor]:
                row[r] = (donor, taken[donor])
                taken[donor] += 1
        steps.append(row)
    return steps


_OK, _FAILED = 0, 1


class RebalancingLoader:
    """This rank's batches under the rebalancing :func:`schedule`: its own, minus those it gives, plus those received.

    Args:
        dataloader: this rank's own dataloader; it must yield exactly ``counts[rank]`` batches
            per epoch (more, if ``own_len`` is larger: only the first ``counts[rank]`` are used).
        counts: every rank's batches per epoch (the same list on every rank).
        own_len: ``len(dataloader)``; if it equals ``counts[rank]``, a dataloader that yields
            more than that is an error (its extra batches would be lost).
        to_device: where transferred tensors go (the trainer's device).

    Attributes:
        bytes_sent, bytes_received: bytes moved by this rank in the current epoch.
    """

    def __init__(
        self,
        dataloader: Iterable,
        counts: list[int],
        own_len: Optional[int] = None,
        to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ):
        self.dataloader = dataloader
        self.counts = list(counts)
        self.rank = dist.get_global_rank()
        self.steps = schedule(self.counts)
        self.check_overflow = own_len == self.counts[self.rank]
        self.to_device = to_device
        self.bytes_sent = 0
        self.bytes_received = 0
        self.assigned = [sum(1 for row in self.steps if row[r] is not None) for r in range(len(self.counts))]
        """Every rank's batches per epoch under the schedule, own and received."""

    def __len__(self) -> int:
        return self.assigned[self.rank]

    @property
    def length(self) -> int:
        """Steps per epoch on every rank: the longest assigned count."""
        return len(self.steps)

    def counts_per_rank(self) -> dict[str, list[int]]:
        """Per rank: batches trained from its own shard, received, given away (from the schedule)."""
        world = len(self.counts)
        own, received, given = [0] * world, [0] * world, [0] * world
        for row in self.steps:
            for r, cell in enumerate(row):
                if cell is None:
                    continue
                if cell[0] == r:
                    own[r] += 1
                else:
                    received[r] += 1
                    given[cell[0]] += 1
        return {'own_batches': own, 'received_batches': received, 'given_batches': given}

    def complete(self, report: EpochReport) -> None:
        """Fill the rebalancing fields of this epoch's ``report``, the same on every rank.

        Called on every rank at ``EPOCH_END``: one all-reduce of ``W`` integers (the bytes each rank sent).
        """
        sent = torch.zeros(len(self.counts), dtype=torch.int64)
        sent[self.rank] = self.bytes_sent
        sent = self.to_device(sent)
        dist.all_reduce(sent, reduce_operation='SUM')
        counts = self.counts_per_rank()
        report.own_batches, report.received_batches, report.given_batches = (
            counts['own_batches'], counts['received_batches'], counts['given_batches'])
        report.bytes_sent = [int(v) for v in sent.cpu().tolist()]

    def __iter__(self) -> Iterator[Any]:
        self.bytes_sent = self.bytes_received = 0
        reader = _Reader(self.dataloader, self.counts[self.rank], self.check_overflow)
        for step, row in enumerate(self.steps):
            cell = row[self.rank]
            if cell is None:
                return
            if cell[0] != self.rank:
                yield self._receive(cell[0], step)
                continue
            receivers = [q for q, c in enumerate(row) if c is not None and c[0] == self.rank and q != self.rank]
            failure: Optional[BaseException] = None
            batches: list[Any] = []
            try:
                for _ in range(1 + len(receivers)):
                    batches.append(reader.next())
                reader.check_end()
            except Exception as e:  # the receivers must hear of it, or they would wait forever
                failure = e
            for i, q in enumerate(receivers):
                refused = self._send(batches[i + 1] if failure is None else None, q, step)
                failure = failure or refused
            if failure is not None:
                raise failure
            yield batches[0]

    def _send(self, batch: Any, dst: int, step: int) -> Optional[Exception]:
        """Send ``batch`` to rank ``dst`` (``None``: a failure header); return why it could not be sent, if so.

        Everything that can fail locally (pickling, copying to the device) happens before the first
        message, so a receiver is never left waiting in the middle of a batch.
        """
        tensors: list[torch.Tensor] = []
        status, header, refused = _FAILED, b'', None
        if batch is not None:

            def take(t: torch.Tensor) -> torch.Tensor:
                if t.layout != torch.strided:
                    raise TypeError(f'a {t.layout} tensor cannot be sent')
                tensors.append(self.to_device(t.detach().contiguous()))
                return torch.empty(0, dtype=t.dtype)

            try:
                skeleton = map_tensors(take, batch)
                header = pickle.dumps((skeleton, [(tuple(t.shape), t.dtype) for t in tensors]), pickle.HIGHEST_PROTOCOL)
                status = _OK
            except Exception as e:  # e.g. something in the batch that pickle refuses
                refused = UnevenInputsError(
                    f'rank {self.rank} cannot send the batch rank {dst} is to train at step {step}: '
                    f'{type(e).__name__}: {e}. mode=\'rebalance\' moves dense tensors and picklable objects only; '
                    f'use mode=\'shadow\' for such batches.',
                )
                tensors = []
        prefix = torch.tensor([status, len(header)], dtype=torch.int64)
        torch.distributed.send(self.to_device(prefix), dst)
        self.bytes_sent += prefix.numel() * prefix.element_size()
        if status != _OK:
            return refused
        torch.distributed.send(self.to_device(torch.frombuffer(bytearray(header), dtype=torch.uint8)), dst)
        self.bytes_sent += len(header)
        for t in tensors:
            if t.numel():  # an empty tensor is rebuilt from its shape alone
                torch.distributed.send(t, dst)
                self.bytes_sent += t.numel() * t.element_size()
        return None

    def _receive(self, src: int, step: int) -> Any:
        prefix = self.to_device(torch.zeros(2, dtype=torch.int64))
        torch.distributed.recv(prefix, src)
        status, size = (int(v) for v in prefix.cpu().tolist())
        self.bytes_received += prefix.numel() * prefix.element_size()
        if status != _OK:
            raise UnevenInputsError(
                f'rank {src} could not read or send the batch that rank {self.rank} was to train at step {step} '
                f'(rank {src} raises the cause)',
            )
        header = self.to_device(torch.empty(size, dtype=torch.uint8))
        torch.distributed.recv(header, src)
        self.bytes_received += size
        skeleton, specs = pickle.loads(header.cpu().numpy().tobytes())
        received = []
        for shape, dtype in specs:
            t = self.to_device(torch.empty(shape, dtype=dtype))
            if t.numel():
                torch.distributed.recv(t, src)
                self.bytes_received += t.numel() * t.element_size()
            received.append(t)
        slots = iter(received)
        return map_tensors(lambda _: next(slots), skeleton)


class _Reader:
    """Reads this rank's own batches in order, checking the dataloader against its promised count."""

    def __init__(self, dataloader: Iterable, count: int, check_overflow: bool):
        self.dataloader, self.count, self.check_overflow = dataloader, count, check_overflow
        self._it: Optional[Iterator] = None
        self.read = 0

    def next(self) -> Any:
        if self._it is None:
            self._it = iter(self.dataloader)
        try:
            batch = next(self._it)
        except StopIteration:
            raise UnevenInputsError(
                f'rank {dist.get_global_rank()}\'s dataloader yielded {self.read} batches, but its len() promised '
                f'{self.count}; UnevenJoin(mode=\'rebalance\') plans every rank\'s batches from the len()s, so they '
                f'must be exact (or use mode=\'shadow\')',
            ) from None
        self.read += 1
        return batch

    def check_end(self) -> None:
        """After the last promised batch: fail if the dataloader has more (they would be silently dropped)."""
        if self.read == self.count and self.check_overflow and self._it is not None:
            try:
                next(self._it)
            except StopIteration:
                return
            raise UnevenInputsError(
                f'the dataloader of rank {dist.get_global_rank()} yielded more than the {self.count} batches per '
                f'epoch its len() promised; the extra batches would be silently dropped. Make __len__ match what '
                f'it yields.',
            )


def rebalanced(
    dataloader: Iterable,
    counts: list[Optional[int]],
    shared: Optional[int],
    check_overflow: bool,
    to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> tuple[Iterable, Optional[int], bool, list[Optional[int]]]:
    """``(dataloader, shared length, check_overflow, every rank's length)`` for the JoinLoader, rebalanced if possible.

    The lengths are then every rank's assigned count (:attr:`RebalancingLoader.assigned`), from
    which the JoinLoader plans the steps before the shortest one's last batch without agreeing.

    ``counts`` are every rank's batches per epoch (from the length agreement). If some rank's is
    unknown (an ``IterableDataset`` without ``__len__``), nobody can tell who has surplus, so this
    logs a warning and returns the arguments unchanged: the epoch is shadowed as in ``mode='shadow'``.
    """
    if any(n is None for n in counts):
        if dist.get_global_rank() == 0:
            log.warning(
                "UnevenJoin(mode='rebalance'): the train dataloader of rank(s) %s has no len(), so batches cannot "
                "be planned ahead; falling back to shadowing (mode='shadow') for this fit.",
                [r for r, n in enumerate(counts) if n is None],
            )
        return dataloader, shared, check_overflow, counts
    loader = RebalancingLoader(dataloader, counts, len_or_none(dataloader), to_device)  # type: ignore[arg-type]  # no None
    return loader, loader.length, False, loader.assigned  # type: ignore[return-value]
