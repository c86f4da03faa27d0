"""Resuming a run mid-epoch: where the train dataloader stands, and what UnevenJoin keeps in a checkpoint.

Composer resumes a train dataloader in one of two ways, and the :class:`~composer_join.join.loader.JoinLoader`
must know which (``train_position``):

* *spinning* (the default): Composer iterates the dataloader from the start of the epoch and
  discards the first ``batch_in_epoch`` batches. Composer calls ``sampler.set_epoch`` only on a
  raw ``DataLoader``, and fires ``EPOCH_START`` only at ``batch_in_epoch == 0``, so the loader
  sets its ``DistributedSampler``'s epoch itself whenever it starts iterating.
* *the dataset resumes itself* (``dataset.state_dict(num_samples, from_beginning)`` /
  ``load_state_dict``, as ``streaming.StreamingDataset`` does): Composer skips spinning and the
  dataloader's first batch is batch ``batch_in_epoch`` of the epoch.

``num_samples`` with uneven shards: Composer passes the *global* ``timestamp.sample_in_epoch``
(real samples summed over ranks). A rank that reads its own shard needs its *own* count, so
:func:`own_sample_counts` makes the dataset's ``state_dict`` receive the number of samples of this
rank's shard used in the current epoch (trained by it, or in ``mode='rebalance'`` given to another
rank; 0 at an epoch boundary, as Composer passes). The exception is ``streaming.StreamingDataset``,
which splits one global sample space across ranks itself and expects the global count: it is
left as it is.

Composer checkpoints ``dataset_state`` from rank 0 only, and loads it into every rank's dataset.
So :class:`RankDatasets` puts every rank's own dataset state (and its sample counts) into
UnevenJoin's own ``state_dict``: one ``all_gather_object`` each time Composer saves a checkpoint
(``State.state_dict()``, which Composer calls on every rank), nothing otherwise. On resuming, each
rank loads its own entry into its dataset at ``FIT_START`` (after Composer loaded rank 0's), before
the first batch is read. Sharded checkpoints carry the same entries (UnevenJoin's state is the
same on every rank).

What :class:`~composer_join.UnevenJoin` saves (:func:`snapshot`) and loads (:func:`restore`): the
finished epochs' reports, the current epoch's partial report (so the report after a resume
counts every step trained in that epoch, before and after the checkpoint, and none spun past)
and the wrapper's state (under DDP: the rank it broadcasts buffers from). All of it is the same on every rank.

A checkpoint resumes on another world size only at an epoch boundary (:func:`check_world_size`): there
every rank starts its shard of the new epoch from the beginning, whatever the sampler's (or dataset's)
sharding for the new world size; the finished epochs' reports keep their own world size. Mid-epoch, which
samples each rank has already trained belongs to the old sharding, so every rank stops with an error
naming both world sizes (stock Composer spins the new shards past a position of the old ones).

Example::

    trainer = Trainer(..., algorithms=[UnevenJoin()], save_folder='ckpt', save_interval='1ba')
    trainer.fit()                       # interrupted at any batch
    trainer = Trainer(..., algorithms=[UnevenJoin()], load_path='ckpt/ep1-ba7-rank0.pt')
    trainer.fit()                       # same samples, same order, same weights as without the interruption
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Any, Optional

from composer.core import State
from composer.utils import dist

from composer_join.core.errors import UnevenInputsError
from composer_join.core.report import EpochReport
from composer_join.rebalance.rebalance import Rebalancer

__all__ = [
    'RankDatasets',
    'check_world_size',
    'own_sample_counts',
    'restore',
    'resume_counts',
    'saved_world_size',
    'snapshot',
    'train_position',
]


def train_position(state: State) -> tuple[int, int, int]:
    """``(epoch, first_step, skipped)`` for the train dataloader Composer is about to iterate.

    ``first_step`` is the index in the epoch of the dataloader's first batch, ``skipped`` how
    many of the batches it yields first Composer will discard (spinning to ``batch_in_epoch``).
    """
    epoch, step = int(state.timestamp.epoch), int(state.timestamp.batch_in_epoch)
    if 'train' in state.dataset_resumption:  # the dataset resumed itself: no spinning
        return epoch, step, 0
    return epoch, 0, step


def own_sample_counts(dataset: Any, count: Callable[[], int]) -> None:
    """Make Composer's ``dataset.state_dict(num_samples, from_beginning)`` receive this rank's own count.

    ``count()`` is the number of samples this rank has trained in the current epoch. Composer's
    ``num_samples`` of 0 (an epoch boundary) is passed on unchanged. Idempotent; does nothing for
    a dataset without ``state_dict`` or a ``StreamingDataset`` (it expects the global count).

    Example:
        >>> class Shard:
        ...     def state_dict(self, num_samples, from_beginning):
        ...         return {'sample_in_epoch': num_samples}
        >>> shard = Shard()
        >>> own_sample_counts(shard, lambda: 13)
        >>> shard.state_dict(40, True), shard.state_dict(0, True)
        ({'sample_in_epoch': 13}, {'sample_in_epoch': 0})
    """
    original = getattr(dataset, 'state_dict', None)
    if not callable(original) or getattr(original, 'uneven_join_counts', False) or _splits_globally(dataset):
        return

    @functools.wraps(original)
    def state_dict(num_samples: int, from_beginning: bool = True) -> Any:
        return original(count() if num_samples else 0, from_beginning)

    state_dict.uneven_join_counts = True  # type: ignore[attr-defined]
    dataset.state_dict = state_dict


class RankDatasets:
    """Every rank's own dataset state, for a train dataset that resumes itself (``state_dict``/``load_state_dict``).

    Args:
        state: the trainer's state (its ``timestamp.sample_in_epoch`` is what Composer passes).
        dataset: this rank's train dataset, already wrapped by :func:`own_sample_counts`.
        trained: ``() -> samples this rank trained in the current epoch`` (its report count).
        used: ``() -> samples of this rank's shard used in the current epoch`` (what the dataset gets).
        sent: ``() -> bytes this rank sent in the current epoch`` (``mode='rebalance'``).

    :meth:`gather` is collective: call it on every rank, as Composer's ``State.state_dict()`` is.
    """

    def __init__(
        self,
        state: State,
        dataset: Any,
        trained: Callable[[], int],
        used: Callable[[], int],
        sent: Callable[[], int] = lambda: 0,
    ):
        self.state, self.dataset, self.trained, self.used, self.sent = state, dataset, trained, used, sent

    @staticmethod
    def applies(dataset: Any) -> bool:
        """Whether ``dataset`` resumes itself per rank (has both methods; not a StreamingDataset)."""
        return (
            callable(getattr(dataset, 'state_dict', None))
            and callable(getattr(dataset, 'load_state_dict', None))
            and not _splits_globally(dataset)
        )

    def gather(self) -> list[dict[str, Any]]:
        """Per rank: ``{'trained', 'used', 'sent', 'dataset'}`` (its dataset's own ``state_dict``). One ``all_gather_object``."""
        num_samples = int(self.state.timestamp.sample_in_epoch)
        mine = {
            'trained': self.trained() if num_samples else 0,
            'used': self.used() if num_samples else 0,
            'sent': self.sent() if num_samples else 0,
            'dataset': self.dataset.state_dict(num_samples, True),
        }
        return dist.all_gather_object(mine)

    def load(self, saved: list[dict[str, Any]]) -> dict[str, Any]:
        """Load this rank's entry of ``saved`` into its dataset; return the entry. Raises the same on every rank."""
        world, rank = dist.get_world_size(), dist.get_global_rank()
        if len(saved) != world:
            raise UnevenInputsError(
                f"the checkpoint holds the dataset states of {len(saved)} ranks, but this run has {world}: each rank's "
                f'dataset resumes itself from its own state, so resume with the same world size (or without '
                f"UnevenJoin's per-rank states: load_ignore_keys=['state/algorithms'] and the dataset restarts the epoch)",
            )
        self.dataset.load_state_dict(saved[rank]['dataset'])
        return saved[rank]


def resume_counts(loader: Any, own: dict[str, Any], saved: list[dict[str, Any]], mid_epoch: bool) -> None:
    """Start a :class:`~composer_join.join.loader.JoinLoader` resumed mid-epoch from the checkpoint's sample counts.

    ``own`` is this rank's entry of ``saved`` (:meth:`RankDatasets.gather`). The epoch's partial
    report gets every rank's exact count (on steps planned from the lengths, the report alone
    had not received them yet).
    """
    if not mid_epoch:
        return
    loader.resumed_samples = own['trained']
    if isinstance(loader.dataloader, Rebalancer):  # mode='rebalance': its shard's samples, given ones too
        loader.dataloader.resumed_samples, loader.dataloader.resumed_bytes = own['used'], own.get('sent', 0)
    loader.report.real_samples = [int(entry['trained']) for entry in saved]


def _splits_globally(dataset: Any) -> bool:
    """True for a StreamingDataset (checked only if ``streaming`` is imported: a dataset of it would have imported it)."""
    streaming = sys.modules.get('streaming')
    return streaming is not None and isinstance(dataset, getattr(streaming, 'StreamingDataset', ()))


def snapshot(
    reports: list[EpochReport],
    current: Optional[EpochReport],
    wrapper: dict[str, Any],
    ranks: Optional[list[dict[str, Any]]] = None,
) -> dict[str, Any]:
    """What UnevenJoin puts in its ``state_dict``: plain data, the same on every rank.

    ``ranks``: :meth:`RankDatasets.gather`'s per-rank dataset states, if the dataset resumes itself.
    """
    return {
        'world_size': dist.get_world_size(),
        'reports': [copy.deepcopy(vars(r)) for r in reports],
        'current': None if current is None else copy.deepcopy(vars(current)),
        'wrapper': copy.deepcopy(wrapper),
        'ranks': ranks,
    }


def saved_world_size(saved: dict[str, Any]) -> Optional[int]:
    """The world size that saved :func:`snapshot`'s ``saved`` (checkpoints of 0.1.0: from its reports), None if unknown."""
    if 'world_size' in saved:
        return int(saved['world_size'])
    reports = [r for r in (saved.get('current'), *saved.get('reports', [])) if r is not None]
    return int(reports[0]['world_size']) if reports else None


def check_world_size(saved: Optional[int], state: State) -> bool:
    """At ``FIT_START``, resuming a checkpoint saved by ``saved`` ranks: True if the world size changed.

    Resuming on another world size is sound at an epoch boundary (every rank starts its new shard
    from the beginning) and is then allowed. Mid-epoch it raises :class:`UnevenInputsError`, the same
    on every rank (every rank loaded the same checkpoint; no collective), naming both world sizes.
    """
    world = dist.get_world_size()
    if saved is None or saved == world:
        return False
    epoch, batch = int(state.timestamp.epoch), int(state.timestamp.batch_in_epoch)
    if batch > 0:
        raise UnevenInputsError(
            f'this checkpoint was saved by {saved} ranks in the middle of epoch {epoch} (after batch {batch} of it), '
            f'and this run has {world} ranks: which samples each rank has trained in that epoch belongs to the '
            f"{saved} ranks' shards, so resuming on {world} would train some samples twice and skip others. Resume "
            f'on {saved} ranks, or from a checkpoint saved at an epoch boundary (e.g. save_interval="1ep"), which '
            f'resumes on any number of ranks.',
        )
    return True


def restore(
    saved: dict[str, Any],
) -> tuple[list[EpochReport], Optional[EpochReport], dict[str, Any], Optional[list[dict[str, Any]]]]:
    """The inverse of :func:`snapshot`: ``(reports, current report, the wrapper's state, per-rank dataset states)``."""
    current = saved.get('current')
    return (
        [EpochReport(**r) for r in saved.get('reports', [])],
        None if current is None else EpochReport(**current),
        dict(saved.get('wrapper', {})),
        saved.get('ranks'),
    )
