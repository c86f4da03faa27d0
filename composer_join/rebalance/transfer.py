"""Moving one batch from one rank to another, point to point: the transfer protocol of rebalancing.

A :class:`BatchChannel` sends and receives whole batches (any structure of tensors and picklable
objects) between two ranks with ``torch.distributed.send`` / ``recv``. Both rebalancers own one:
:class:`~composer_join.rebalance.rebalance.RebalancingLoader` (the planned schedule) and
:class:`~composer_join.rebalance.readahead.ReadAheadRebalancer` (without ``len()``), through their base
:class:`~composer_join.rebalance.rebalance.Rebalancer`. They call it inside the ``next()`` the
:class:`~composer_join.join.iterator.JoinLoader` calls once per step: a donor sends, a receiver receives.

The wire format of one transfer, in this order (both sides must post the same messages, or
NCCL and gloo point to point hang):

1. ``[status, header length]``: two ``int64``. ``status`` is ``_OK`` (a batch follows),
   ``_FAILED`` (the sender could not read or send it: the receiver raises) or ``_NONE`` (no batch:
   the receiver idles this step; only read-ahead rebalancing sends it). Only ``_OK`` is followed
   by more messages.
2. the header: a pickle (``uint8``) of the batch's structure, with every tensor replaced by a
   placeholder, its non-tensor content (e.g. lists of strings), and each tensor's shape and dtype.
3. the payload, if some tensor is not empty: one ``uint8`` tensor holding every tensor's raw
   bytes in order, each starting at a multiple of 16 bytes (:data:`_ALIGN`, the largest element
   size, complex128's), so the receiver views each tensor in place, with no copy.

Every message travels on a process group of its own (:func:`transfer_group`): over every rank, with the
default group's backend and timeout, made once per process. A point-to-point message advances the
sequence number of its group on the two ranks it joins only, so on the default group the ranks not
in a transfer would fall behind, and ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which compares every
collective's sequence number, operation, shapes and dtypes on every rank first) would stop the next
collective (``Sequence number: 10 vs 7``). No collective ever runs on the transfer group, so its
sequence numbers may differ freely; under NCCL it also keeps the transfers off the communicator of the
gradient all-reduce.

Tensors travel as raw bytes because NCCL has no int16, uint16, uint32 or uint64, and bytes carry
every dtype alike. Every message is on the trainer's device (``state.device.tensor_to_device``:
the CPU for gloo, the GPU for NCCL), and the receiver allocates straight on it, so a received
batch is already where the trainer wants it. Only dense tensors and picklable objects can be sent;
:meth:`BatchChannel.pack` does everything that can fail before the first message, so a receiver
is never left waiting in the middle of a batch.

Cost per transfer: the batch's bytes (one copy on the sender for a non-contiguous tensor or
padding, none on the receiver), a header of about 1 kB (it grows with the number of tensors and
the non-tensor content), 16 bytes for the prefix; at most three ``send``/``recv`` pairs (one for "no
batch" or a failure).

Example (two ranks; rank 1 trains a batch of rank 0)::

    channel = BatchChannel(state.device.tensor_to_device)  # on every rank: the first one makes the transfer group
    if rank == 0:
        error = channel.send(batch, dst=1, step=7)  # an UnevenInputsError if it cannot be sent
    else:
        batch = channel.receive(src=0, step=7)      # None if rank 0 sent "no batch"
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from composer.utils import dist

from composer_join.core import compat
from composer_join.core.batches import map_tensors
from composer_join.core.errors import UnevenInputsError
from composer_join.core.peers import lost_peer

__all__ = ['BatchChannel', 'Packed', 'Wire', 'transfer_group']

_OK, _FAILED, _NONE = 0, 1, 2  # a transfer's status: a batch follows; the sender failed; no batch (receiver idles)
_ALIGN = 16  # bytes: every tensor's place in a transfer's payload is a multiple of this (complex128's size)


class Packed(NamedTuple):
    """A batch ready to send (:meth:`BatchChannel.pack`): its pickled header and its tensors' bytes."""

    header: bytes
    payload: Optional[torch.Tensor]  # uint8 on the trainer's device; None if the batch has no non-empty tensor


_GROUP: list = []  # [(the default group, the transfer group made beside it)], once made in this process


def transfer_group() -> Optional[torch.distributed.ProcessGroup]:
    """The process group rebalancing's transfers travel on: every rank, the default group's backend and timeout.

    Made once per process (again only if the default group was replaced), on the first call, which
    must come on every rank at the same point: ``torch.distributed.new_group`` is collective.
    :class:`BatchChannel` calls it when it is built, in the rebalancer that ``join_dataloader`` makes
    on every rank at ``FIT_START``, after the length agreement. Its ranks are the global ranks, in
    order, so a global rank is also the peer's rank in it. ``None`` without an initialised default
    group (one process: nothing to transfer).

    Cost: once per process, what ``new_group`` costs (gloo: a connection between every pair of ranks;
    NCCL: the communicators of the pairs that exchange batches, made at their first transfer).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    default = torch.distributed.group.WORLD
    if not _GROUP or _GROUP[0][0] is not default:
        # backend=None: the default group's, so NCCL transfers stay on the GPU. The timeout must be given: new_group
        # would take torch's default (30 min on gloo) rather than the one the trainer's group was made with.
        group = torch.distributed.new_group(backend=None, timeout=compat.group_timeout(default))
        _GROUP[:] = [(default, group)]
    return _GROUP[0][1]


class Wire:
    """Where a channel's messages travel: ``torch.distributed`` point to point on :func:`transfer_group` (made when the
    first one is built: collective). Tests pass one of their own (``tests/lockstep.py``: W ranks in one process).

    Attributes:
        rank: this rank.
        group: the process group the messages travel on.
    """

    def __init__(self) -> None:
        self.rank = dist.get_global_rank()
        self.group = transfer_group()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        torch.distributed.send(tensor, dst, group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        torch.distributed.recv(tensor, src, group=self.group)


class BatchChannel:
    """This rank's end of the point-to-point batch transfers (the wire format is in the module docstring).

    Building one is collective the first time in a process (its :class:`Wire` makes :func:`transfer_group`): every
    rank builds its own at the same point.

    Args:
        to_device: the trainer's device, where every message goes and received batches are allocated.
        wire: where the messages travel (default: a :class:`Wire` on :func:`transfer_group`).

    Attributes:
        group: the process group every message travels on (:func:`transfer_group`).
        bytes_sent, bytes_received: bytes this rank moved through it (prefixes and headers
            included); its owner resets them at every epoch's start.
    """

    def __init__(self, to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, wire: Optional[Wire] = None):
        self.to_device = to_device
        self.wire = wire if wire is not None else Wire()
        self.rank, self.group = self.wire.rank, self.wire.group
        self.bytes_sent = 0
        self.bytes_received = 0
        self._on: Optional[torch.device] = None

    def send(self, batch: Any, dst: int, step: int) -> Optional[Exception]:
        """Send ``batch`` to rank ``dst`` (``None``: a failure); return why it could not be sent, if so.

        A batch that cannot be sent (:meth:`pack` raises) goes out as a failure, on which the
        receiver raises; the returned :class:`~composer_join.core.errors.UnevenInputsError` (for rank
        ``dst``'s batch of ``step``) is for the sender to raise.
        """
        if batch is None:
            self._transmit(_FAILED, dst)
            return None
        try:
            packed = self.pack(batch)
        except Exception as e:  # e.g. something in the batch that pickle refuses
            self._transmit(_FAILED, dst)
            return UnevenInputsError(
                f'rank {self.rank} cannot send the batch rank {dst} is to train at step {step}: '
                f"{type(e).__name__}: {e}. mode='rebalance' moves dense tensors and picklable objects only; "
                f"use mode='shadow' for such batches.",
            )
        self.send_packed(packed, dst)
        return None

    def send_packed(self, packed: Packed, dst: int) -> None:
        """Send a batch :meth:`pack` made to rank ``dst``."""
        self._transmit(_OK, dst, packed.header, packed.payload)

    def send_nothing(self, dst: int) -> None:
        """Tell rank ``dst`` there is no batch for it (its :meth:`receive` returns ``None``)."""
        self._transmit(_NONE, dst)

    def pack(self, batch: Any) -> Packed:
        """``batch`` ready to send, on the trainer's device; raises if it cannot be sent.

        The header pickles the batch's structure, non-tensor content and tensor specs. Tensors
        travel as raw bytes (one ``uint8`` payload for the whole batch, reinterpreted on arrival).
        Only dense tensors and picklable objects can be sent.
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
        return Packed(header, torch.cat(payload) if len(payload) > 1 else payload[0] if payload else None)

    def receive(self, src: int, step: int) -> Any:
        """Receive a batch from rank ``src``, straight into memory on the trainer's device.

        ``None`` if ``src`` sent that there is no batch (:meth:`send_nothing`: the receiver idles
        this step); raises :class:`~composer_join.core.errors.UnevenInputsError` if ``src`` failed to
        read or send the batch this rank was to train at ``step``.
        """
        with lost_peer(f'receiving the batch rank {self.rank} trains at step {step}', [src]):
            return self._receive(src, step)

    def _receive(self, src: int, step: int) -> Any:
        device = self._device()
        prefix = torch.zeros(2, dtype=torch.int64, device=device)
        self.wire.recv(prefix, src)
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
        self.wire.recv(header, src)
        self.bytes_received += size
        skeleton, specs = pickle.loads(header.cpu().numpy().tobytes())
        sizes = [_nbytes(shape, dtype) for shape, dtype in specs]
        data = torch.empty(sum(n + (-n) % _ALIGN for n in sizes), dtype=torch.uint8, device=device)
        if data.numel():
            self.wire.recv(data, src)
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

    def _transmit(self, status: int, dst: int, header: bytes = b'', data: Optional[torch.Tensor] = None) -> None:
        """The messages of one transfer: ``[status, header length]``, then (``_OK``) the header and the payload."""
        with lost_peer(f'sending a batch to rank {dst}', [dst]):
            self._send(status, dst, header, data)

    def _send(self, status: int, dst: int, header: bytes, data: Optional[torch.Tensor]) -> None:
        prefix = torch.tensor([status, len(header)], dtype=torch.int64)
        self.wire.send(self.to_device(prefix), dst)
        self.bytes_sent += prefix.numel() * prefix.element_size()
        if status != _OK:
            return
        header_bytes = self.to_device(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self.wire.send(header_bytes, dst)
        self.bytes_sent += len(header)
        if data is not None:
            self.wire.send(data, dst)
            self.bytes_sent += data.numel()

    def _device(self) -> torch.device:
        """The trainer's device, where received batches are allocated (found once)."""
        if self._on is None:
            self._on = self.to_device(torch.empty(0)).device
        return self._on


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s contents as a flat ``uint8`` tensor (a view if ``t`` is contiguous, else one copy)."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    numel = 1
    for n in shape:
        numel *= n
    return numel * torch.empty(0, dtype=dtype).element_size()
