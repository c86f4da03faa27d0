"""What Composer 0.32.1's ``autoresume`` needs from a launcher, for torchrun and for nodes sharing a save folder.

A training script calls :func:`launcher_compat` around building its ``Trainer`` (never at import: nothing here runs
unless asked). Two gaps, each closed in one function, each with its upstream cause:

* :func:`node_rank_from_group_rank`: **torchrun sets no ``NODE_RANK``.** It sets ``GROUP_RANK`` (its agent's rank
  in the rendezvous, which is the node's rank), ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``.
  Composer reads ``NODE_RANK`` through ``composer.utils.dist.get_node_rank`` (``composer/utils/dist.py``, lines
  263-272), which, once ``torch.distributed`` is initialised, raises ``MissingEnvironmentError: Torch distributed is
  initialized but environment variable NODE_RANK is not set`` (``_get_distributed_config_var``, lines 200-205).
  With ``autoresume=True``, ``Trainer()`` reaches it on every rank: ``Trainer._get_autoresume_checkpoint``
  (``composer/trainer/trainer.py``, line 1900) calls ``dist.get_node_signal_file_name()``, which calls
  ``get_node_rank()`` (``dist.py``, line 641). Composer's own launcher sets ``NODE_RANK``; torchrun does not.
* :func:`per_node_signal_files`: **nodes sharing a save folder race on one signal file.** In
  ``_get_autoresume_checkpoint`` (``trainer.py``, lines 1898-1914) each node's local rank 0 writes a signal file
  in the save folder, every rank waits for it, then each local rank 0 removes it. Its name comes from
  ``get_node_signal_file_name`` (``dist.py``, lines 628-644), which broadcasts *rank 0's* name
  (``._signal_file_node0_<random>``) to every rank, so every node uses the same file: where the save folder is
  shared (a network file system; several agents on one machine), the second node's removal raises
  ``FileNotFoundError`` in ``Trainer()``. Composer's launcher has the same race; only a node-local save folder
  escapes it, and autoresume needs the checkpoint where every node sees it. While the block runs, each node's
  name gets its own node rank appended (rank 0's broadcast still made, on every rank alike).

Cost: nothing per step; one environment variable, and while ``Trainer()`` runs one function of Composer's replaced
(through :class:`~composer_join.core.changes.Changes`, put back when the block ends, also when it raises).

Example::

    from composer_join import launcher_compat

    with launcher_compat():  # NODE_RANK from torchrun's GROUP_RANK; one autoresume signal file per node
        trainer = Trainer(..., save_folder='/shared/ckpt', save_interval='1ba', autoresume=True, run_name='r1')
    trainer.fit()
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Optional

from composer.utils import dist

from composer_join.core.changes import Changes

__all__ = ['launcher_compat', 'node_rank_from_group_rank', 'per_node_signal_files']


def node_rank_from_group_rank() -> Optional[int]:
    """Set ``NODE_RANK`` from torchrun's ``GROUP_RANK`` where it is missing; return the node rank in force.

    For the rest of the process (Composer reads it again when it loads checkpoints), as Composer's launcher would
    have set it. None (nothing set) where neither is set: a single process, or a launcher that sets neither.
    """
    if 'NODE_RANK' not in os.environ and 'GROUP_RANK' in os.environ:
        os.environ['NODE_RANK'] = os.environ['GROUP_RANK']
    value = os.environ.get('NODE_RANK')
    return None if value is None else int(value)


def per_node_signal_files(changes: Changes) -> None:
    """Until ``changes`` is undone, every node names Composer's autoresume signal file after itself.

    Replaces ``composer.utils.dist.get_node_signal_file_name`` (which ``trainer.py`` looks up on the module when it
    calls it) by one that calls it (the same broadcast from rank 0, on every rank) and appends this node's rank.
    """
    original = dist.get_node_signal_file_name

    def own_node(rng=None) -> str:
        return f'{original(rng)}.node{dist.get_node_rank()}'

    changes.set(dist, 'get_node_signal_file_name', own_node)


@contextlib.contextmanager
def launcher_compat() -> Iterator[Optional[int]]:
    """Around ``Trainer()``: :func:`node_rank_from_group_rank`, then :func:`per_node_signal_files` while it runs.

    Yields the node rank (None in a single process). Harmless under Composer's launcher and in one process.
    """
    node = node_rank_from_group_rank()
    with Changes() as changes:
        per_node_signal_files(changes)
        yield node
