"""A ``DistributedSampler`` that covers a map-style dataset exactly once, without padding.

torch's :class:`~torch.utils.data.distributed.DistributedSampler` makes every rank's shard the
same length: with ``drop_last=False`` it repeats samples from the start of the permutation, with
``drop_last=True`` it drops the tail. :class:`ExactDistributedSampler` does neither: the shards
are disjoint, together hold every index of the dataset exactly once, and their lengths differ by
at most one. Ranks therefore may get different numbers of samples (and of batches), which is what
:class:`~composer_join.UnevenJoin` exists to train on.

Contract
--------
* The user constructs one sampler per rank, with the same ``dataset``, ``num_replicas``, ``seed``
  and ``shuffle`` on every rank, and passes it as ``DataLoader(..., sampler=sampler)``. Pass it as
  ``sampler=``, not wrapped in a custom ``batch_sampler=``: Composer only recognises a
  ``DistributedSampler`` found at ``dataloader.sampler`` or ``dataloader.batch_sampler`` itself.
* Composer (or :class:`~composer_join.join.loader.JoinLoader`) calls :meth:`set_epoch` before each
  epoch; in evaluation Composer calls ``set_epoch(batch)``. The DataLoader calls ``iter()`` and
  ``len()``.
* ``iter()`` costs one ``torch.randperm(len(dataset))`` with ``shuffle=True`` (as torch's does)
  and then materialises only this rank's shard; it holds no per-epoch state, no communication.
* **Tensor parallelism.** Built with ``num_replicas`` and ``rank`` left to their defaults, it shards over
  *data-parallel* ranks when the trainer's layout has tensor-parallel groups (Composer's ``tp_config``): the
  ranks of a TP group yield the same shard. UnevenJoin applies the layout (:func:`shard_by_layout`) for each
  iteration and for the length agreement, and undoes it afterwards; before ``fit()``, ``len()`` is over all ranks.
  Given explicitly, ``num_replicas`` and ``rank`` are kept (and a TP group given different data is an error).
* Attributes mirror torch's and stay truthful for the readers of them (Composer's eval loop reads
  ``total_size`` and ``len(sampler.dataset)`` to compute padding, which is always zero here):

  - ``total_size == len(dataset)`` (summed over ranks, nothing padded or dropped);
  - ``num_samples == len(sampler)`` is *this rank's* shard length, which differs by rank
    (so ``num_samples * num_replicas == total_size`` holds only when ``num_replicas`` divides it);
  - ``drop_last`` is always ``False``.

Example::

    sampler = ExactDistributedSampler(dataset, shuffle=True, seed=17)  # world size / rank from torch.distributed
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    trainer = Trainer(model=model, train_dataloader=loader, algorithms=[UnevenJoin()], ...)
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from composer_join.core import compat
from composer_join.core.changes import Changes
from composer_join.core.layout import Layout

__all__ = ['ExactDistributedSampler', 'shard_by_layout']


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f'{name} must be an int, got bool {value!r}')
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f'{name} must be an int, got {type(value).__name__} {value!r}') from None


class ExactDistributedSampler(DistributedSampler[int]):
    """Shards a map-style dataset across ranks so that every index is used exactly once per epoch.

    Shards are **strided**, like torch's: with ``perm`` the epoch's order of ``range(len(dataset))``
    (``torch.randperm`` seeded with ``seed + epoch`` when ``shuffle=True``, else ascending), rank
    ``r`` yields ``perm[r::num_replicas]``. This is torch's ``DistributedSampler`` shard with its
    padded tail removed (identical when ``num_replicas`` divides ``len(dataset)``). Rank ``r`` gets
    ``ceil((len(dataset) - r) / num_replicas)`` samples (0 if ``r >= len(dataset)``): ranks below
    ``len(dataset) % num_replicas`` get one sample more than the others. With ``shuffle=False``
    rank ``r`` yields ``r, r + num_replicas, r + 2 * num_replicas, ...`` in every epoch.

    Args:
        dataset: a map-style dataset with ``__len__``; its length must not change afterwards
            (``iter()`` raises ``RuntimeError`` if it did).
        num_replicas: number of ranks; defaults to ``torch.distributed.get_world_size()`` (under UnevenJoin with
            tensor parallelism: the data-parallel size, see the module docstring).
        rank: this rank in ``[0, num_replicas - 1]``; defaults to ``torch.distributed.get_rank()`` (the
            data-parallel rank, likewise).
        shuffle: reshuffle every epoch (default ``True``); the permutation is the same on all ranks
            for the same ``seed`` and epoch.
        seed: shuffling seed, identical on all ranks (default ``0``).
        drop_last: only ``False`` is allowed; this sampler never drops (nor pads) samples. For equal
            shards with the tail dropped, use torch's ``DistributedSampler(drop_last=True)``.

    Raises:
        ValueError: ``drop_last=True``, ``num_replicas < 1``, or ``rank`` outside ``[0, num_replicas - 1]``.
        TypeError: ``num_replicas`` or ``rank`` is not an integer.

    Example:
        >>> sampler = ExactDistributedSampler(list(range(5)), num_replicas=2, rank=1, shuffle=False)
        >>> list(sampler), len(sampler), sampler.total_size
        ([1, 3], 2, 5)
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if drop_last:
            raise ValueError(
                f'ExactDistributedSampler(drop_last={drop_last!r}) is not supported: it gives every sample to '
                'exactly one rank and never drops or pads, so only drop_last=False is allowed. To drop the tail '
                'and give every rank the same number of samples, use torch.utils.data.DistributedSampler('
                'drop_last=True) instead.',
            )
        if num_replicas is not None:
            num_replicas = _as_int(num_replicas, 'num_replicas')
            if num_replicas < 1:
                raise ValueError(f'Invalid num_replicas {num_replicas}, num_replicas should be a positive integer')
        if rank is not None:
            rank = _as_int(rank, 'rank')
        self.follows_layout = num_replicas is None and rank is None
        """``num_replicas`` and ``rank`` were left to their defaults: UnevenJoin shards it over data-parallel ranks."""
        # Resolves the defaults from torch.distributed and validates rank exactly as torch does.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        dataset_len = len(dataset)  # type: ignore[arg-type]
        self.total_size = dataset_len
        self.num_samples = self.shard_length(self.rank)

    def reshard(self, num_replicas: int, rank: int) -> tuple[int, int]:
        """Shard over ``num_replicas`` as ``rank`` from now on; returns the earlier ``(num_replicas, rank)`` (give them
        back to undo). Called by UnevenJoin under tensor parallelism (:func:`shard_by_layout`)."""
        if not 0 <= rank < num_replicas:
            raise ValueError(f'Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]')
        earlier = (self.num_replicas, self.rank)
        self.num_replicas, self.rank = num_replicas, rank
        self.num_samples = self.shard_length(rank)
        return earlier

    def shard_length(self, rank: int) -> int:
        """Number of samples rank ``rank`` yields per epoch (the same in every epoch)."""
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f'Invalid rank {rank}, rank should be in the interval [0, {self.num_replicas - 1}]')
        return max(0, -(-(self.total_size - rank) // self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if n != self.total_size:
            raise RuntimeError(
                f'the dataset has {n} samples but had {self.total_size} when this ExactDistributedSampler was '
                'created; datasets must keep a constant length (create a new sampler after changing it)',
            )
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            shard = torch.randperm(n, generator=g)[self.rank :: self.num_replicas].tolist()
        else:
            shard = list(range(self.rank, n, self.num_replicas))
        assert len(shard) == self.num_samples
        return iter(shard)

    def __len__(self) -> int:
        return self.num_samples


def shard_by_layout(dataloader: Any, layout: Layout, rank: int, changes: Changes) -> None:
    """Where ``layout`` has tensor-parallel groups and ``dataloader``'s sampler is an :class:`ExactDistributedSampler`
    that took its ranks from ``torch.distributed``: shard it over data-parallel ranks, undone by ``changes``.

    Called by :func:`~composer_join.join.loader.join_dataloader` around the length agreement and when each iteration
    opens. Anything else is left as it is. No communication.
    """
    if layout.tp == 1 or not isinstance(dataloader, DataLoader):
        return
    sampler = compat.distributed_sampler(dataloader)
    if not isinstance(sampler, ExactDistributedSampler) or not sampler.follows_layout:
        return
    earlier = sampler.reshard(layout.members, layout.member(rank))
    changes.call(lambda: sampler.reshard(*earlier))
