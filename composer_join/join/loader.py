"""What Composer sees of the join: the train (or eval, or predict) dataloader wrapped, and its length cap.

Owns the Composer-facing glue around the :class:`~composer_join.join.iterator.JoinLoader` (which only iterates):

* :func:`join_dataloader` (at ``FIT_START``, ``EVAL_START``, ``PREDICT_START``, on every rank): the first agreement
  (the ranks' lengths, settings and facts, one collective), the source of batches (:func:`batch_source`, the one
  place it is chosen), the protocol's :class:`~composer_join.core.protocol.Rules`, the loader's
  :class:`~composer_join.join.iterator.Glue` (Composer's ``DataSpec`` to count and split batches, the microbatch size
  in force, the iteration's register of changes, the sampler's epoch), and ``state.dataloader`` set to the loader
  (a :class:`JoinDataLoader` over a user's ``DataLoader``), with the agreed length;
* :func:`lift_cap`: Composer's ``dataloader_len`` cap lifted while its loop starts, where some rank's dataloader may
  yield more than its ``len()`` (:func:`may_overcount`) and its batches past the longest ``len()`` would be lost;
* :func:`pads_by_repeating`: whether a ``DistributedSampler`` evens out shards by repeating samples (left to
  Composer).

**A ``len()`` is exact, but where torch says it may undercount** (``mode='shadow'``): an ``IterableDataset`` read by
several workers yields more batches than its ``len()`` (each worker ends with its own partial batch; torch only
warns). Where some rank's is such a loader (agreed), it is trained in full: a step planned from the lengths alone is
one before the shortest rank's last batch by ``len()``; at the last step by the longest ``len()`` a rank peeks one
batch further (and keeps it), and if some rank has more the epoch goes on past ``len()``, every further step agreed,
until no rank has data (:mod:`composer_join.core.protocol`). Composer would stop asking after ``dataloader_len``
batches, so the algorithm lifts that cap while Composer starts iterating (:func:`lift_cap`) and puts it back as the
loop starts, so schedules, durations and callbacks read the longest ``len()`` from the first batch. At the end of
such an epoch rank 0 warns, once per dataloader. Elsewhere the cap holds, as without UnevenJoin, and a rank that
peeks a batch past it stops every rank with an error naming it (it would be dropped in silence). A loader whose
``len()`` is exact costs nothing more (the peek rides on the last step's agreement).

Example (what the algorithm does at ``Event.FIT_START`` and ``Event.EVAL_START``)::

    loader = join_dataloader(context, context.facts(state))  # wraps state.dataloader, puts the wrapper in its place
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Optional, cast

import torch
from composer.core import DataSpec, State
from composer.utils import dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from composer_join.core import compat
from composer_join.core.changes import Changes
from composer_join.core.exchange import TorchExchange, agree_on_length
from composer_join.core.layout import Layout, check_lengths
from composer_join.core.plan import len_or_none
from composer_join.core.protocol import Exchange, Lengths, Rules
from composer_join.core.report import EpochReport
from composer_join.core.settings import Facts
from composer_join.core.source import BatchSource, OwnBatches
from composer_join.data.positions import Kind
from composer_join.data.resume import RankPositions, Start
from composer_join.data.sampler import shard_by_layout
from composer_join.interop.metrics import MetricStates
from composer_join.join.context import Context
from composer_join.join.iterator import TEMPLATE_SAMPLES, Glue, JoinLoader, Learned, StepRecord
from composer_join.rebalance.readahead import rebalanced_without_len
from composer_join.rebalance.rebalance import rebalanced
from composer_join.rebalance.transfer import BatchChannel
from composer_join.shadow.dataspec import ShadowSplit, count_microbatches, count_samples, spec_for

__all__ = [
    'TEMPLATE_SAMPLES',
    'JoinDataLoader',
    'JoinLoader',
    'Learned',
    'Lengths',
    'StepRecord',
    'TrainData',
    'batch_source',
    'join_dataloader',
    'lift_cap',
    'may_overcount',
    'pads_by_repeating',
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainData:
    """What a fit's train loader needs beyond an evaluation's (:func:`composer_join.join.fitdata.train_loader` makes
    it for :func:`join_dataloader`)."""

    positions: Callable[[BatchSource, list[Facts]], Optional[RankPositions]] = lambda source, facts: None
    """``(source, facts) ->`` the per-rank positions of train data that keeps one, for the chosen source, from every
    rank's facts."""
    start: Optional[Callable[[], Start]] = None
    """Where each iteration starts in its epoch (:attr:`~composer_join.join.iterator.Glue.start`)."""
    report: Optional[EpochReport] = None
    """The current epoch's report, where it goes on (a checkpoint's)."""
    spec: Optional[DataSpec] = None
    """The Trainer's train ``DataSpec`` (the fit session's: None where it was not found, then Composer's defaults)."""
    dataloader: Optional[Iterable] = None
    """This one instead of ``state.dataloader`` (the rest of an epoch resumed on another world size, or the epochs
    after it), with Composer's cap :attr:`length` (default: its whole length)."""
    length: Optional[int] = None
    offset: int = 0
    """The iteration's first batch is step ``offset`` of the epoch (the rest of an epoch resumed elastically)."""
    unsized: bool = False
    """Its length is not known (the rest of an epoch a dataset resumed itself on another world size): every step
    agreed."""


def join_dataloader(
    context: Context,
    facts: Facts,
    install: Callable[[Changes], None] = lambda changes: None,
    cached: Optional[JoinLoader] = None,
    microbatch_size: Any = None,
    train: Optional[TrainData] = None,
) -> Optional[JoinLoader]:
    """Wrap ``state.dataloader`` in a :class:`JoinLoader` and set it, with the shared length, in its place.

    Called on every rank at the same point (fit, evaluation or ``predict()`` start): one collective to agree on
    the longest rank's length, which also carries every rank's settings (``context.settings``, checked to be the same
    on every rank) and ``facts`` (:class:`~composer_join.core.settings.Facts`); None (nothing wrapped) where every
    rank's dataloader repeats samples to even out the shards (``facts.repeats``: Composer's evaluation drops the
    repeats).

    ``install(changes)``: the algorithm's changes for each iteration, made through ``changes``
    (:attr:`~composer_join.join.iterator.Glue.opened`). ``cached``: a loader made earlier; if it is over the same
    dataloader object, what was learned from its batches (:class:`Learned`) is kept. ``train``: the train dataloader
    (:class:`TrainData`): its microbatch size in force, the Trainer's train ``DataSpec``, ``throw_on_early_termination``
    and ``mode='rebalance'`` (:func:`batch_source` picks the source); else an evaluation's or ``predict()``'s, whose
    microbatch counts are predicted with ``microbatch_size`` (an evaluator's, or a callable giving the size in force)
    and whose batches are counted and split with the ``DataSpec`` of the evaluator that holds the dataloader
    (:func:`~composer_join.shadow.dataspec.spec_for`). ``context.layout``: the data-parallel members: under tensor
    parallelism the ranks of a member must have the same length, and an :class:`~composer_join.ExactDistributedSampler`
    left to its defaults shards over members (:func:`~composer_join.data.sampler.shard_by_layout`, for the length
    agreement and each iteration; Composer's cap, read under the world's sharding, follows).
    """
    state, layout, settings = context.state, context.layout, context.settings
    data = train if train is not None else TrainData()
    throw = train is not None and settings.throw
    rebalance = train is not None and settings.mode == 'rebalance'
    dataloader, length, offset, unsized = data.dataloader, data.length, data.offset, data.unsized
    rank = dist.get_global_rank()
    current = None if state.dataloader_len is None else int(state.dataloader_len)
    if dataloader is not None:
        current = len_or_none(dataloader) if length is None else length
    else:
        dataloader = state.dataloader
    with Changes() as changes:
        before = len_or_none(dataloader)
        shard_by_layout(dataloader, layout, rank, changes)
        own_len = None if unsized else len_or_none(dataloader)
    if current is not None and current == before:  # Composer's cap is the whole epoch: the resharded one
        current = own_len
    current = None if unsized else current
    if rebalance and own_len is not None and current is not None:
        own_len = min(own_len, current)  # the batches of its shard this rank contributes per epoch
    facts = replace(facts, overcounts=may_overcount(dataloader))
    shared, check_overflow, own_lens, every = agree_on_length(
        own_len, current, state.device.tensor_to_device, settings.row, facts
    )
    if every and all(f.repeats for f in every):
        return None
    label = state.dataloader_label
    check_lengths(layout, own_lens, label)
    if train is not None:
        size = lambda: state.device_train_microbatch_size  # noqa: E731 (read when used: auto microbatching)
    else:
        size = microbatch_size if callable(microbatch_size) else lambda: microbatch_size
    # Composer's DataSpec, so counts are its counts; wrapped for every iteration (undone as it ends)
    if train is not None:
        spec = data.spec if data.spec is not None else DataSpec(dataloader)
    else:
        spec = spec_for(state, dataloader)

    def describe(batch: Any) -> tuple[int, int]:
        return _describe(spec, batch, size())

    exchange = TorchExchange(state.device.tensor_to_device)
    source, lengths = batch_source(
        dataloader,
        Lengths(shared, check_overflow, own_lens),
        rebalance,
        state.device.tensor_to_device,
        lambda batch: describe(batch)[0],
        layout,
        exchange,
    )
    lengths = replace(lengths.shifted(offset), lifted=any(f.overcounts for f in every))

    def opening(changes: Changes) -> None:
        shard_by_layout(dataloader, layout, rank, changes)
        install(changes)

    unregistered = bool(every) and all(f.position == Kind.UNREGISTERED for f in every)
    dataset = type(getattr(dataloader, 'dataset', None)).__name__
    rules = Rules(lengths, rank, layout, throw, label, unregistered, dataset)
    # what was learned from this dataloader object before is kept (never from another under the same label)
    if cached is not None and cached.dataloader is dataloader:
        learned = cached.learned
    else:
        learned = Learned(metric_states=MetricStates(state.device.tensor_to_device))
    loader = (JoinDataLoader if isinstance(dataloader, DataLoader) else JoinLoader)(
        source,
        Glue(
            describe,
            size,
            lambda: _opened(spec, opening),
            data.start,
            lambda epoch: _reshuffle(dataloader, epoch),
            # a batch_transforms may change the sample count: the stand-in is made from a whole batch
            None if compat.transforms_batches(spec) else TEMPLATE_SAMPLES,
        ),
        rules,
        exchange,
        learned=learned,
        positions=data.positions(source, every),
        report=data.report,
        facts=every,
    )
    state.set_dataloader(loader, label, -1 if lengths.shared is None else lengths.shared)
    log.info(
        'UnevenJoin: %s batches per rank %s; every rank runs %s steps.',
        label,
        own_lens,
        lengths.shared if lengths.shared is not None else 'until the last rank runs out',
    )
    return loader


class JoinDataLoader(JoinLoader, DataLoader):  # type: ignore[misc]  # JoinLoader.__iter__: a generator
    """The :class:`JoinLoader` over a user's ``DataLoader``, and a ``DataLoader`` to whoever checks the type:
    Composer's RandAugment, AugMix and ColOut check ``isinstance(state.dataloader, DataLoader)`` at ``FIT_START`` and
    reach the user's dataset through it. Built without ``DataLoader.__init__``: every attribute it does not have
    itself is the user's dataloader's (:meth:`JoinLoader.__getattr__`), and it iterates as a :class:`JoinLoader` only.

    Its own ``sampler`` and ``batch_sampler`` are None, so Composer's loops, which look for a ``DistributedSampler``
    in a ``DataLoader``, find none in it, exactly as in a plain :class:`JoinLoader`: UnevenJoin reshuffles the user's
    sampler itself, and decides from agreed facts where an evaluation's repeated samples are left to Composer;
    Composer's own per-batch handling of a ``DistributedSampler`` (an all-reduce per evaluation batch) would run on
    the ranks whose sampler is one and not on the others. A loader over anything else is a plain :class:`JoinLoader`.
    """

    sampler = None  # type: ignore[assignment]  # (none of its own: see above)
    batch_sampler = None


def batch_source(
    dataloader: Iterable,
    lengths: Lengths,
    rebalance: bool,
    to_device: Callable[[torch.Tensor], torch.Tensor],
    count: Callable[[Any], int],
    layout: Optional[Layout] = None,
    exchange: Optional[Exchange] = None,
    channel: Optional[BatchChannel] = None,
) -> tuple[BatchSource, Lengths]:
    """Where this rank's batches come from (the one place the kind is chosen), and the lengths the loader plans with.

    Not rebalancing, or every rank's ``len()`` 0 (nothing to move): :class:`~composer_join.core.source.OwnBatches`. Rebalancing with every rank's ``len()``:
    :class:`~composer_join.rebalance.rebalance.RebalancingLoader`, whose lengths are each rank's assigned
    batches, own and received; with some rank's unknown: :class:`~composer_join.rebalance.readahead.ReadAheadRebalancer`,
    step by step (no length known ahead). A rebalancer plans over ``layout``'s data-parallel members, and moves
    batches through ``channel`` (default: over ``torch.distributed``); the read-ahead one exchanges its levels through
    ``exchange`` (default: :class:`~composer_join.core.exchange.TorchExchange`).
    """
    per_rank = list(lengths.per_rank or [])
    source: BatchSource
    nothing_to_move = bool(per_rank) and all(n == 0 for n in per_rank)  # every len() 0 (None: unknown)
    if not rebalance or nothing_to_move:  # (Composer reads no batch there: the loader checks none would be lost)
        return OwnBatches(dataloader), lengths
    if None in per_rank:
        source, shared, overflow, assigned = rebalanced_without_len(
            dataloader, per_rank, to_device, layout, channel, exchange
        )
    else:
        counts = cast(list[int], per_rank)
        source, shared, overflow, assigned = rebalanced(
            dataloader, counts, lengths.shared, lengths.check_overflow, to_device, count, layout, channel
        )
    return source, Lengths(shared, overflow, assigned)


def _opened(spec: DataSpec, install: Callable[[Changes], None]) -> Changes:
    """The changes of one iteration: the ``DataSpec``'s split of shadow batches, then ``install``'s (the algorithm's)."""
    changes = Changes()
    try:
        ShadowSplit.install(spec, changes)
        install(changes)
    except BaseException:
        changes.undo()
        raise
    return changes


def lift_cap(state: State, loader: JoinLoader) -> None:
    """Let Composer's next loop over ``loader`` run past ``state.dataloader_len``, where some rank's dataloader may
    yield more batches than its ``len()``; the cap is back as soon as the loop has started.

    Composer's ``_iter_dataloader`` stops after ``state.dataloader_len`` batches, read once, when the
    loop starts. Where that is the longest ``len()`` and some rank's dataloader may yield more
    (:attr:`~composer_join.core.protocol.Lengths.lifted`: an ``IterableDataset`` read by several workers), that
    rank would lose its extra batches: call this on every rank right before Composer starts the loop
    (``EPOCH_START``, ``EVAL_START``, ``PREDICT_START``). The loader puts the cap back when Composer starts
    iterating it (:attr:`~composer_join.join.iterator.JoinLoader.on_iteration`), before the first batch, so
    schedules, durations and callbacks read it from then on; it then ends the loop itself, on every rank at the
    same step. Nothing is lifted where no rank's dataloader may yield more than its ``len()`` (Composer's cap then
    holds, as without UnevenJoin), or where ``dataloader_len`` is not the longest ``len()`` (a subset was asked for).
    """
    cap = state.dataloader_len
    if not loader.rules.lifts(cap):
        return
    loader.uncapped = True
    compat.dataloader_cap_off(state)  # Composer's setter would read len(loader) back: no public way to say "no cap"

    def back() -> None:
        if state.dataloader is loader and state.dataloader_len is None:
            state.dataloader_len = cap

    loader.on_iteration = back


def may_overcount(dataloader: Any) -> bool:
    """Whether ``dataloader`` may yield more batches than its ``len()``: a ``DataLoader`` over an ``IterableDataset``
    read by more than one worker process (each worker ends with its own partial batch; torch warns). Any other
    dataloader's ``len()`` is taken as exact: one that yields more stops every rank with an error."""
    return (
        isinstance(dataloader, DataLoader)
        and isinstance(dataloader.dataset, IterableDataset)
        and dataloader.num_workers > 1
        and not dataloader.drop_last
    )


def _describe(spec: DataSpec, batch: Any, microbatch_size: Any) -> tuple[int, int]:
    """(samples, microbatches) as Composer will count and split ``batch`` with ``spec`` (its own ``DataSpec``)."""
    samples = count_samples(spec, batch)
    if samples < 0:
        return -1, 0
    return samples, count_microbatches(spec, batch, microbatch_size, samples)


def _reshuffle(dataloader: Any, epoch: int) -> None:
    """At an epoch's start: ``set_epoch`` on the ``DistributedSampler`` Composer would reshuffle, if any."""
    sampler = _distributed_sampler(dataloader)
    if sampler is not None:
        sampler.set_epoch(epoch)


def _distributed_sampler(dataloader: Any) -> Optional[DistributedSampler]:
    """The ``DistributedSampler`` Composer itself would find in ``dataloader`` (the user's), else None.

    Composer's own look-up (``_get_distributed_sampler``: ``batch_sampler`` first, then ``sampler``), so that
    UnevenJoin reshuffles exactly the samplers Composer reshuffles, and leaves evaluation padding to Composer
    exactly where Composer removes it.
    """
    return compat.distributed_sampler(dataloader) if isinstance(dataloader, DataLoader) else None


def pads_by_repeating(dataloader: Any) -> bool:
    """True if ``dataloader`` shards with a ``DistributedSampler`` that repeats samples to even out the shards."""
    sampler = _distributed_sampler(dataloader)
    try:
        return sampler is not None and sampler.total_size > len(sampler.dataset)  # type: ignore[arg-type]
    except TypeError:  # a dataset without len()
        return False
