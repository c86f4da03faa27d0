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

Where a train dataloader or its dataset keeps its own position (torchdata's ``StatefulDataLoader``, litdata,
Hugging Face ``datasets.IterableDataset``, a dataset registered with Composer's protocol), an adapter chosen by
what the object is speaks its protocol (:mod:`composer_join.data.positions`), and :class:`RankPositions`
keeps *every rank's own* position in UnevenJoin's checkpoint entry: Composer would save rank 0's dataset state
only (calling ``state_dict(num_samples, from_beginning)`` with the global count, which litdata's and Hugging
Face's signatures refuse with ``TypeError``) and load it into every rank's dataset. The positions are gathered
(one ``all_gather_object``) on every rank at the points every rank reaches alike: Composer's checkpoint events
where its ``CheckpointSaver`` saves (before it saves) and ``FIT_END`` (a save after ``fit()``); ``State.state_dict()``
then reads them and is not collective, so one rank may call it alone. A ``state_dict()`` at another point holds
none (it warns; a run resumed from it mid-epoch stops with an error). On resuming, each rank loads its own entry at
``FIT_START``, before the first batch is read, and Composer then does not spin the dataloader. Sharded checkpoints
carry the same entries (UnevenJoin's state is the same on every rank). A checkpoint written by 0.1.0 (with
Composer's ``dataset_state``) resumes the same way.

What :class:`~composer_join.UnevenJoin` saves (:func:`snapshot`) and loads (:func:`restore`): the
finished epochs' reports, the current epoch's partial report (so the report after a resume
counts every step trained in that epoch, before and after the checkpoint, and none spun past)
and the wrapper's state (under DDP: the rank it broadcasts buffers from). All of it is the same on every rank.

A checkpoint resumes on another world size (1 included) only at an epoch boundary (:func:`check_world_size`):
there every rank starts its shard of the new epoch from the beginning, whatever the sampler's (or dataset's)
sharding for the new world size; the finished epochs' reports keep their own world size. The checkpoint of an
epoch's last batch (``save_interval='1ba'``: Composer saves it before ``EPOCH_END``) is a boundary too: every
sample of that epoch was trained, so the resumed run ends that epoch at once, with no batch. Mid-epoch,
which samples each rank has already trained belongs to the old sharding, so every rank stops with an error
naming both world sizes (stock Composer spins the new shards past a position of the old ones).

Example::

    trainer = Trainer(..., algorithms=[UnevenJoin()], save_folder='ckpt', save_interval='1ba')
    trainer.fit()                       # interrupted at any batch
    trainer = Trainer(..., algorithms=[UnevenJoin()], load_path='ckpt/ep1-ba7-rank0.pt')
    trainer.fit()                       # same samples, same order, same weights as without the interruption
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from composer.core import State
from composer.utils import dist

from composer_join.core.catalogue import POSITIONS
from composer_join.core.errors import UnevenInputsError
from composer_join.core.exchange import TorchExchange
from composer_join.core.layout import Layout
from composer_join.core.report import EpochReport
from composer_join.data.positions import Position, Reading

__all__ = [
    'Progress',
    'RankPositions',
    'Resumed',
    'Start',
    'check_world_size',
    'restore',
    'snapshot',
    'train_position',
]


class Start(NamedTuple):
    """Where the train dataloader's next iteration starts in its epoch (:func:`train_position`)."""

    epoch: int
    first: int
    """The index in the epoch of the dataloader's first batch."""
    skipped: int
    """How many of the batches it yields first Composer will discard (spinning to ``batch_in_epoch``)."""
    finished: bool = False
    """The epoch's batches were all trained (a checkpoint of its last batch, on another world size): none is read."""
    rereads: bool = False
    """Composer reads the dataloader again from its start within an epoch already under way, and keeps every batch
    (``spin_dataloaders=False``): the iteration counts its steps from its own start, the epoch's report goes on,
    and Composer ends the epoch by its own count."""


def train_position(state: State, finished: bool = False, spins: bool = True) -> Start:
    """Where the train dataloader Composer is about to iterate starts (``finished``: see :attr:`Start.finished`;
    ``spins``: the Trainer's ``spin_dataloaders``, :attr:`composer_join.core.compat.TrainView.spins`)."""
    epoch, step = int(state.timestamp.epoch), int(state.timestamp.batch_in_epoch)
    if finished and step > 0:
        return Start(epoch, step, 0, True)
    if 'train' in state.dataset_resumption:  # the dataset resumed itself: no spinning
        return Start(epoch, step, 0)
    if step > 0 and not spins:
        return Start(epoch, 0, 0, rereads=True)
    return Start(epoch, 0, step)


class Progress(NamedTuple):
    """Where this rank stands in the current epoch, as the join's loader counts it (its ``progress()``)."""

    trained: int
    """Samples this rank trained in the epoch (its report count; -1: uncountable)."""
    used: int
    """Samples of its own shard used in the epoch: trained, or (rebalancing) given to another rank."""
    sent: int
    """Bytes it sent in the epoch (rebalancing)."""
    ended: bool
    """Its own data has ended, every batch trained: a library may start a new epoch when such a position is
    loaded, so the resumed rank reads nothing more of this epoch."""


class RankPositions:
    """Every rank's own position in its train data, for data that keeps one (:mod:`composer_join.data.positions`).

    Args:
        state: the trainer's state (its ``timestamp.sample_in_epoch`` tells an epoch boundary, 0, from the middle).
        position: this rank's adapter, as the ranks agreed (:func:`~composer_join.data.positions.agreed_position`).

    The reader of the user's dataloader opens it with :meth:`open`. :meth:`gather` is collective: call it on
    every rank at the same points (Composer's checkpoint events where a checkpoint is saved, ``FIT_END``);
    :meth:`entries` reads what it gathered, on one rank alone if need be (``State.state_dict()``). Composer's own
    rank-0 ``dataset_state`` is left out of checkpoints while a fit runs (except for Composer's protocol, whose
    signature it calls correctly; a sharded checkpoint's load expects it): :meth:`close` puts it back (Composer's
    ``State``, the trainer's own).
    """

    def __init__(self, state: State, position: Position):
        self.state, self.position = state, position
        self._resumed_at = 0  # own samples of the epoch a loaded state resumes after, until its iteration opens
        self._left_out = position.leaves_out_composer_state and 'dataset_state' in state.serialized_attributes
        if self._left_out:
            state.serialized_attributes.remove('dataset_state')
        self._gathered: Optional[tuple[tuple[int, ...], list[dict[str, Any]]]] = None  # (when, every rank's)
        self._warned = False

    @property
    def gathers(self) -> bool:
        """Whether checkpoints hold every rank's position (the data resumes itself, or names a global order)."""
        return self.position.resumes_itself or self.position.elastic

    def close(self) -> None:
        """Composer's ``dataset_state`` back in its checkpoints (at the end of the fit)."""
        if self._left_out and 'dataset_state' not in self.state.serialized_attributes:
            self.state.serialized_attributes.append('dataset_state')
        self._left_out = False

    def open(
        self, dataloader: Iterable, resumed: bool, count: Callable[[Any], int], used: Callable[[], int]
    ) -> Iterator[Any]:
        """``iter(dataloader)``, as the adapter reads it; ``resumed``: the iteration goes on with a loaded position.

        ``count``: a batch's samples; ``used()``: own samples used so far in the epoch (:class:`Progress`).
        """
        start = self._resumed_at if resumed else 0
        self._resumed_at = 0
        return self.position.open(dataloader, Reading(count, used, start))

    def _now(self) -> tuple[int, ...]:
        ts = self.state.timestamp
        return int(ts.epoch), int(ts.batch), int(ts.batch_in_epoch), int(ts.sample_in_epoch)

    def gather(self, progress: Progress, strict: bool = True) -> None:
        """Every rank's ``{'trained', 'used', 'sent', 'ended', 'dataset'}`` (its position) now, kept for :meth:`entries`
        as the adapter keeps them (:meth:`~composer_join.data.positions.Position.kept`: a global-order sampler's
        description once, in rank 0's entry).

        Collective: one ``all_gather_object`` where :attr:`gathers` (the same on every rank: agreed) and none was
        made at this timestamp yet; call it on every rank at the same points. ``progress``: this rank's, now. If some
        rank cannot give its position, every rank raises :class:`UnevenInputsError` (that rank with why), or, not
        ``strict``, keeps nothing (:meth:`entries` then has none for now).
        """
        now = self._now()
        if not self.gathers or (self._gathered is not None and self._gathered[0] == now):
            return
        self._gathered = None
        mid = now[3] > 0
        try:
            used = progress.used if mid else 0
            mine: dict[str, Any] = {
                'trained': progress.trained if mid else 0,
                'used': used,
                'sent': progress.sent if mid else 0,
                'ended': mid and progress.ended,
                'dataset': self.position.save(used),
            }
            error: Optional[UnevenInputsError] = None
        except UnevenInputsError as e:
            mine, error = {'error': str(e)}, e
        batch = int(self.state.timestamp.batch)
        said = POSITIONS.said(f'the gather of train data positions for the checkpoint after batch {batch}')
        gathered = TorchExchange().gather(mine, said)
        failed = [r for r, entry in enumerate(gathered) if 'error' in entry]
        if failed and not strict:
            return
        if error is not None:
            raise error
        if failed:
            raise UnevenInputsError(
                f'rank(s) {failed} cannot save the position of their train data in this checkpoint: '
                f'{gathered[failed[0]]["error"]}'
            )
        self._gathered = (now, self.position.kept(gathered))

    def entries(self) -> tuple[Optional[list[dict[str, Any]]], bool]:
        """``(every rank's position, unsaved)`` for a checkpoint now, on this rank alone (no collective).

        The positions :meth:`gather` kept at this timestamp; None where the data keeps none, and where
        :meth:`gather` made none now (a ``state_dict()`` outside Composer's checkpoint events and ``FIT_END``): then
        ``unsaved`` is True, and this rank warns once.
        """
        if not self.gathers:
            return None, False
        now = self.gathered_now()
        if now is not None:
            return now, False
        if not self._warned:
            self._warned = True
            warnings.warn(
                "UnevenJoin.state_dict() was called outside Composer's checkpoint events (where its CheckpointSaver "
                'saves, save_interval) and the end of fit(): the train data keeps a position of its own on each rank, '
                "which every rank gathers at those points only, so this state holds no rank's position; a run resumed "
                'from it mid-epoch stops with an error.',
                stacklevel=3,
            )
        return None, True

    def gathered_now(self) -> Optional[list[dict[str, Any]]]:
        """Every rank's position as :meth:`gather` kept it at the current timestamp, else None (no collective)."""
        if self._gathered is not None and self._gathered[0] == self._now():
            return self._gathered[1]
        return None

    def load(self, saved: list[dict[str, Any]]) -> dict[str, Any]:
        """Load this rank's entry of ``saved`` into its data; return the entry. Raises the same on every rank.

        Composer then does not spin the dataloader (``state.dataset_resumption['train']``).
        """
        world, rank = dist.get_world_size(), dist.get_global_rank()
        if len(saved) != world:
            raise UnevenInputsError(
                f'the checkpoint holds the train data positions of {len(saved)} ranks, but this run has {world}: each '
                f"rank resumes its own position, so resume with the same world size (or without UnevenJoin's "
                f"per-rank positions: load_ignore_keys=['state/algorithms'] and the data restarts the epoch)",
            )
        own = saved[rank]
        self.position.load(own['dataset'])
        if self.position.resumes_itself:
            self.state.dataset_resumption['train'] = True
        self._resumed_at = int(own.get('used', 0) or 0)
        return own


def snapshot(
    reports: list[EpochReport],
    current: Optional[EpochReport],
    wrapper: dict[str, Any],
    ranks: Optional[list[dict[str, Any]]] = None,
    epoch_done: bool = False,
    groups: Optional[Sequence[Sequence[int]]] = None,
    positions_unsaved: bool = False,
) -> dict[str, Any]:
    """What UnevenJoin puts in its ``state_dict``: plain data, the same on every rank.

    ``ranks``: :meth:`RankPositions.entries`' per-rank positions, if the data keeps its own.
    ``epoch_done``: the step just trained was the epoch's last (a checkpoint of it is an epoch boundary).
    ``groups``: the data-parallel members' ranks (:class:`~composer_join.core.layout.Layout`), if not one per rank.
    ``positions_unsaved``: the data keeps positions, but none were gathered for this state (:meth:`RankPositions.entries`).
    """
    return {
        'world_size': dist.get_world_size(),
        'reports': [r.state() for r in reports],
        'current': None if current is None else current.state(),
        'wrapper': copy.deepcopy(wrapper),
        'ranks': ranks,
        'epoch_done': epoch_done,
        'groups': None if groups is None else [list(g) for g in groups],
        'positions_unsaved': positions_unsaved,
    }


@dataclass
class Resumed:
    """What a checkpoint gave UnevenJoin (:func:`restore`), kept until ``FIT_START`` uses it."""

    reports: list[EpochReport]
    """The finished epochs' reports."""
    current: Optional[EpochReport]
    """The current epoch's partial report."""
    wrapper: dict[str, Any]
    """The wrapper's state (under DDP: the rank it broadcasts buffers from)."""
    ranks: Optional[list[dict[str, Any]]]
    """Every rank's own position (:meth:`RankPositions.gather`), if the data keeps its own."""
    world_size: Optional[int]
    """The world size that saved it (checkpoints of 0.1.0: from its reports), None if unknown."""
    epoch_done: bool
    """It was saved after the epoch's last batch (before ``EPOCH_END``)."""
    groups: Optional[tuple[tuple[int, ...], ...]] = None
    """The data-parallel members' ranks under tensor parallelism (None: one per rank, or unknown)."""
    positions_unsaved: bool = False
    """The data kept positions, but this state was taken where none were gathered (:meth:`RankPositions.entries`)."""


def restore(saved: dict[str, Any]) -> Resumed:
    """The inverse of :func:`snapshot`."""
    current = saved.get('current')
    reports = [EpochReport.from_state(r) for r in saved.get('reports', [])]
    world = saved.get('world_size')
    if world is None:  # 0.1.0: from its reports
        known = [r for r in (current, *saved.get('reports', [])) if r is not None]
        world = known[0]['world_size'] if known else None
    return Resumed(
        reports=reports,
        current=None if current is None else EpochReport.from_state(current),
        wrapper=dict(saved.get('wrapper', {})),
        ranks=saved.get('ranks'),
        world_size=None if world is None else int(world),
        epoch_done=bool(saved.get('epoch_done', False)),
        groups=None if saved.get('groups') is None else tuple(tuple(int(r) for r in g) for g in saved['groups']),
        positions_unsaved=bool(saved.get('positions_unsaved', False)),
    )


def check_world_size(
    resumed: Optional[Resumed], state: State, elastic: bool = False, layout: Optional[Layout] = None
) -> bool:
    """At ``FIT_START`` of a resumed run: True if the world size or the layout changed (then at an epoch boundary).

    Resuming on another world size is sound at an epoch boundary (every rank starts its new shard
    from the beginning) and is then allowed; the checkpoint of an epoch's last batch is one. Mid-epoch it
    raises :class:`UnevenInputsError`, the same on every rank (every rank loaded the same checkpoint; no
    collective), naming both world sizes, unless ``elastic``: the rest of the epoch then resumes on the new world
    size (:mod:`composer_join.data.elastic`). Called at every world size, 1 included. ``layout``: this run's
    data-parallel members; a checkpoint of another layout (tensor-parallel groups) counts as another world size,
    and under tensor parallelism a mid-epoch checkpoint resumes only on the same layout.
    """
    world = dist.get_world_size()
    groups = layout.tp_groups if layout is not None else None
    if resumed is None or resumed.world_size is None or (resumed.world_size, resumed.groups) == (world, groups):
        return False
    saved = _ranks(resumed.world_size, resumed.groups)
    now = _ranks(world, groups)
    epoch, batch = int(state.timestamp.epoch), int(state.timestamp.batch_in_epoch)
    tensor_parallel = groups is not None or resumed.groups is not None
    if batch > 0 and not resumed.epoch_done and (tensor_parallel or not elastic):
        why = (
            'a layout with tensor-parallel groups resumes mid-epoch only on the same layout'
            if tensor_parallel
            else 'this train data cannot name them in one global index space (a DistributedSampler or '
            'ExactDistributedSampler in a plain DataLoader, with no position of its own, can)'
        )
        raise UnevenInputsError(
            f'this checkpoint was saved by {saved} in the middle of epoch {epoch} (after batch {batch} of it), '
            f'and this run has {now}: which samples each rank has trained in that epoch belongs to the '
            f"saved ranks' shards, and {why}, so resuming here would train some samples twice and skip others. "
            f'Resume on {saved}, or from a checkpoint saved at an epoch boundary (e.g. save_interval="1ep", or the '
            f"checkpoint of the epoch's last batch), which resumes on any number of ranks.",
        )
    return True


def _ranks(world: int, groups: Optional[Sequence[Sequence[int]]]) -> str:
    if groups is None:
        return f'{world} ranks'
    return f'{world} ranks in {len(groups)} tensor-parallel groups of {len(groups[0])}'
