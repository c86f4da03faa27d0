"""Elastic resumption: a checkpoint saved mid-epoch resumes on any number of ranks, every sample trained once.

Where every rank's shard of an epoch can be named in one global index space, a mid-epoch checkpoint is enough
to know which samples of the epoch no rank has trained yet, whatever the world size that resumes it:

* the train sampler is recognised by what it is (:func:`sampler_of`): exactly torch's ``DistributedSampler`` or
  :class:`~composer_join.ExactDistributedSampler` given as ``sampler=``, or a subclass of one given as
  ``batch_sampler=`` that yields its base class's order in batches (checked), in a plain ``DataLoader``;
* each rank's checkpoint entry holds, compactly, how many samples of its own shard it has used in the epoch
  (trained, or, rebalancing, given to another rank), and rank 0's the sampler's description (kind, dataset length,
  seed, shuffle, ``drop_last``), which every rank's was (each other rank's entry says so):
  :class:`GlobalOrderPosition`;
* resuming on another world size, every rank recomputes each old rank's shard of the epoch with the sampler's
  own code (:meth:`GlobalOrder.shard`), drops the used prefix of each, and takes every ``W``-th of what is
  left (:func:`remaining_for`): unevenly where they do not divide, which is what UnevenJoin is for.
  :func:`one_epoch_loader` gives the rest of the epoch as a ``DataLoader`` like the user's (its dataset,
  collate function, workers), over those indices; the next epoch shards as usual for the new world size.
  ``used`` counts samples as the sampler gave them, before the ``DataSpec``'s ``batch_transforms``; the rest is
  batched anew, so a transform that depends on a batch's make-up (dropping its last sample) acts on the new
  batches.

Cost: one ``all_gather_object`` of each rank's position entry at each checkpoint (a few integers and the sampler's
description as a tuple: about 100 bytes per rank, so each rank receives ``O(W)``). The checkpoint holds the
description once, in rank 0's entry, and a few integers per other rank (:meth:`GlobalOrderPosition.kept`); after a
resume on another world size rank 0's entry also carries the old world's per-rank counts (the layout, not
gathered: every rank has it), so ``O(W)`` in all. On resuming on another world size, one permutation of the dataset per old rank (what the
sampler itself costs) and a second length agreement at the end of the resumed epoch.

Example::

    # saved by 2 ranks after batch 3 of epoch 1, resumed on 3: the samples of epoch 1 no rank trained,
    # split over 3 ranks, then epoch 2 on 3 ranks' shards
    trainer = Trainer(..., algorithms=[UnevenJoin()], load_path='ckpt/ep1-ba11-rank0.pt')
    trainer.fit()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, fields
from typing import Any, Optional, cast

from torch.utils.data import DataLoader, DistributedSampler

from composer_join.data.positions import Kind, Position
from composer_join.data.sampler import ExactDistributedSampler

__all__ = [
    'GlobalOrder',
    'GlobalOrderPosition',
    'layout_of',
    'one_epoch_loader',
    'orders_of',
    'remaining_for',
    'sampler_of',
    'shard_of',
]

_KINDS: dict[str, type] = {'torch': DistributedSampler, 'exact': ExactDistributedSampler}


@dataclass(frozen=True)
class GlobalOrder:
    """A sampler whose shards are named in one global index space: its kind and what decides its order.

    Attributes:
        kind: ``'torch'`` (``DistributedSampler``) or ``'exact'`` (:class:`~composer_join.ExactDistributedSampler`).
        size: the dataset's length.
        shuffle, seed, drop_last: the sampler's.
        batch: 0 for a sampler given as ``sampler=``; for a batch-yielding subclass given as ``batch_sampler=``,
            its batch size.
    """

    kind: str
    size: int
    shuffle: bool
    seed: int
    drop_last: bool
    batch: int = 0

    @classmethod
    def of(cls, dataloader: Any) -> Optional[GlobalOrder]:
        """The order of ``dataloader``'s sampler, if it is recognised (:func:`sampler_of`), else None."""
        found = sampler_of(dataloader)
        if found is None:
            return None
        sampler, batch = found
        kind = next(k for k, c in _KINDS.items() if isinstance(sampler, c) and c is _base(sampler))
        size = len(sampler.dataset)  # type: ignore[arg-type]  # a DistributedSampler's dataset has a len()
        return cls(kind, size, bool(sampler.shuffle), int(sampler.seed), bool(sampler.drop_last), batch)

    def shard(self, world: int, rank: int, epoch: int) -> list[int]:
        """Rank ``rank``'s indices in ``epoch`` with ``world`` ranks, in its order: the sampler's own code."""
        sampler = _KINDS[self.kind](
            range(self.size),
            num_replicas=world,
            rank=rank,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )
        sampler.set_epoch(epoch)
        return list(sampler)


def sampler_of(dataloader: Any) -> Optional[tuple[DistributedSampler, int]]:
    """The sampler whose order names ``dataloader``'s shards, and its batch size if it yields batches; else None.

    A plain ``DataLoader`` (not a subclass) whose ``sampler=`` is exactly ``DistributedSampler`` or
    :class:`~composer_join.ExactDistributedSampler`, or whose ``batch_sampler=`` (what Composer looks at first) is
    a subclass of one of them that yields the base class's order in batches: checked, not assumed, by iterating
    both once (indices only), every batch but the last full, the last one not dropped.
    """
    if type(dataloader) is not DataLoader:
        return None
    batches = dataloader.batch_sampler
    if isinstance(batches, tuple(_KINDS.values())):
        sampler = cast(DistributedSampler, batches)
        base = list(_base(sampler).__iter__(sampler))
        given = [list(b) for b in sampler]
        size = len(given[0]) if given else 0
        whole = [i for b in given for i in b] == base and all(len(b) == size for b in given[:-1])
        return (sampler, size) if whole and size else None
    given_sampler = dataloader.sampler
    return (cast(DistributedSampler, given_sampler), 0) if type(given_sampler) in _KINDS.values() else None


def _base(sampler: DistributedSampler) -> type[DistributedSampler]:
    """The one of the two recognised classes ``sampler`` is (ExactDistributedSampler before its own base)."""
    return ExactDistributedSampler if isinstance(sampler, ExactDistributedSampler) else DistributedSampler


class GlobalOrderPosition(Position):
    """The position of data read through a :class:`GlobalOrder` sampler: its description, nothing to load.

    ``layout``: None for an epoch sharded by the sampler itself; for the rest of an epoch resumed on another
    world size, the layout that split it (:func:`shard_of`), so that a checkpoint taken then resumes too. On the
    same world size with no layout, Composer replays the epoch to the step (exact); otherwise the entries
    :meth:`save` gives make :func:`remaining_for` split what no rank used. Composer's own ``dataset_state`` stays.
    """

    resumes_itself = False
    elastic = True
    leaves_out_composer_state = False

    def __init__(self, target: Any, dataloader: Any, order: GlobalOrder, layout: Optional[dict[str, Any]] = None):
        super().__init__(target, dataloader)
        self.order, self.layout = order, layout

    @property
    def kind(self) -> Kind:
        return Kind.GLOBAL_ORDER if self.layout is None else Kind.REST

    def save(self, used: int) -> Any:
        """The sampler's description as a tuple (:class:`GlobalOrder`'s fields in order): what each rank gives the
        gather, a few values; :meth:`kept` makes the checkpoint's entries of them. The layout, the same on every rank
        (each has it from the same checkpoint), is not gathered: in rank 0's entry alone, ``all_gather_object``
        would pad every rank's entry to its size, ``O(W)`` bytes, so each rank would receive ``O(W^2)``."""
        return astuple(self.order)

    def kept(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every rank's gathered entry as the checkpoint holds it (:func:`remaining_for` reads both forms).

        Where every rank's description is rank 0's (the ranks agreed on the kind, so it is, unless their samplers
        differ), the description once: rank 0's ``dataset`` is ``{'order': ..., 'layout': ...}`` (the layout:
        :func:`layout_of`) and every other rank's ``{'order_of': 0}``, ``O(1)`` per rank. Otherwise each rank's own
        ``{'order': ...}`` (as checkpoints before this form held), which :func:`remaining_for` refuses.
        """
        described = [_described(e.get('dataset')) for e in entries]
        same = all(d is not None and d == described[0] for d in described)
        out = []
        for r, entry in enumerate(entries):
            dataset: Any = entry.get('dataset') if described[r] is None else {'order': described[r]}
            if r == 0:
                dataset = {**dataset, 'layout': self.layout} if described[r] is not None else dataset
            elif same:
                dataset = {'order_of': 0}
            out.append({**entry, 'dataset': dataset})
        return out

    def load(self, state: Any) -> None:
        pass


def _described(saved: Any) -> Optional[dict[str, Any]]:
    """:meth:`GlobalOrderPosition.save`'s tuple as the description (``asdict`` of the order); None if it is not one."""
    names = [f.name for f in fields(GlobalOrder)]
    if isinstance(saved, tuple) and len(saved) == len(names):
        return dict(zip(names, saved))
    return None


def orders_of(entries: Sequence[dict[str, Any]]) -> list[Optional[dict[str, Any]]]:
    """Each old rank's sampler description in ``entries`` (``asdict`` of its :class:`GlobalOrder`; None: none).

    Reads both forms: every entry's own ``{'order': ...}`` (checkpoints before the compact form, and ranks whose
    descriptions differed), and ``{'order_of': r}``, the description of rank ``r``'s entry
    (:meth:`GlobalOrderPosition.kept`)."""
    out: list[Optional[dict[str, Any]]] = []
    for entry in entries:
        dataset = entry.get('dataset')
        if isinstance(dataset, dict) and 'order_of' in dataset:
            source = dataset['order_of']
            ok = isinstance(source, int) and 0 <= source < len(entries)
            dataset = entries[source].get('dataset') if ok else None
        order = dataset.get('order') if isinstance(dataset, dict) else None
        out.append(order if isinstance(order, dict) else None)
    return out


def layout_of(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The layout of an epoch resumed from ``entries`` (every old rank's checkpoint entry): what :func:`shard_of` reads."""
    return {
        'world': len(entries),
        'used': [int(e['used']) for e in entries],
        'layout': entries[0]['dataset'].get('layout'),
    }


def shard_of(order: GlobalOrder, layout: Optional[dict[str, Any]], world: int, rank: int, epoch: int) -> list[int]:
    """Rank ``rank``'s indices of ``epoch`` with ``world`` ranks: the sampler's shard, or (``layout``: an epoch
    resumed on another world size) its share of what the previous world had not used; where that previous world is
    this one (a resumption, or the trainer's next ``fit()``, inside such an epoch), each rank goes on with its own
    share past what it used, as with the sampler's own shards."""
    if layout is None:
        return order.shard(world, rank, epoch)
    prev = int(layout['world'])
    if prev == world:
        return shard_of(order, layout['layout'], world, rank, epoch)[int(layout['used'][rank]) :]
    left = [
        i for r, used in enumerate(layout['used']) for i in shard_of(order, layout['layout'], prev, r, epoch)[used:]
    ]
    return left[rank::world]


def remaining_for(
    entries: Sequence[dict[str, Any]], order: GlobalOrder, epoch: int, world: int, rank: int
) -> Optional[list[int]]:
    """This rank's share (``rank`` of ``world``) of the samples of ``epoch`` that no old rank had used.

    ``entries``: every old rank's checkpoint entry (``used`` and ``dataset``: :meth:`GlobalOrderPosition.kept`, or
    a checkpoint's before it). None if the entries do not describe ``order`` (another sampler, dataset length, seed or shuffle).
    """
    if any(described != asdict(order) for described in orders_of(entries)):
        return None
    return shard_of(order, layout_of(entries), world, rank, epoch)


def one_epoch_loader(dataloader: DataLoader, indices: list[int], order: GlobalOrder) -> DataLoader:
    """A ``DataLoader`` like ``dataloader`` (its dataset, batching, collate function, workers) over ``indices``."""
    workers = dataloader.num_workers
    common: dict[str, Any] = dict(
        collate_fn=dataloader.collate_fn,
        num_workers=workers,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor if workers else None,
        pin_memory_device=dataloader.pin_memory_device,
    )
    if order.batch:
        chunks = [indices[i : i + order.batch] for i in range(0, len(indices), order.batch)]
        return DataLoader(dataloader.dataset, batch_sampler=chunks, **common)
    return DataLoader(
        dataloader.dataset, sampler=indices, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, **common
    )
