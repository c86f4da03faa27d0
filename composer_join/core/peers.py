"""A peer gone: a rank waiting in one of UnevenJoin's own collectives says where, then the error goes on unchanged.

A rank that dies (SIGKILL, out of memory, its node lost) leaves its peers in whatever collective they are waiting
in, and the backend raises there: gloo ``Connection closed by peer`` or ``Connection reset by peer`` within a second
or so of the death, or, at the latest, a timeout after the process group's ``timeout`` (Composer's ``dist_timeout``);
NCCL's watchdog aborts the process instead, and nothing here runs. The backend's message names an address, not a
rank. Where the collective is one of UnevenJoin's own (the step's agreement, the length agreement, the gather of
train data positions at a checkpoint, a rebalancing transfer), :func:`lost_peer` adds what this rank knows: which of
UnevenJoin's collectives, at which step, and with which ranks (all the others for an all-reduce or a gather; the
one peer of a transfer). It logs that once (``composer_join`` logger, ERROR) and re-raises the very same exception:
its type, message and traceback are unchanged, and the text is also attached as an exception note (Python 3.11+),
so the traceback shows it. It never turns the error into another one, nor swallows it: every rank stops, as without
it, and a relaunch with ``autoresume=True`` goes on from the last checkpoint (docs/reliability.md, *Failover*).

Cost: nothing unless the collective raises.

Example::

    with lost_peer('the agreement on batch 4 of epoch 0 (train)'):
        work.wait()
    # RuntimeError: [.../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40615
    # UnevenJoin on rank 1 of 3: the agreement on batch 4 of epoch 0 (train) failed while waiting for ranks [0, 2]:
    # one of them is most likely gone (killed, out of memory, its node lost; its own log says why). ...
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Optional

from composer.utils import dist

from composer_join.core.errors import UnevenInputsError

__all__ = ['lost_peer', 'say_lost_peer']

log = logging.getLogger(__name__)


@contextlib.contextmanager
def lost_peer(what: str, peers: Optional[Sequence[int]] = None) -> Iterator[None]:
    """Around a wait in one of UnevenJoin's collectives: if the backend raises, :func:`say_lost_peer`, re-raise.

    ``what``: the collective and where (``'the agreement on batch 4 of epoch 0 (train)'``). ``peers``: the ranks it
    waits for (default: every other rank). Only the backend's errors (``RuntimeError``, not UnevenJoin's own
    :class:`~composer_join.UnevenInputsError`) get the note; every exception is re-raised as it is.
    """
    try:
        yield
    except RuntimeError as e:
        if not isinstance(e, UnevenInputsError):
            say_lost_peer(e, what, peers)
        raise


def say_lost_peer(error: BaseException, what: str, peers: Optional[Sequence[int]] = None) -> str:
    """Log, and attach to ``error`` as a note (Python 3.11+), that ``what`` failed waiting for ``peers``; the text.

    The caller re-raises ``error`` (or an error caused by it).
    """
    rank, world = dist.get_global_rank(), dist.get_world_size()
    waiting = [r for r in range(world) if r != rank] if peers is None else list(peers)
    who, one = (f'rank {waiting[0]}', 'it') if len(waiting) == 1 else (f'ranks {waiting}', 'one of them')
    cause = str(error).splitlines()[0] if str(error) else 'no message'
    note = (
        f'UnevenJoin on rank {rank} of {world}: {what} failed while waiting for {who} ({type(error).__name__}: '
        f'{cause}): {one} is most likely gone (killed, out of memory, its node lost; its own log says why), and '
        f'every rank stops here. A relaunch with autoresume=True goes on from the last checkpoint '
        f'(docs/reliability.md, Failover).'
    )
    log.error('%s', note)
    if hasattr(error, 'add_note'):  # Python 3.11+: shown with the traceback
        error.add_note(note)
    return note
