"""A peer gone: a rank waiting in one of UnevenJoin's own collectives says where, then the error goes on unchanged.

A rank that dies (SIGKILL, out of memory, its node lost) leaves its peers in whatever collective they are waiting
in, and the backend raises there: gloo ``Connection closed by peer`` or ``Connection reset by peer`` within a second
or so of the death, or, at the latest, a timeout after the process group's ``timeout`` (Composer's ``dist_timeout``);
NCCL's watchdog aborts the process instead, and nothing here runs. The backend's message names an address, not a
rank. Where the collective is one of UnevenJoin's own (a step's agreement, the agreement on which ranks failed, the
gather of train data positions at a checkpoint, a rebalancing transfer or read-ahead exchange), :func:`lost_peer`
adds what this rank knows: which of
UnevenJoin's collectives, at which step, and with which ranks (all the others for an all-reduce or a gather; the
one peer of a transfer). It logs that once (``composer_join`` logger, ERROR) and re-raises the very same exception:
its type, message and traceback are unchanged, and the text is also attached as an exception note (Python 3.11+),
so the traceback shows it. It never turns the error into another one, nor swallows it: every rank stops, as without
it, and a relaunch with ``autoresume=True`` goes on from the last checkpoint (docs/reliability.md, *Failover*). (The
length agreement that opens a fit or an evaluation already raises :class:`~composer_join.UnevenInputsError` naming
both of its likely causes, a rank without UnevenJoin or a peer gone, with the backend's error as its cause:
:func:`~composer_join.core.settings.mismatch_error`.)

Cost: nothing unless the collective raises.

Example::

    with lost_peer('the agreement on batch 4 of epoch 0'):
        work.wait()
    # RuntimeError: [.../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40615
    # UnevenJoin on rank 1 of 3: the agreement on batch 4 of epoch 0 failed while waiting for ranks [0, 2] (...):
    # one of them is most likely gone (killed, out of memory, its node lost; its own log says why), ...
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Optional

from composer.utils import dist

from composer_join.core.errors import UnevenInputsError

__all__ = ['lost_peer']

log = logging.getLogger(__name__)


@contextlib.contextmanager
def lost_peer(what: str, peers: Optional[Sequence[int]] = None) -> Iterator[None]:
    """Around a wait in one of UnevenJoin's collectives: if the backend raises, say ``what`` failed and with whom.

    ``what``: the collective and where (``'the agreement on batch 4 of epoch 0'``). ``peers``: the ranks it waits for
    (default: every other rank). Only the backend's errors (``RuntimeError``, not UnevenJoin's own
    :class:`~composer_join.UnevenInputsError`) get the log line and the note; every exception is re-raised as it is.
    """
    try:
        yield
    except RuntimeError as e:
        if not isinstance(e, UnevenInputsError):
            rank, world = dist.get_global_rank(), dist.get_world_size()
            waiting = [r for r in range(world) if r != rank] if peers is None else list(peers)
            who, one = (f'rank {waiting[0]}', 'it') if len(waiting) == 1 else (f'ranks {waiting}', 'one of them')
            cause = str(e).splitlines()[0] if str(e) else 'no message'
            note = (
                f'UnevenJoin on rank {rank} of {world}: {what} failed while waiting for {who} ({type(e).__name__}: '
                f'{cause}): {one} is most likely gone (killed, out of memory, its node lost; its own log says why), '
                f'and every rank stops here. A relaunch with autoresume=True goes on from the last checkpoint '
                f'(docs/reliability.md, Failover).'
            )
            log.error('%s', note)
            if hasattr(e, 'add_note'):  # Python 3.11+: shown with the traceback
                e.add_note(note)
        raise
