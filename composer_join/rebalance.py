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
``send`` of every tensor's raw bytes (``uint8``, each tensor 16-byte aligned; NCCL has no int16,
uint16, uint32 or uint64, bytes carry every dtype), on the trainer's device
(``state.device.tensor_to_device``: the CPU for gloo, the GPU for NCCL). The receiver allocates
straight on that device and views the bytes as the tensors, so the received batch is already where
the trainer wants it, with no copy. Non-tensor
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
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

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


_OK, _FAILED, _NONE = 0, 1, 2  # a transfer's status: a batch follows; the sender failed; no batch (receiver idles)
_ALIGN = 16  # bytes: every tensor's place in a transfer's payload is a multiple of this (complex128's size)


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
        # Resumption by a dataset that resumes itself (Composer's dataset_state): the JoinLoader sets
        # ``start`` (the step the dataset resumed at) before each iteration, and the algorithm
        # ``resumed_samples`` (own samples used before it); ``count`` counts a batch's samples.
        self.start = 0
        self.resumed_samples = 0
        self.resumed_bytes = 0  # bytes this rank sent in the epoch before the step it resumed at
        self.count: Callable[[Any], int] = lambda batch: 0
        self._read_samples: dict[int, int] = {}  # step -> samples of own batches read for it (trained or given)
        self._sent: dict[int, int] = {}  # step -> bytes sent for it

    def sent_bytes(self, steps: int) -> int:
        """Bytes this rank sent for the first ``steps`` steps of the epoch (batches are sent a step ahead)."""
        return (self.resumed_bytes if self.start else 0) + sum(n for s, n in self._sent.items() if s < steps)

    def consumed_samples(self, steps: int) -> int:
        """Samples of this rank's own dataloader used by the first ``steps`` steps of the epoch (-1: uncountable)."""
        read = [n for s, n in self._read_samples.items() if s < steps]
        base = self.resumed_samples if self.start else 0
        return -1 if min([base, *read]) < 0 else base + sum(read)

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
            counts['own_batches'],
            counts['received_batches'],
            counts['given_batches'],
        )
        report.bytes_sent = [int(v) for v in sent.cpu().tolist()]

    def __iter__(self) -> Iterator[Any]:
        self.bytes_sent, self.bytes_received = self.resumed_bytes if self.start else 0, 0
        self._read_samples, self._sent = {}, {}
        reader = _Reader(self.dataloader, self.counts[self.rank], self.check_overflow)
        reader.read = sum(1 for row in self.steps[: self.start] for c in row if c is not None and c[0] == self.rank)
        if self.start:  # a dataset that resumed itself applies its state at its next iteration: this one
            reader._it = iter(self.dataloader)
        for step, row in enumerate(self.steps):
            if step < self.start:
                continue
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
                counts = [self.count(b) for b in batches]
                self._read_samples[step] = -1 if min(counts) < 0 else sum(counts)
                reader.check_end()
            except Exception as e:  # the receivers must hear of it, or they would wait forever
                failure = e
            before = self.bytes_sent
            for i, q in enumerate(receivers):
                refused = self._send(batches[i + 1] if failure is None else None, q, step)
                failure = failure or refused
            self._sent[step] = self.bytes_sent - before
            if failure is not None:
                raise failure
            yield batches[0]

    def _send(self, batch: Any, dst: int, step: int) -> Optional[Exception]:
        """Send ``batch`` to rank ``dst`` (``None``: a failure header); return why it could not be sent, if so.

        Everything that can fail locally (:meth:`_pack`) happens before the first message, so a
        receiver is never left waiting in the middle of a batch; a batch that cannot be sent goes
        out as a failure header, on which the receiver raises.
        """
        if batch is None:
            self._transmit(_FAILED, dst)
            return None
        try:
            packed = self._pack(batch)
        except Exception as e:  # e.g. something in the batch that pickle refuses
            self._transmit(_FAILED, dst)
            return UnevenInputsError(
                f'rank {self.rank} cannot send the batch rank {dst} is to train at step {step}: '
                f"{type(e).__name__}: {e}. mode='rebalance' moves dense tensors and picklable objects only; "
                f"use mode='shadow' for such batches.",
            )
        self._transmit(_OK, dst, *packed)
        return None

    def _pack(self, batch: Any) -> tuple[bytes, Optional[torch.Tensor]]:
        """``batch`` as ``(header, payload)``, on the trainer's device; raises if it cannot be sent.

        The header pickles the batch's structure, non-tensor content and tensor specs. Tensors
        travel as raw bytes (one ``uint8`` payload for the whole batch, reinterpreted on arrival):
        NCCL has no int16, uint16, uint32 or uint64, and bytes carry every dtype alike. Only dense
        tensors and picklable objects can be sent.
        """
        payload: list[torch.Tensor] = []
        specs: list[tuple[tuple[int, ...], torch.dtype]] = []

        def take(t: torch.Tensor) -> torch.Tensor:
            if t.layout != torch.strided or t.is_quantized:
                raise TypeError(f'a {"quantized" if t.is_quantized else t.layout} tensor cannot be sent')
            specs.append((tuple(t.shape), t.dtype))
            if t.numel():  # an empty tensor is rebuilt from its shape alone
                raw = _as_bytes(self.to_device(t.detach()))
                payload.append(raw)
                if raw.numel() % _ALIGN:  # each tensor starts aligned, so it can be viewed in place on arrival
                    payload.append(raw.new_zeros(_ALIGN - raw.numel() % _ALIGN))
            return torch.empty(0, dtype=torch.uint8)  # a placeholder (torch cannot unpickle e.g. uint16 ones)

        skeleton = map_tensors(take, batch)
        header = pickle.dumps((skeleton, specs), pickle.HIGHEST_PROTOCOL)
        return header, torch.cat(payload) if len(payload) > 1 else payload[0] if payload else None

    def _transmit(self, status: int, dst: int, header: bytes = b'', data: Optional[torch.Tensor] = None) -> None:
        """The messages of one transfer: ``[status, header length]``, then (``_OK``) the header and the payload."""
        prefix = torch.tensor([status, len(header)], dtype=torch.int64)
        torch.distributed.send(self.to_device(prefix), dst)
        self.bytes_sent += prefix.numel() * prefix.element_size()
        if status != _OK:
            return
        torch.distributed.send(self.to_device(torch.frombuffer(bytearray(header), dtype=torch.uint8)), dst)
        self.bytes_sent += len(header)
        if data is not None:
            torch.distributed.send(data, dst)
            self.bytes_sent += data.numel()

    def _receive(self, src: int, step: int) -> Any:
        """Receive a batch from rank ``src``, straight into memory on the trainer's device.

        ``None`` if ``src`` sent that there is no batch (only read-ahead rebalancing does: the
        receiver idles this step); raises if ``src`` failed to read or send it.
        """
        device = self._device()
        prefix = torch.zeros(2, dtype=torch.int64, device=device)
        torch.distributed.recv(prefix, src)
        status, size = (int(v) for v in prefix.cpu().tolist())
        self.bytes_received += prefix.numel() * prefix.element_size()
        if status == _NONE:
            return None
        if status != _OK:
            raise UnevenInputsError(
                f'rank {src} could not read or send the batch that rank {self.rank} was to train at step {step} '
                f'(rank {src} raises the cause)',
            )
        header = torch.empty(size, dtype=torch.uint8, device=device)
        torch.distributed.recv(header, src)
        self.bytes_received += size
        skeleton, specs = pickle.loads(header.cpu().numpy().tobytes())
        sizes = [_nbytes(shape, dtype) for shape, dtype in specs]
        data = torch.empty(sum(n + (-n) % _ALIGN for n in sizes), dtype=torch.uint8, device=device)
        if data.numel():
            torch.distributed.recv(data, src)
            self.bytes_received += data.numel()
        received, offset = [], 0
        for (shape, dtype), n in zip(specs, sizes):
            if n:
                received.append(data[offset : offset + n].view(dtype).view(shape))
            else:
                received.append(torch.empty(shape, dtype=dtype, device=device))
            offset += n + (-n) % _ALIGN
        slots = iter(received)
        return map_tensors(lambda _: next(slots), skeleton)

    def _device(self) -> torch.device:
        """The trainer's device, where received batches are allocated (found once)."""
        if getattr(self, '_on', None) is None:
            self._on = self.to_device(torch.empty(0)).device
        return self._on


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s contents as a flat ``uint8`` tensor (a view if ``t`` is contiguous, else one copy)."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * torch.empty(0, dtype=dtype).element_size()


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
                f"rank {dist.get_global_rank()}'s dataloader yielded {self.read} batches, but its len() promised "
                f"{self.count}; UnevenJoin(mode='rebalance') plans every rank's batches from the len()s, so they "
                f"must be exact (or use mode='shadow')",
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
    unknown (an ``IterableDataset`` without ``__len__``), no schedule can be planned: this logs a
    warning and returns the arguments unchanged (shadowing). :func:`~composer_join.loader.join_dataloader`
    does not call it then: it uses :mod:`composer_join.readahead`, which rebalances step by step.
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
