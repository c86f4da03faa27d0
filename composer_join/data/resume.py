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

A train dataset that resumes itself *per rank* (it has ``state_dict`` and ``load_state_dict``; not a
``streaming.StreamingDataset``, which splits one global sample space across ranks itself and is left to
Composer) is resumed by :class:`RankDatasets`, without touching the dataset object (nothing is set on it,
so it still pickles for spawn-started workers and behaves as before). Two signatures are understood:

* Composer's ``state_dict(num_samples, from_beginning)``: the dataset is handed the number of samples of
  *this rank's* shard used in the current epoch (trained by it, or in ``mode='rebalance'`` given to another
  rank; 0 at an epoch boundary), not Composer's global ``timestamp.sample_in_epoch``;
* Hugging Face ``datasets.IterableDataset``'s ``state_dict()`` (no argument: the position after the last
  example it yielded). UnevenJoin reads one batch ahead (and, rebalancing, a donor reads the batches it
  gives), so the dataset's own position is past the trained samples: :meth:`RankDatasets.open` keeps the
  dataset's ``state_dict()`` after every batch read, and a checkpoint saves the one at the trained
  position. Such a dataset reports its position only when it is read in the main process: with
  DataLoader workers (``num_workers > 0``) a mid-epoch checkpoint stops every rank with an error.
  (Hugging Face's ``load_state_dict`` also applies to every later iteration of the same epoch number, so
  after the resumed epoch each epoch starts from the dataset's initial state, reloaded.)

Composer would save rank 0's dataset state only (calling ``state_dict(num_samples, True)``, which the
Hugging Face signature refuses with ``TypeError``), and load it into every rank's dataset. So for such a
dataset UnevenJoin takes ``dataset_state`` out of what Composer saves, and puts every rank's own dataset
state (and its sample counts) into its own ``state_dict``: one ``all_gather_object`` each time Composer
saves a checkpoint (``State.state_dict()``, which Composer calls on every rank), nothing otherwise. On
resuming, each rank loads its own entry into its dataset at ``FIT_START``, before the first batch is read,
and Composer then does not spin the dataloader. Sharded checkpoints carry the same entries (UnevenJoin's
state is the same on every rank). A checkpoint written by 0.1.0 (with Composer's ``dataset_state``)
resumes the same way.

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
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

from composer.core import State
from composer.utils import dist

from composer_join.core.errors import UnevenInputsError
from composer_join.core.report import EpochReport
from composer_join.rebalance.rebalance import Rebalancer

__all__ = [
    'RankDatasets',
    'check_world_size',
    'restore',
    'resume_counts',
    'saved_world_size',
    'snapshot',
    'takes_sample_count',
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


class RankDatasets:
    """Every rank's own dataset state, for a train dataset that resumes itself per rank (:meth:`applies`).

    Args:
        state: the trainer's state (its ``timestamp.sample_in_epoch`` tells an epoch boundary, 0, from the middle).
        dataset: this rank's train dataset, left untouched.
        trained: ``() -> samples this rank trained in the current epoch`` (its report count).
        used: ``() -> samples of this rank's shard used in the current epoch`` (what the dataset gets).
        sent: ``() -> bytes this rank sent in the current epoch`` (``mode='rebalance'``).
        count: ``batch -> its samples`` (-1 if uncountable), as Composer counts them.
        workers: the train DataLoader's ``num_workers``.

    :meth:`gather` is collective: call it on every rank, as Composer's ``State.state_dict()`` is.
    The innermost reader of the user's dataloader opens it with :meth:`open`.
    """

    def __init__(
        self,
        state: State,
        dataset: Any,
        trained: Callable[[], int],
        used: Callable[[], int],
        sent: Callable[[], int] = lambda: 0,
        count: Callable[[Any], int] = lambda batch: -1,
        workers: int = 0,
    ):
        self.state, self.dataset, self.trained, self.used, self.sent = state, dataset, trained, used, sent
        self.count, self.workers = count, workers
        self.positional = takes_sample_count(dataset.state_dict)
        # Hugging Face style: the initial position, and the positions after each batch read (samples -> state)
        self._initial = None if self.positional else dataset.state_dict()
        self._trail: dict[int, Any] = {}
        self._loaded: Optional[Any] = None  # the state just loaded, until the iteration it applies to opens
        self._resumed = False  # a state was loaded: later epochs must start from the initial state again
        # Composer's rank-0 copy calls state_dict(num_samples, from_beginning), which a Hugging Face style dataset
        # does not take: leave it out for those (UnevenJoin saves each rank's); a sharded checkpoint's load expects it
        # for the others, whose state_dict takes Composer's arguments
        if not self.positional and 'dataset_state' in state.serialized_attributes:
            state.serialized_attributes.remove('dataset_state')

    @staticmethod
    def applies(dataset: Any) -> bool:
        """Whether ``dataset`` resumes itself per rank (has both methods; not a StreamingDataset)."""
        return (
            callable(getattr(dataset, 'state_dict', None))
            and callable(getattr(dataset, 'load_state_dict', None))
            and not _splits_globally(dataset)
        )

    def open(self, dataloader: Iterable, offset: int) -> Iterator[Any]:
        """``iter(dataloader)`` for an iteration that starts after ``offset`` own samples of the epoch.

        Hugging Face style: yields the same batches, keeping the dataset's position after each one.
        """
        if self.positional:
            return iter(dataloader)
        if self._loaded is None and self._resumed:  # an epoch after the resumed one: from the start again
            self.dataset.load_state_dict(copy.deepcopy(self._initial))
        start = self._loaded if self._loaded is not None and offset else self._initial
        self._loaded, self._trail = None, {offset: start}
        return self._follow(iter(dataloader), offset)

    def _follow(self, batches: Iterator[Any], samples: int) -> Iterator[Any]:
        for batch in batches:
            n = self.count(batch)
            samples = -1 if min(n, samples) < 0 else samples + n
            used = self.used()
            self._trail = {k: v for k, v in self._trail.items() if k >= used}
            self._trail[samples] = self.dataset.state_dict()
            yield batch

    def _own_state(self, num_samples: int) -> Any:
        """This rank's dataset state for a checkpoint (``num_samples``: Composer's; 0 at an epoch boundary)."""
        used = self.used() if num_samples else 0
        if self.positional:
            return self.dataset.state_dict(used, True)
        if not num_samples:
            return copy.deepcopy(self._initial)
        if self.workers > 0:
            raise UnevenInputsError(
                f'the train dataset ({type(self.dataset).__name__}) is read by {self.workers} DataLoader workers, '
                "so its state_dict() does not follow what was read (it is kept in each worker's copy): a mid-epoch "
                'checkpoint cannot resume it exactly. Read it with num_workers=0, save checkpoints at epoch ends only, '
                'or use a map-style dataset (Composer resumes those by spinning the sampler)'
            )
        if used not in self._trail:
            raise UnevenInputsError(
                f'the position of the train dataset after {used} samples of this epoch is not known (its batches '
                'could not be counted); a mid-epoch checkpoint cannot resume it exactly'
            )
        return self._trail[used]

    def gather(self) -> list[dict[str, Any]]:
        """Per rank: ``{'trained', 'used', 'sent', 'dataset'}`` (its dataset's own state). One ``all_gather_object``.

        If some rank cannot give its state, every rank raises :class:`UnevenInputsError` (that rank with why).
        """
        num_samples = int(self.state.timestamp.sample_in_epoch)
        try:
            mine: dict[str, Any] = {
                'trained': self.trained() if num_samples else 0,
                'used': self.used() if num_samples else 0,
                'sent': self.sent() if num_samples else 0,
                'dataset': self._own_state(num_samples),
            }
            error: Optional[UnevenInputsError] = None
        except UnevenInputsError as e:
            mine, error = {'error': str(e)}, e
        gathered = dist.all_gather_object(mine)
        failed = [r for r, entry in enumerate(gathered) if 'error' in entry]
        if error is not None:
            raise error
        if failed:
            raise UnevenInputsError(
                f'rank(s) {failed} cannot save the position of their train dataset in this checkpoint: '
                f'{gathered[failed[0]]["error"]}'
            )
        return gathered

    def load(self, saved: list[dict[str, Any]]) -> dict[str, Any]:
        """Load this rank's entry of ``saved`` into its dataset; return the entry. Raises the same on every rank.

        Composer then does not spin the dataloader (``state.dataset_resumption['train']``).
        """
        world, rank = dist.get_world_size(), dist.get_global_rank()
        if len(saved) != world:
            raise UnevenInputsError(
                f"the checkpoint holds the dataset states of {len(saved)} ranks, but this run has {world}: each rank's "
                f'dataset resumes itself from its own state, so resume with the same world size (or without '
                f"UnevenJoin's per-rank states: load_ignore_keys=['state/algorithms'] and the dataset restarts the epoch)",
            )
        own = saved[rank]['dataset']
        self.dataset.load_state_dict(own)
        self.state.dataset_resumption['train'] = True
        self._loaded, self._resumed = own, True
        return saved[rank]


def takes_sample_count(state_dict: Callable[..., Any]) -> bool:
    """Whether ``state_dict`` takes Composer's ``(num_samples, from_beginning)`` (else: no argument, as Hugging Face's).

    Example:
        >>> takes_sample_count(lambda num_samples, from_beginning: {}), takes_sample_count(lambda: {})
        (True, False)
    """
    try:
        inspect.signature(state_dict).bind(0, True)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume Composer's protocol
        return True
    return True


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
