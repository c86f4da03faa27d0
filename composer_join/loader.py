"""The train dataloader Composer iterates while UnevenJoin is active.

:class:`JoinLoader` wraps one rank's own dataloader. Composer's ``_iter_dataloader`` calls ``next``
on it once per step on every rank; inside that call the loader

1. fetches this rank's next batch (or notes that it has run out, or that fetching failed);
2. agrees with all ranks on a :class:`~composer_join.plan.StepPlan` (one small collective, for
   which it fetched the batch and started the collective during the previous ``next``, so that
   it overlaps that step's training);
3. stops the epoch on every rank when no rank has data left, raises :class:`UnevenInputsError`
   on every rank when the plan says so, and otherwise yields the real batch, or, on a rank that
   has run out, a *shadow batch*: the same structure with zero samples. Composer counts a shadow
   batch as zero samples and zero tokens and splits it into one microbatch, so all of Composer's
   per-step collectives still match across ranks.

A rank that has never seen a batch (an empty shard) is sent a one-or-two sample template by the
lowest rank with data, once, to learn the batch structure.

Example (what the algorithm does at ``Event.FIT_START`` and ``Event.EVAL_START``)::

    loader = join_dataloader(state)  # wraps state.dataloader and puts the wrapper in its place
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler

from composer_join.batches import first_samples, sample_lists, to_cpu
from composer_join.errors import UnevenInputsError
from composer_join.plan import Agreement, RankStatus, StepPlan, agree_on_length
from composer_join.report import EpochReport
from composer.core import DataSpec, State
from composer.utils import dist

__all__ = ['JoinLoader', 'TEMPLATE_SAMPLES', 'join_dataloader', 'pads_by_repeating']

log = logging.getLogger(__name__)

TEMPLATE_SAMPLES = 2
"""Samples in a shadow forward: two, so that BatchNorm in training mode accepts it."""

Describe = Callable[[Any], tuple[int, int]]


class JoinLoader:
    """One rank's dataloader, made to end every epoch on all ranks at the same step.

    Args:
        dataloader: this rank's own train dataloader (any iterable of batches).
        describe: ``batch -> (samples, microbatches)`` as Composer will count and split it;
            ``-1`` samples or ``0`` microbatches where that cannot be known.
        length: the shared number of batches per epoch (the longest rank's), or ``None`` if some
            rank's dataloader has no ``len()``.
        check_overflow: peek past ``length`` at the last step, and fail on every rank if some
            dataloader yields more than its ``len()`` promised (its extra batches would be lost).
        throw_on_early_termination: raise :class:`UnevenInputsError` on every rank at the first
            step where some rank has no batch, instead of shadowing.
        to_device: moves the agreement tensor to the trainer's device (``state.device.tensor_to_device``).
    """

    def __init__(
        self,
        dataloader: Iterable,
        describe: Describe,
        length: Optional[int] = None,
        check_overflow: bool = False,
        throw_on_early_termination: bool = False,
        to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ):
        self.dataloader = dataloader
        self.describe = describe
        self.length = length
        self.check_overflow = check_overflow
        self.throw_on_early_termination = throw_on_early_termination
        self.to_device = to_device
        self.template: Optional[Any] = None  # first samples of a real batch, on the CPU
        self.plan: Optional[StepPlan] = None  # the current step's plan, while iterating
        self._exhausted: Optional[Iterator] = None  # the iterator that ran out
        self.report = EpochReport(epoch=0, world_size=dist.get_world_size())
        self.epoch = 0

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError('some rank\'s train dataloader has no len(), so the epoch length is unknown')
        return self.length

    def count(self, batch: Any) -> int:
        """Samples in ``batch`` (a microbatch, say), 0 if they cannot be counted."""
        return max(self.describe(batch)[0], 0)

    def set_epoch(self, epoch: int) -> None:
        """Called at every epoch start: reshuffles a ``DistributedSampler`` as Composer would."""
        self.epoch = epoch
        sampler = _distributed_sampler(self.dataloader)
        if sampler is not None:
            sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.dataloader)
        self.report = EpochReport(epoch=self.epoch, world_size=dist.get_world_size())
        step, pending = 0, self._fetch_and_agree(batches, 0)
        try:
            while True:
                batch, status, error, agreement = pending
                plan = agreement.plan()
                self._raise_if_needed(plan, error)
                if not plan.active_ranks:
                    return
                if plan.template_source is not None:
                    self._share_template(plan.template_source)
                self.plan = plan
                self.report.record(plan)
                # Fetch the next batch and start its agreement now: it completes while this step trains.
                pending = self._fetch_and_agree(batches, step + 1)
                yield batch if status.has_batch else first_samples(self.template, 0)
                step += 1
        finally:
            self.plan = None

    def _fetch_and_agree(self, batches: Iterator[Any], step: int):
        batch, status, error = self._fetch(batches, step)
        return batch, status, error, Agreement(step, status, self.to_device)

    def _fetch(self, batches: Iterator[Any], step: int) -> tuple[Any, RankStatus, Optional[BaseException]]:
        """This rank's next batch (None once exhausted), its status for the agreement, and any error."""
        if batches is not self._exhausted:
            try:
                batch = next(batches)
            except StopIteration:
                self._exhausted = batches
            except Exception as e:  # reported to every rank by the agreement, then re-raised here
                return None, RankStatus(has_batch=False, failed=True), e
            else:
                if self.template is None:
                    self.template = to_cpu(first_samples(batch, TEMPLATE_SAMPLES))
                samples, microbatches = self.describe(batch)
                overflow = False
                if self.check_overflow and self.length is not None and step == self.length - 1:
                    overflow = _has_more(batches)
                return batch, RankStatus(True, samples, microbatches, overflow=overflow), None
        if self.template is not None and sample_lists(self.template):
            return None, RankStatus(has_batch=False, failed=True), UnevenInputsError(
                f'rank {dist.get_global_rank()} ran out of data at step {step} and must shadow the others, but its '
                f'batches hold Python lists of samples (e.g. strings), which Composer\'s default split_batch cannot '
                f'split when empty. Make the dataloader yield tensors only, or use '
                f'UnevenJoin(throw_on_early_termination=True) to stop instead.',
            )
        return None, RankStatus(has_batch=False, samples=0, microbatches=1, needs_template=self.template is None), None

    def _raise_if_needed(self, plan: StepPlan, error: Optional[BaseException]) -> None:
        failed = [r for r, s in enumerate(plan.statuses) if s.failed]
        if failed:
            msg = (
                f'rank(s) {failed} could not form batch {plan.step} of epoch {self.epoch} (their dataloader raised, '
                f'or their data cannot be shadowed); every rank stops here, the failing rank raises the cause'
            )
            if error is not None:
                raise error
            raise UnevenInputsError(msg)
        overflow = [r for r, s in enumerate(plan.statuses) if s.overflow]
        if overflow:
            raise UnevenInputsError(
                f'the dataloader of rank(s) {overflow} yielded more than the {self.length} batches per epoch '
                f'that the longest len() promised; the extra batches would be silently dropped. Make __len__ of '
                f'each rank\'s dataset match what it yields, or remove __len__ so the epoch ends when data does.',
            )
        if self.throw_on_early_termination and plan.active_ranks and plan.joined_ranks:
            counts = ', '.join(f'rank {r}: {n}' for r, n in enumerate(self.report.real_batches))
            raise UnevenInputsError(
                f'rank(s) {plan.joined_ranks} ran out of data at step {plan.step} of epoch {self.epoch} '
                f'while rank(s) {plan.active_ranks} still have batches (batches so far: {counts}). '
                f'UnevenJoin(throw_on_early_termination=True) stops here; set it to False to let exhausted '
                f'ranks join and shadow the others until all are done.',
            )

    def _share_template(self, source: int) -> None:
        box = [self.template if dist.get_global_rank() == source else None]
        dist.broadcast_object_list(box, src=source)
        if self.template is None:
            self.template = box[0]
            log.info('rank %d has no data of its own; shaped its shadow batches after rank %d', dist.get_global_rank(), source)


def join_dataloader(
    state: State, cached: Optional[JoinLoader] = None, throw: bool = False, microbatch_size: Any = None,
) -> JoinLoader:
    """Wrap ``state.dataloader`` in a :class:`JoinLoader` and set it, with the shared length, in its place.

    Called on every rank at the same point (fit or evaluation start): one collective to agree on
    the longest rank's length. ``cached``, a loader made earlier for the same dataloader, is reused
    with the template it holds. ``throw`` is ``throw_on_early_termination``. Microbatch counts are
    predicted with ``microbatch_size`` (an evaluator's), by default the train microbatch size.
    """
    dataloader = state.dataloader
    if isinstance(dataloader, JoinLoader):  # a second fit() on the same trainer
        dataloader = dataloader.dataloader
    shared, check_overflow, own_lens = agree_on_length(
        _len_or_none(dataloader), None if state.dataloader_len is None else int(state.dataloader_len),
        state.device.tensor_to_device,
    )
    if cached is not None and cached.dataloader is dataloader:
        loader = cached
        loader.length, loader.check_overflow = shared, check_overflow
    else:
        spec = DataSpec(dataloader)
        loader = JoinLoader(
            dataloader,
            describe=lambda batch: _describe(
                spec, batch, state.device_train_microbatch_size if microbatch_size is None else microbatch_size),
            length=shared,
            check_overflow=check_overflow,
            throw_on_early_termination=throw,
            to_device=state.device.tensor_to_device,
        )
    label = state.dataloader_label
    state.set_dataloader(loader, label, -1 if shared is None else shared)
    log.info('UnevenJoin: %s batches per rank %s; every rank runs %s steps.', label, own_lens,
             shared if shared is not None else 'until the last rank runs out')
    return loader


def _len_or_none(dataloader: Any) -> Optional[int]:
    try:
        return len(dataloader)
    except (TypeError, NotImplementedError):
        return None


def _describe(spec: DataSpec, batch: Any, microbatch_size: Any) -> tuple[int, int]:
    """(samples, microbatches) as Composer's default ``DataSpec`` counts and splits ``batch``."""
    try:
        samples = int(spec.get_num_samples_in_batch(batch))
    except (ValueError, NotImplementedError, TypeError, AttributeError):
        return -1, 0
    if not isinstance(microbatch_size, int) or microbatch_size <= 0:
        return samples, 0
    return samples, max(1, -(-samples // microbatch_size))


def _has_more(batches: Iterator[Any]) -> bool:
    """Whether ``batches`` yields another batch (fetching it)."""
    try:
        next(batches)
    except StopIteration:
        return False
    return True


def _distributed_sampler(dataloader: Any) -> Optional[DistributedSampler]:
    if not isinstance(dataloader, DataLoader):
        return None
    for sampler in (dataloader.sampler, getattr(dataloader.batch_sampler, 'sampler', None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def pads_by_repeating(dataloader: Any) -> bool:
    """True if ``dataloader`` shards with a ``DistributedSampler`` that repeats samples to even out the shards."""
    sampler = _distributed_sampler(dataloader)
    try:
        return sampler is not None and sampler.total_size > len(sampler.dataset)
    except TypeError:  # a dataset without len()
        return False
