"""A fit's train data as UnevenJoin reads it: where it starts, whose position a checkpoint keeps, and its loader.

At ``FIT_START`` a fit session (:class:`~composer_join.join.fit.FitSession`) asks, on every rank:

* :func:`rest_of_epoch`: whether a mid-epoch checkpoint of data sharded by a global-order sampler resumes on
  another world size (:mod:`composer_join.data.elastic`): this rank's share of the samples no rank had used;
* :func:`own_position` and :func:`rank_positions`: this rank's position adapter for data that keeps its own
  position (:mod:`composer_join.data.positions`), and the per-rank positions the ranks agreed on in the length
  agreement (:class:`~composer_join.data.resume.RankPositions`);
* :func:`train_loader`: the train dataloader joined (:func:`~composer_join.join.loader.join_dataloader`), with
  this rank's facts for the first agreement.

Everything here is decided from the checkpoint, the world size and the data, which every rank has alike, or
travels in the first agreement.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any, NamedTuple, Optional, cast

from composer.core import State
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join.core.changes import Changes
from composer_join.core.compat import TrainView
from composer_join.core.errors import UnevenInputsError
from composer_join.core.layout import Layout
from composer_join.core.report import EpochReport
from composer_join.core.settings import Facts
from composer_join.core.source import BatchSource
from composer_join.data.elastic import (
    GlobalOrder,
    GlobalOrderPosition,
    layout_of,
    one_epoch_loader,
    remaining_for,
)
from composer_join.data.positions import (
    Position,
    agreed_position,
    keeps_state,
    kind_of,
    left_to_composer,
    position_for,
)
from composer_join.data.resume import RankPositions, Resumed, train_position
from composer_join.join.context import Context
from composer_join.join.loader import JoinLoader, TrainData, join_dataloader

__all__ = [
    'Rest',
    'mid_epoch',
    'own_position',
    'rank_positions',
    'rest_of_epoch',
    'train_loader',
    'unsaved_positions',
]

log = logging.getLogger(__name__)


class Rest(NamedTuple):
    """The rest of an epoch resumed on another world size: this rank's indices, the layout, the sampler's order;
    or (all None) data Composer resumes itself (mosaicml-streaming), whose rest of the epoch has no known length."""

    indices: Optional[list[int]] = None
    layout: Optional[dict[str, Any]] = None
    order: Optional[GlobalOrder] = None


def mid_epoch(state: State, resumed: Resumed) -> bool:
    """The checkpoint resumed was saved mid-epoch (not after an epoch's last batch)."""
    return int(state.timestamp.batch_in_epoch) > 0 and not resumed.epoch_done


def rest_of_epoch(state: State, resumed: Optional[Resumed], layout: Layout, dataset: Any) -> Optional[Rest]:
    """This rank's share of the samples no rank had used, where a mid-epoch checkpoint of data sharded by a
    global-order sampler (:mod:`composer_join.data.elastic`) resumes on another world size, or continues an
    epoch already resumed so; None otherwise (same world size: Composer replays; else refused or a boundary).
    ``dataset``: the one Composer reaches through the train dataloader (:attr:`~composer_join.core.compat.TrainView`)."""
    dataloader = state.train_dataloader
    if resumed is None or resumed.epoch_done or int(state.timestamp.batch_in_epoch) == 0:
        return None
    if layout.tp > 1 or resumed.groups is not None:
        return None  # tensor-parallel groups: the same layout only (Composer replays), else refused
    if left_to_composer(dataloader, dataset) and resumed.world_size not in (None, dist.get_world_size()):
        return Rest()  # Composer and the dataset resume its global sample space on any number of ranks
    if position_for(dataloader, dataset) is not None or keeps_state(dataset):
        return None  # the data keeps a position of its own
    order = GlobalOrder.of(dataloader)
    entries = resumed.ranks
    if entries is None and resumed.world_size == 1 and order is not None:  # one rank: UnevenJoin was inactive
        entries = [{'used': int(state.timestamp.sample_in_epoch), 'dataset': {'order': asdict(order)}}]
    if order is None or entries is None:
        return None
    relaid = any(isinstance(e.get('dataset'), dict) and e['dataset'].get('layout') for e in entries)
    if len(entries) == dist.get_world_size() and not relaid:
        return None  # the sampler's own shards: Composer replays the epoch to the step
    world, rank = dist.get_world_size(), dist.get_global_rank()
    indices = remaining_for(entries, order, int(state.timestamp.epoch), world, rank)
    if indices is None:
        return None
    cap = state.dataloader_len
    if cap is not None and int(cap) < len(cast(DataLoader, dataloader)):  # train_subset_num_batches
        warnings.warn(
            f'UnevenJoin: train_subset_num_batches={int(cap)}: the rest of epoch {int(state.timestamp.epoch)}, '
            f'resumed on {world} ranks from a checkpoint of {len(entries)}, trains every sample no rank had '
            'used (a subset of the old shards has no meaning on the new world size); the next epochs take '
            'the subset again.',
            stacklevel=2,
        )
    log.info(
        'UnevenJoin: resuming epoch %d of a checkpoint of %d ranks on %d: this rank trains %d samples no rank '
        'had used.',
        int(state.timestamp.epoch),
        len(entries),
        world,
        len(indices),
    )
    return Rest(indices, layout_of(entries), order)


def own_position(
    state: State, dataset: Any, layout: Layout, rest: Optional[Rest] = None, reused: Optional[Position] = None
) -> Optional[Position]:
    """This rank's adapter for train data that keeps its own position, or is sharded by a global-order sampler
    (None: left to Composer, or nothing to keep), as its own data is; ``rest``: the rest of an epoch resumed
    elastically. The ranks then agree on it (:func:`rank_positions`); ``reused``: the adapter of
    the trainer's last fit."""
    # Composer reaches the dataset through state.train_dataloader, the user's own DataLoader (left untouched).
    dataloader = state.train_dataloader
    if rest is not None and rest.order is not None:
        return GlobalOrderPosition(dataloader, dataloader, rest.order, rest.layout)
    if reused is not None and reused.resumes_itself and reused.target in (dataloader, dataset):
        return reused  # a second fit() on the same data: it knows what it loaded into it
    position = position_for(dataloader, dataset)
    if position is None and not keeps_state(dataset) and layout.tp == 1:
        order = GlobalOrder.of(dataloader)
        if order is not None:
            position = GlobalOrderPosition(dataloader, dataloader, order)
    return position


def rank_positions(
    state: State, dataset: Any, source: BatchSource, candidate: Optional[Position], facts: list[Facts]
) -> Optional[RankPositions]:
    """The per-rank positions the ranks agreed on, from every rank's ``facts`` (None: left to Composer), read
    through ``source``: this rank's ``candidate`` where every rank's kind is the same, else every rank replays."""
    dataloader = state.train_dataloader
    kinds = [f.position for f in facts]
    replay = source.reads_ahead  # the same on every rank (the rebalancer comes from the agreed lengths)
    position = agreed_position(candidate, kinds, dataloader, dataset, replay)
    return None if position is None else RankPositions(state, position)


def train_loader(
    context: Context,
    state: State,
    view: TrainView,
    earlier: Optional[JoinLoader],
    install: Callable[[Changes], None],
    reused: Optional[Position] = None,
    finished: bool = False,
    report: Optional[EpochReport] = None,
    rest: Optional[Rest] = None,
    cap: Any = None,
) -> JoinLoader:
    """The train dataloader, joined: Composer's (``state.dataloader``), the rest of an epoch resumed elastically
    (``rest``), or the user's with Composer's ``dataloader_len`` ``cap`` (the epochs after that rest).

    ``view``: Composer's view of the train data (:func:`~composer_join.core.compat.train_view`); ``earlier``: the trainer's last train loader (what it learned is kept for the same dataloader); ``install``:
    the fit's changes at each iteration; ``reused``: the last fit's position adapter; ``finished`` and ``report``:
    where the checkpoint resumed left the epoch (:func:`~composer_join.data.resume.train_position`).
    """
    dataloader: Optional[Iterable] = None
    if rest is not None and rest.indices is not None and rest.order is not None:
        dataloader = one_epoch_loader(cast(DataLoader, state.train_dataloader), rest.indices, rest.order)
    elif cap is not None:
        dataloader = state.train_dataloader
    # this rank's position adapter as its data is; the ranks agree on it in the length agreement
    user = state.train_dataloader
    candidate = own_position(state, view.dataset, context.layout, rest, reused)
    kind = kind_of(candidate, user, view.dataset)
    facts = context.facts(
        state,
        position=int(kind),
        transforms=view.transforms,
        **context.wrapper.facts(state),
    )
    train = TrainData(
        positions=lambda source, facts: rank_positions(state, view.dataset, source, candidate, facts),
        start=lambda: train_position(state, finished, view.spins),
        # (at a boundary on another world size, the report of a finished epoch of the old ranks is not this one)
        report=report,
        spec=view.spec,
        dataloader=dataloader,
        length=None if cap is None else int(cap),
        offset=int(state.timestamp.batch_in_epoch) if rest is not None and rest.indices is not None else 0,
        unsized=rest is not None and rest.indices is None,
    )
    loader = join_dataloader(context, facts, install, earlier, train=train)
    assert loader is not None  # (only an evaluation's dataloader can be left to Composer)
    return loader


def unsaved_positions(state: State) -> UnevenInputsError:
    """The error for a mid-epoch resume from a state saved where no rank's position was gathered."""
    return UnevenInputsError(
        f'the checkpoint resumed (batch {int(state.timestamp.batch_in_epoch)} of epoch {int(state.timestamp.epoch)}) '
        "was saved by a state_dict() call outside Composer's checkpoint events (where its CheckpointSaver saves, "
        'save_interval) and the end of fit(): its train data keeps a position of its own on each rank, and this '
        'checkpoint holds none, so the ranks cannot resume this epoch where they were. Resume from a checkpoint '
        "Composer's CheckpointSaver saved (save_folder, save_interval) or one saved after fit(), or at an epoch "
        'boundary.',
    )
