"""Where one rank stands in its train data, read and restored through its data library's own protocol.

Data libraries keep a position in different ways, and each is spoken to in its own way, by an adapter
chosen from *what the object is* (its class, looked up along its MRO), never from the shape of its
methods; the train dataloader is looked up first, then its dataset:

* torchdata's ``StatefulDataLoader`` and litdata's ``StreamingDataLoader``: :class:`LoaderPosition`, the
  loader's ``state_dict()`` after every batch read, ``load_state_dict`` on resuming;
* litdata's ``StreamingDataset`` in a plain DataLoader: :class:`LitDataPosition` (replayed with workers);
* Hugging Face ``datasets.IterableDataset``: :class:`HuggingFacePosition`, its ``state_dict()`` after every
  batch read (replayed with workers, or with a shuffle buffer: :func:`hugging_face_position`);
* mosaicml-streaming's ``StreamingDataset``: none, left to Composer (one global sample space);
* a class registered with :class:`SampleCountPosition`: Composer's ``state_dict(num_samples,
  from_beginning)``, given this rank's own count;
* anything else with ``state_dict`` and ``load_state_dict``: none, left to Composer as stock Composer treats
  it (its rank-0 ``dataset_state``), and rank 0 warns once; anything else: Composer replays the epoch.

A data class of one's own gets an adapter with :func:`register_position`. Who calls what, and when:

* :func:`position_for` builds the adapter once per ``fit()``, at ``FIT_START``, from the train dataloader; its
  :class:`Kind` travels in the fit's first agreement, and :func:`agreed_position` keeps it where every rank's
  kind is the same, else replays every rank's data (so that whether positions are gathered at a checkpoint is
  decided alike on every rank, never by one rank's ``num_workers`` or shuffle buffer);
* the innermost reader of the user's dataloader (the join's loader, or a rebalancer beneath it) calls
  :meth:`Position.open` on every epoch's fresh iterator and reads the batches it returns (the same ones);
* :class:`~composer_join.data.resume.RankPositions` calls :meth:`Position.save` on every rank when Composer
  saves a checkpoint, and :meth:`Position.load` at ``FIT_START`` of a resumed run, before any batch is read.

Example (a dataset of one's own that speaks Composer's protocol)::

    from composer_join import SampleCountPosition, register_position

    register_position(MyShard, SampleCountPosition)  # MyShard.state_dict(num_samples, from_beginning)
"""

from __future__ import annotations

import abc
import copy
import enum
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from composer.utils import dist

from composer_join.core.errors import UnevenInputsError

__all__ = [
    'Kind',
    'LitDataPosition',
    'LoaderPosition',
    'Position',
    'Reading',
    'Replay',
    'SampleCountPosition',
    'TrailPosition',
    'agreed_position',
    'hugging_face_position',
    'keeps_state',
    'kind_of',
    'left_to_composer',
    'litdata_position',
    'position_for',
    'register_position',
]

log = logging.getLogger(__name__)


class Kind(enum.IntEnum):
    """How a rank's train data keeps its position (:func:`kind_of`), as the fit's first agreement carries it.

    Whether the ranks' positions are gathered at a checkpoint (one ``all_gather_object``), and whether Composer
    spins the resumed epoch, follow from it: where the ranks' kinds differ, :func:`agreed_position` replays
    every rank's data.
    """

    NONE = 0
    """No position of its own: Composer replays the epoch to the step (spinning)."""
    REPLAY = 1
    """A position UnevenJoin knows but replays (:class:`Replay`)."""
    OWN = 2
    """Its own position, every rank's kept in UnevenJoin's checkpoint entry (gathered at checkpoints)."""
    GLOBAL_ORDER = 3
    """A global-order sampler's description (:mod:`composer_join.data.elastic`; gathered at checkpoints)."""
    COMPOSER = 4
    """Registered as Composer's to resume (mosaicml-streaming: one global sample space)."""
    UNREGISTERED = 5
    """``state_dict`` and ``load_state_dict``, no adapter: left to Composer (its rank-0 ``dataset_state``)."""
    REST = 6
    """The rest of an epoch resumed on another world size (:mod:`composer_join.data.elastic`)."""


_KIND_WORDS = {
    Kind.NONE: 'no position of its own (replayed)',
    Kind.REPLAY: 'replayed',
    Kind.OWN: 'its own position',
    Kind.GLOBAL_ORDER: "its DistributedSampler's order",
    Kind.COMPOSER: 'left to Composer',
    Kind.UNREGISTERED: 'left to Composer (a state_dict UnevenJoin does not know)',
    Kind.REST: 'the rest of an epoch resumed on another world size',
}


@dataclass(frozen=True)
class Reading:
    """What the reader of the user's dataloader tells a :class:`Position` when an epoch's iteration opens."""

    count: Callable[[Any], int]
    """A batch's samples, as Composer counts them (-1: uncountable)."""
    used: Callable[[], int]
    """Own samples used so far in the epoch: trained here or (rebalancing) given to another rank."""
    start: int = 0
    """Own samples of the epoch before this iteration: nonzero when it continues a restored checkpoint's epoch."""


class Position(abc.ABC):
    """One rank's place in its train data, spoken to through one data library's protocol.

    Args:
        target: the object that keeps the position (the train dataloader, or its dataset), as registered.
        dataloader: the train dataloader (its ``num_workers`` and ``batch_size``).

    Subclasses implement :meth:`save` and :meth:`load`; :meth:`open` defaults to ``iter(dataloader)``.
    :meth:`save` may raise :class:`~composer_join.UnevenInputsError` where the position cannot be given
    (every rank then stops, the failing rank with its reason).
    """

    resumes_itself = True
    """After :meth:`load`, the target starts at the saved position: Composer must not replay the epoch."""
    elastic = False
    """Its entries let a mid-epoch checkpoint resume on another world size (:mod:`composer_join.data.elastic`)."""
    leaves_out_composer_state = True
    """Composer's rank-0 ``dataset_state`` is left out of checkpoints while a fit runs (Composer would call
    ``state_dict(num_samples, from_beginning)``, with the global count, on this data)."""

    def __init__(self, target: Any, dataloader: Any):
        self.target, self.dataloader = target, dataloader

    @property
    def kind(self) -> Kind:
        """How it keeps the position, for the first agreement (:func:`kind_of`)."""
        if self.elastic:
            return Kind.GLOBAL_ORDER
        return Kind.OWN if self.resumes_itself else Kind.REPLAY

    @property
    def workers(self) -> int:
        """The train dataloader's ``num_workers`` (0: read in this process)."""
        return int(getattr(self.dataloader, 'num_workers', 0) or 0)

    def open(self, dataloader: Iterable, reading: Reading) -> Iterator[Any]:
        """Every epoch's iteration over the user's dataloader: ``iter(dataloader)``, or the same batches, followed."""
        return iter(dataloader)

    @abc.abstractmethod
    def save(self, used: int) -> Any:
        """The position after ``used`` samples of this rank's own data in the current epoch (0: an epoch boundary).

        Called on every rank when Composer saves a checkpoint; plain, picklable data. ``used`` counts the
        samples trained here or, rebalancing, given to another rank; the reader may already be a batch or
        two further (the join reads a step ahead).
        """

    @abc.abstractmethod
    def load(self, state: Any) -> None:
        """Restore :meth:`save`'s ``state`` before the first batch of a resumed run is read."""

    def kept(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every rank's gathered entry (its ``dataset``: what :meth:`save` gave on that rank) as the checkpoint holds
        it; called on every rank with the same ``entries``. By default as gathered (each rank's position is its own);
        a position that is the same on every rank may keep it once (a global-order sampler's description:
        :mod:`composer_join.data.elastic`)."""
        return entries


class SampleCountPosition(Position):
    """Composer's protocol: ``state_dict(num_samples, from_beginning)`` and ``load_state_dict(state)``.

    Composer would hand the dataset its *global* ``sample_in_epoch`` (every rank's samples); this adapter
    hands it the samples of this rank's own shard used in the epoch, which is what a per-rank shard
    resumes from. Register a dataset class of one's own with it (:func:`register_position`).
    """

    leaves_out_composer_state = False  # Composer calls its signature rightly (a sharded checkpoint's load expects it)

    def save(self, used: int) -> Any:
        return self.target.state_dict(used, True)

    def load(self, state: Any) -> None:
        self.target.load_state_dict(state)


class Replay(Position):
    """No state of its own in a checkpoint: Composer replays the epoch to the step (its default, "spinning").

    Exact for data that iterates the same way every time (a seeded shuffle included). Used where a library's
    own position would not be exact (a Hugging Face shuffle buffer is lost on resumption; a dataset read by
    DataLoader workers keeps its position in the workers' copies); Composer's rank-0 ``dataset_state`` is
    left out of checkpoints all the same (Composer would call ``state_dict(num_samples, from_beginning)``).
    """

    resumes_itself = False

    def __init__(self, target: Any, dataloader: Any, why: str = ''):
        super().__init__(target, dataloader)
        self.why = why

    def save(self, used: int) -> Any:
        return None

    def load(self, state: Any) -> None:
        pass


class TrailPosition(Position):
    """A position to read right after each batch: the library reports where its last read stopped.

    :meth:`open` keeps :meth:`read` after every batch, by the own samples read so far in the epoch;
    :meth:`save` returns the entry at ``used`` (the join reads ahead, so the library itself is further on)
    and, at an epoch boundary, :meth:`boundary`. Entries behind ``used`` are dropped as reading goes on, so
    only the few read ahead are kept. Costs one :meth:`read` and one deep copy per batch.

    A loaded state is applied by the library when the next iteration first reads, which a rank with nothing
    left in the resumed epoch never does; so the first iteration of a later epoch opens with :meth:`fresh`.
    """

    def __init__(self, target: Any, dataloader: Any):
        super().__init__(target, dataloader)
        self._trail: dict[int, Any] = {}
        self._loaded: Any = None  # the state load() restored, until the iteration it starts opens
        self._applied = False  # a state was loaded: the next epoch's iteration must start fresh

    def open(self, dataloader: Iterable, reading: Reading) -> Iterator[Any]:
        if not reading.start and self._applied:
            self.fresh()
        self._applied = bool(reading.start) and self._applied
        self._trail = {reading.start: self._loaded if reading.start else self.boundary()}
        self._loaded = None
        return self._follow(iter(dataloader), reading)

    def _follow(self, batches: Iterator[Any], reading: Reading) -> Iterator[Any]:
        samples = reading.start
        for batch in batches:
            n = reading.count(batch)
            samples = -1 if min(n, samples) < 0 else samples + n
            used = reading.used()
            self._trail = {k: v for k, v in self._trail.items() if k >= used}
            self._trail[samples] = copy.deepcopy(self.read(samples))
            yield batch

    @abc.abstractmethod
    def read(self, samples: int) -> Any:
        """The library's position now, right after a batch was read (``samples``: own samples read in the epoch)."""

    def boundary(self) -> Any:
        """What a checkpoint at an epoch boundary holds: by default none (the next epoch starts fresh by itself)."""
        return None

    def fresh(self) -> None:
        """Make the next iteration start its epoch from the beginning, after a loaded state (by default: nothing)."""

    def save(self, used: int) -> Any:
        if not used:
            return self.boundary()
        if used not in self._trail:
            raise UnevenInputsError(
                f'the position of the train data ({type(self.target).__name__}) after {used} samples of this epoch '
                'is not known (its batches could not be counted); a mid-epoch checkpoint cannot resume it exactly'
            )
        return self._trail[used]

    def load(self, state: Any) -> None:
        self._loaded = state
        if state is not None:
            self.target.load_state_dict(copy.deepcopy(state))
            self._applied = True


class HuggingFacePosition(TrailPosition):
    """Hugging Face ``datasets.IterableDataset``: ``state_dict()`` is where the last read stopped.

    A fresh iteration starts from the beginning unless a state was loaded, whatever was read before (a peek,
    a count): the epoch boundary is "no state". A loaded state applies to every later iteration of the same
    epoch number (``set_epoch``), so the epoch after a resumed one opens with it taken back
    (``load_state_dict({})``, an empty state: nothing to resume from).
    """

    def read(self, samples: int) -> Any:
        return self.target.state_dict()

    def fresh(self) -> None:
        self.target.load_state_dict({})


def hugging_face_position(dataset: Any, dataloader: Any) -> Position:
    """:class:`HuggingFacePosition` where its state is exact; else :class:`Replay` (Composer replays the epoch)."""
    if int(getattr(dataloader, 'num_workers', 0) or 0) > 0:
        return Replay(dataset, dataloader, "read by DataLoader workers: its state_dict() stays in the workers' copies")
    from composer_join.core.compat import hf_shuffle_buffer

    if hf_shuffle_buffer(dataset):
        return Replay(dataset, dataloader, 'it shuffles with a buffer, which its state_dict() does not hold')
    return HuggingFacePosition(dataset, dataloader)


class LitDataPosition(TrailPosition):
    """litdata's ``StreamingDataset`` read by a plain DataLoader in this process: ``state_dict(num_samples_yielded,
    num_workers, batch_size)`` with this rank's count, read after every batch (its epoch counter moves when an
    iteration ends), and with the dataset's own ``batch_size`` (a plain DataLoader sets none: 1) and one worker
    (this process): other values make litdata re-split the data over the ranks ("elastic") when it resumes.
    At a boundary, the position at 0 samples (it carries the epoch counter); a loaded state it has not used
    when its epoch ends is dropped (``reset_state_dict``)."""

    def read(self, samples: int) -> Any:
        return self.target.state_dict(samples, 1, self.target.batch_size)

    def boundary(self) -> Any:
        return copy.deepcopy(self.read(0))

    def fresh(self) -> None:
        self.target.reset_state_dict()


def litdata_position(dataset: Any, dataloader: Any) -> Position:
    """:class:`LitDataPosition` in this process; replayed when DataLoader workers read it (litdata counts its
    position by workers only in its own ``StreamingDataLoader``)."""
    if int(getattr(dataloader, 'num_workers', 0) or 0) > 0:
        return Replay(
            dataset, dataloader, 'read by the workers of a plain DataLoader (use litdata.StreamingDataLoader)'
        )
    return LitDataPosition(dataset, dataloader)


class LoaderPosition(TrailPosition):
    """A dataloader that keeps its own position (torchdata's ``StatefulDataLoader``, litdata's
    ``StreamingDataLoader``): its ``state_dict()`` after every batch read, DataLoader workers included."""

    def read(self, samples: int) -> Any:
        return self.target.state_dict()


Factory = Callable[[Any, Any], Optional[Position]]
_REGISTRY: dict[Union[type, str], Optional[Factory]] = {
    'torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader': LoaderPosition,
    'litdata.streaming.dataloader.StreamingDataLoader': LoaderPosition,
    'litdata.streaming.dataset.StreamingDataset': litdata_position,
    'datasets.iterable_dataset.IterableDataset': hugging_face_position,
    'streaming.base.dataset.StreamingDataset': None,  # mosaicml-streaming: Composer resumes it
}
_WARNED: set[type] = set()


def register_position(kind: Union[type, str], adapter: Optional[Factory]) -> None:
    """Speak to ``kind`` (a class, or its ``'module.QualName'``) and its subclasses through ``adapter``.

    ``adapter``: a :class:`Position` subclass, or a function ``(target, train dataloader) -> Position``;
    ``None`` leaves the class to Composer (no warning). A later registration for the same class replaces
    the earlier one. Registered in every rank's process (at import of the module that defines the data).
    """
    if not isinstance(kind, (type, str)):
        raise TypeError(f'register_position(kind, ...) takes a class or its qualified name; got {kind!r}')
    if adapter is not None and not callable(adapter):
        raise TypeError(
            f'register_position(..., adapter) takes a Position subclass, a function or None; got {adapter!r}'
        )
    _REGISTRY[kind] = adapter


def _lookup(obj: Any) -> tuple[bool, Optional[Factory]]:
    """``(registered, adapter)`` for ``obj``'s class or its nearest registered base class."""
    for cls in type(obj).__mro__:
        for key in (cls, f'{cls.__module__}.{cls.__qualname__}'):
            if key in _REGISTRY:
                return True, _REGISTRY[key]
    return False, None


def position_for(dataloader: Any, dataset: Any) -> Optional[Position]:
    """The adapter for this rank's train data (the dataloader first, then its dataset), or None (left to Composer).

    A dataset that has ``state_dict`` and ``load_state_dict`` but no adapter is left to Composer as stock Composer
    treats it (its rank-0 ``dataset_state``; :class:`Kind` ``UNREGISTERED``; :func:`agreed_position` warns).
    """
    for target in (dataloader, dataset):
        if target is None:
            continue
        registered, adapter = _lookup(target)
        if registered:
            return None if adapter is None else adapter(target, dataloader)
    return None


def kind_of(position: Optional[Position], dataloader: Any, dataset: Any) -> Kind:
    """How this rank's train data keeps its position: its adapter's :attr:`Position.kind`, or (no adapter) who
    resumes it."""
    if position is not None:
        return position.kind
    if left_to_composer(dataloader, dataset):
        return Kind.COMPOSER
    return Kind.UNREGISTERED if dataset is not None and _has_state(dataset) else Kind.NONE


def agreed_position(
    position: Optional[Position], kinds: Sequence[int], dataloader: Any, dataset: Any, replay: bool = False
) -> Optional[Position]:
    """This rank's adapter, now that every rank's :func:`kind_of` is known (the fit's first agreement).

    ``position`` where every rank's kind is the same; else a :class:`Replay` on every rank (Composer spins the epoch,
    its rank-0 ``dataset_state`` is left out of checkpoints: every rank resumes alike), and rank 0 warns naming each
    rank's kind. The rest of an epoch resumed on another world size on some ranks only stops every rank. ``replay``
    (the same on every rank): the position cannot be read as the batches are (rebalancing without ``len()`` reads
    ahead into buffers no checkpoint holds): one that resumes itself is replayed. Called on every rank with the same
    ``kinds``; no collective.
    """
    rank = dist.get_global_rank()
    if len(set(kinds)) > 1:
        position = _replay_every_rank(position, kinds, dataloader, dataset)
    elif kinds and kinds[rank] == Kind.UNREGISTERED:
        _warn_unregistered(dataset)
    if replay and position is not None and position.resumes_itself:
        why = 'rebalancing without len() reads ahead into buffers that a checkpoint does not hold'
        position = Replay(position.target, dataloader, why)
    if isinstance(position, Replay):
        log.info('UnevenJoin: %s is replayed on resumption (%s).', type(position.target).__name__, position.why)
    return position


def _replay_every_rank(position: Optional[Position], kinds: Sequence[int], dataloader: Any, dataset: Any) -> Replay:
    """:func:`agreed_position` where the ranks' kinds differ: this rank's :class:`Replay`; rank 0 warns."""
    held = {Kind(k): [r for r, other in enumerate(kinds) if other == k] for k in dict.fromkeys(kinds)}
    ranks = '; '.join(f'rank(s) {rs}: {_KIND_WORDS[k]}' for k, rs in held.items())
    if Kind.REST in held:
        raise UnevenInputsError(
            f"resuming mid-epoch on another world size, the ranks' train data keep their positions differently "
            f'({ranks}); each rank must be given its share of what no rank had trained. Give every rank the same kind '
            f'of train data, or resume at an epoch boundary.',
        )
    if dist.get_global_rank() == 0:
        warnings.warn(
            f"UnevenJoin: the ranks' train data keep their positions differently ({ranks}), from settings of their "
            f"own (a DataLoader's num_workers, a shuffle buffer, a sampler, the dataset's class): every rank's is "
            f"replayed on resumption instead (Composer spins the epoch to the checkpoint's step, and its rank-0 "
            f'dataset_state is left out), which is exact for data that iterates the same way every time. Give every '
            f'rank the same kind of data to resume from positions.',
            stacklevel=3,
        )
    target = position.target if position is not None else dataset if dataset is not None else dataloader
    return Replay(target, dataloader, f'the ranks keep their positions differently ({ranks})')


def _warn_unregistered(dataset: Any) -> None:
    """On rank 0, once per class: ``dataset`` has a position UnevenJoin does not know, left to Composer."""
    cls = type(dataset)
    if cls in _WARNED or dist.get_global_rank() != 0:
        return
    _WARNED.add(cls)
    warnings.warn(
        f'UnevenJoin does not know how {cls.__module__}.{cls.__qualname__} keeps its position (it has state_dict and '
        "load_state_dict): it is left to Composer, as stock Composer treats it. Composer saves rank 0's dataset "
        'state, calling state_dict(num_samples, from_beginning) with the global sample count, and loads it into '
        "every rank's dataset: where each rank's dataset holds a shard of its own, a run resumed mid-epoch starts "
        "every rank at rank 0's position, and the ranks then run short (or long). Register an adapter: "
        "composer_join.register_position(YourDataset, composer_join.SampleCountPosition) for Composer's protocol "
        '(each rank is given its own sample count), or a composer_join.Position subclass of your own '
        '(docs/data-pipelines.md).',
        stacklevel=3,
    )


def left_to_composer(dataloader: Any, dataset: Any) -> bool:
    """Whether the train data is registered as Composer's to resume (mosaicml-streaming: one global sample space,
    resumed on any number of ranks by Composer and the dataset themselves)."""
    for target in (dataloader, dataset):
        if target is not None:
            registered, adapter = _lookup(target)
            if registered:
                return adapter is None
    return False


def keeps_state(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict`` and ``load_state_dict`` (Composer then checkpoints it as dataset state)."""
    return _has_state(obj)


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, 'state_dict', None)) and callable(getattr(obj, 'load_state_dict', None))
