"""W simulated ranks in one process, in lockstep: the join's exchange without a process group.

Each rank runs on a thread of its own with its own :class:`RankExchange` (a
:class:`composer_join.core.protocol.Exchange`). Collectives meet in order, as on real ranks: every rank's k-th
collective is matched with every other rank's k-th. Where two ranks' k-th collectives differ (kind, what they say
they are, or row length) every rank waiting there fails with :class:`Mismatch`, as ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
does; where a rank waits for a rank that has finished (returned or raised) without issuing that collective, it fails
with :class:`Hang` at once (on real ranks: a hang on NCCL, a broken connection on gloo), or after ``timeout`` seconds
if the other rank is still running. ``exchange.rows`` starts an exchange and returns at once; its ``wait`` blocks, so
an agreement started a step ahead overlaps other collectives exactly as an asynchronous all-reduce does.

:func:`run` runs ``fn(rank, exchange)`` on every rank and returns each rank's result or exception, and the
collectives each rank issued (:attr:`Lockstep.issued`), in order, by what they said they were.

Point-to-point messages (a rebalancer's transfers, through :class:`QueueWire`) are queued per sender and receiver:
a receive waits for the next message from its sender, which must have the shape and dtype it expects
(:class:`Mismatch` otherwise), or fails with :class:`Hang` where the sender finished without sending it; a message
never received is left in :attr:`Lockstep.undelivered`.

Example:
    >>> def fn(rank, lockstep):
    ...     return lockstep.exchange(rank).rows([rank, 10 * rank], 'two columns').wait()
    >>> results, lockstep = run(2, fn)
    >>> results, lockstep.issued
    ([[[0, 0], [1, 10]], [[0, 0], [1, 10]]], [['two columns'], ['two columns']])
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from composer_join.core.protocol import Exchange, Pending
from composer_join.rebalance.transfer import Wire

__all__ = ['Hang', 'Lockstep', 'Mismatch', 'QueueWire', 'RankExchange', 'run']


class Hang(RuntimeError):
    """A rank waits in a collective some rank never issues."""


class Mismatch(RuntimeError):
    """Ranks issued different collectives at the same point."""


class Lockstep:
    """The meeting point of W simulated ranks' collectives (see the module docstring)."""

    def __init__(self, world: int, timeout: float = 20.0):
        self.world, self.timeout = world, timeout
        self.issued: list[list[str]] = [[] for _ in range(world)]
        self._slots: list[dict[int, tuple[str, Any]]] = []  # per collective index, per rank: (kind, payload)
        self._mail: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._done = [False] * world
        self._cond = threading.Condition()

    def exchange(self, rank: int) -> RankExchange:
        return RankExchange(self, rank)

    def wire(self, rank: int) -> QueueWire:
        return QueueWire(self, rank)

    @property
    def undelivered(self) -> dict[tuple[int, int], int]:
        """Point-to-point messages sent and never received, per (sender, receiver): none, if the ranks agreed."""
        return {pair: len(queue) for pair, queue in self._mail.items() if queue}

    def send(self, src: int, dst: int, tensor: torch.Tensor) -> None:
        with self._cond:
            self._mail[(src, dst)].append(tensor.detach().clone())
            self._cond.notify_all()

    def recv(self, dst: int, src: int, into: torch.Tensor) -> None:
        """Receive into ``into`` rank ``src``'s next message to ``dst``, which must have its shape and dtype."""
        with self._cond:
            queue = self._mail[(src, dst)]
            if not self._cond.wait_for(lambda: bool(queue) or self._done[src], self.timeout):
                raise Hang(f'rank {dst} waited {self.timeout} s for a message from rank {src}')
            if not queue:
                raise Hang(f'rank {dst} waits for a message from rank {src}, which finished without sending it')
            message = queue.popleft()
        if (message.shape, message.dtype) != (into.shape, into.dtype):
            raise Mismatch(
                f'rank {dst} received {message.dtype}{list(message.shape)} from {src}, expected {into.dtype}{list(into.shape)}'
            )
        into.copy_(message)

    def finished(self, rank: int) -> None:
        """Rank ``rank`` issues no more collectives (its function returned or raised)."""
        with self._cond:
            self._done[rank] = True
            self._cond.notify_all()

    def post(self, rank: int, kind: str, payload: Any) -> int:
        """Rank ``rank`` issues its next collective; returns its index."""
        with self._cond:
            index = len(self.issued[rank])
            self.issued[rank].append(kind)
            while len(self._slots) <= index:
                self._slots.append({})
            self._slots[index][rank] = (kind, payload)
            self._cond.notify_all()
            return index

    def meet(self, rank: int, index: int) -> list[Any]:
        """Wait until every rank issued collective ``index``; every rank's payload, checked to be the same kind."""
        with self._cond:
            slot = self._slots[index]

            def missing() -> list[int]:
                return [r for r in range(self.world) if r not in slot]

            if not self._cond.wait_for(lambda: not missing() or any(self._done[r] for r in missing()), self.timeout):
                raise Hang(
                    f'rank {rank} waited {self.timeout} s in {slot[rank][0]!r} (collective {index}) for {missing()}'
                )
            if missing():
                raise Hang(
                    f'rank {rank} waits in {slot[rank][0]!r} (collective {index}) for rank(s) {missing()}, which '
                    f'finished without issuing it; they issued {[self.issued[r][index:] for r in missing()]}'
                )
            kinds = {kind for kind, _ in slot.values()}
            if len(kinds) > 1:
                raise Mismatch(f'collective {index}: ranks issued different collectives: {sorted(kinds)}')
            return [slot[r][1] for r in range(self.world)]


class _Rows(Pending):
    def __init__(self, lockstep: Lockstep, rank: int, index: int):
        self.lockstep, self.rank, self.index = lockstep, rank, index

    def wait(self) -> list[list[int]]:
        rows = self.lockstep.meet(self.rank, self.index)
        if len({len(row) for row in rows}) > 1:
            raise Mismatch(f'collective {self.index}: rows of different lengths {rows}')
        return [list(row) for row in rows]


class QueueWire(Wire):
    """One simulated rank's point-to-point messages (a :class:`~composer_join.rebalance.transfer.Wire`)."""

    def __init__(self, lockstep: Lockstep, rank: int):  # (no process group to make)
        self.lockstep, self.rank, self.group = lockstep, rank, None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.lockstep.send(self.rank, dst, tensor)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.lockstep.recv(self.rank, src, tensor)


class RankExchange(Exchange):
    """One simulated rank's exchange."""

    def __init__(self, lockstep: Lockstep, rank: int):
        self.lockstep, self.rank, self.world = lockstep, rank, lockstep.world

    def rows(self, row: Sequence[int], what: str) -> Pending:
        return _Rows(self.lockstep, self.rank, self.lockstep.post(self.rank, what, [int(v) for v in row]))

    def reduce(self, values: torch.Tensor, op: str, what: str) -> torch.Tensor:
        every = self.lockstep.meet(self.rank, self.lockstep.post(self.rank, f'reduce ({op})', values.clone()))
        return torch.stack(every).amax(0) if op == 'max' else torch.stack(every).sum(0)

    def gather(self, obj: Any, what: str = '') -> list[Any]:
        return self.lockstep.meet(self.rank, self.lockstep.post(self.rank, 'gather', obj))

    def broadcast(self, obj: Any, src: int, what: str = '') -> Any:
        return self.lockstep.meet(self.rank, self.lockstep.post(self.rank, f'broadcast from {src}', obj))[src]


def run(world: int, fn: Callable[[int, Lockstep], Any], timeout: float = 20.0) -> tuple[list[Any], Lockstep]:
    """``fn(rank, lockstep)`` on ``world`` simulated ranks at once (a rank takes ``lockstep.exchange(rank)`` and, for
    transfers, ``lockstep.wire(rank)``): each rank's result (or what it raised), and the lockstep, which holds the
    collectives each rank issued and the messages never received."""
    lockstep = Lockstep(world, timeout)
    results: list[Any] = [None] * world

    def rank_main(rank: int) -> None:
        try:
            results[rank] = fn(rank, lockstep)
        except BaseException as e:  # returned to the test, which checks it
            results[rank] = e
        finally:
            lockstep.finished(rank)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f'rank{r}', daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
        assert not t.is_alive(), f'{t.name} did not finish'
    return results, lockstep
