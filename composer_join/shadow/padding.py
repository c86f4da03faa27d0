"""Padding every rank's microbatches to the step's largest count, so that every rank runs as many.

Where every microbatch issues collectives, every rank must run the same number of microbatches
in a step, even when their batches split into different counts (stock Composer hangs there).
:class:`MicrobatchPadding` wraps a ``DataSpec``'s ``split_batch``: a rank with fewer microbatches
than the step's largest (each rank's count travels in the step's agreement,
:attr:`~composer_join.core.plan.RankStatus.microbatches`) appends empty ones, which UnevenJoin runs as
shadow microbatches (gradient weight zero, counted as zero samples). On steps planned from the
lengths alone the other ranks' counts are unknown, so the ranks agree on them there (one
all-reduce of one integer). Used by:

* :class:`~composer_join.wrappers.fsdp.FSDPWrapper`: FSDP all-gathers and reduce-scatters on every
  microbatch, so it pads every training and evaluation step;
* :class:`~composer_join.wrappers.ddp.DDPWrapper`: where the forward itself communicates
  (``SyncBatchNorm``), it pads; otherwise it only counts each rank's microbatches and the step's
  largest, for automatic microbatching's OOM checks (:mod:`composer_join.interop.oom`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from composer.core import DataSpec
from composer.utils import dist

from composer_join.core import compat
from composer_join.core.batches import first_samples
from composer_join.core.catalogue import MICROBATCH_COUNTS
from composer_join.core.changes import Changes
from composer_join.core.errors import UnevenInputsError
from composer_join.core.exchange import TorchExchange
from composer_join.core.plan import StepPlan
from composer_join.interop.oom import OOMChecks

__all__ = ['MicrobatchPadding']


class MicrobatchPadding:
    """Pads the microbatch list of one ``DataSpec`` to the step's largest count across ranks.

    Put on a ``DataSpec`` with :meth:`install`, for as long as a register of changes holds it; every call
    of its ``split_batch`` then splits as before and appends ``max - own`` empty microbatches (the first
    microbatch cut to zero samples). ``plan()`` is the current step's :class:`~composer_join.core.plan.StepPlan`;
    without one (no UnevenJoin step running) nothing is padded. Cost: nothing beyond the padding itself.
    Counts are the ``DataSpec``'s own (its ``split_batch``, :mod:`composer_join.shadow.dataspec`; ``count``, its
    ``get_num_samples_in_batch``, tells an empty microbatch). A batch that splits into more microbatches than
    counted when it was fetched (a ``batch_transforms`` that adds samples), or whose padding the ``DataSpec``
    cannot count as empty, cannot be padded: with ``failures`` (a list, :class:`~composer_join.wrappers.fsdp.FSDPWrapper`'s)
    the error is kept, the first microbatch runs on every rank, and every rank raises at its loss
    (:meth:`~composer_join.wrappers.fsdp.GradientUnits.check`); without, it is raised at once.

    Example::

        with Changes() as changes:
            MicrobatchPadding.install(data_spec, changes, lambda: algorithm.plan)
            data_spec.split_batch(batch_of_2, 3)  # [2 samples]; [2 samples, 0 samples] if a rank has 2 microbatches
    """

    uneven_join_wrapper = True  # composer_join.shadow.dataspec.unwrapped_split sees through it

    def __init__(
        self,
        split: Callable[[Any, Any], Any],
        plan: Callable[[], Optional[StepPlan]],
        to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        pad: bool = True,
        checks: Optional[OOMChecks] = None,
        needed: Callable[[], bool] = lambda: True,
        count: Optional[Callable[[Any], float]] = None,
        failures: Optional[list] = None,
    ):
        self.split = split
        self.plan = plan
        self.to_device = to_device
        self.pad = pad  # False (DDP under automatic microbatching): only count, for ``checks``
        self.checks = checks  # told this rank's count and the step's largest (automatic microbatching)
        self.needed = needed  # whether to count at all (pad=False)
        self.count = count  # the DataSpec's get_num_samples_in_batch (None: Composer's default)
        self.failures = failures  # if a list, errors go there, to be raised on every rank at once
        self.last_count = 0  # microbatches of the last split, padding included
        self.uneven = False  # ranks split the last step into different counts (the same on every rank once padded)

    @classmethod
    def install(cls, spec: DataSpec, changes: Changes, *args: Any, **kwargs: Any) -> MicrobatchPadding:
        """Pad ``spec``'s microbatches until ``changes`` is undone (replacing padding already on it meanwhile).

        The arguments after ``changes`` are the constructor's, after ``split``. Returns the padding.
        """
        split = spec.split_batch
        padding = cls(split.split if isinstance(split, cls) else split, *args, **kwargs)
        changes.set(spec, 'split_batch', padding)
        return padding

    def __call__(self, batch: Any, microbatch_size: Any) -> list:
        microbatches = list(self.split(batch, microbatch_size))
        self.last_count = len(microbatches)
        self.uneven = False
        plan = self.plan()
        if plan is None or not plan.num_active or not (self.pad or self.needed()):
            return microbatches
        counts = plan.rows.column('microbatches').tolist()  # for the microbatch size in force (StepPlan.recounted)
        if 0 in counts:
            # Not all counts are known (a step planned from the lengths alone, or batches Composer's
            # default DataSpec cannot count): every rank is here, so every rank's count now (one exchange of rows).
            said = MICROBATCH_COUNTS.said(f'the microbatch counts of step {plan.step} at its split')
            counts = [row[0] for row in TorchExchange(self.to_device).rows([len(microbatches)], said).wait()]
        target = max(counts)
        self.uneven = min(counts) != target
        if self.checks is not None:
            self.checks.own, self.checks.target = target if self.pad else len(microbatches), target
        if len(microbatches) > target:
            return self._fail(
                microbatches,
                UnevenInputsError(
                    f'split_batch gave {len(microbatches)} microbatches on rank {dist.get_global_rank()} at step '
                    f"{plan.step}, more than the {target} counted when the batch was fetched (with the DataSpec's "
                    f"split_batch, before its batch_transforms); under FSDP every rank runs the step's largest count, "
                    f'so a batch must split the same way when fetched and when trained (a batch_transforms that adds '
                    f'samples, e.g., does not).',
                ),
            )
        if not self.pad:
            return microbatches
        padding = [first_samples(microbatches[0], 0) for _ in range(target - len(microbatches))]
        if padding and not _counts_as_empty(padding[0], self.count):
            return self._fail(
                microbatches,
                UnevenInputsError(
                    f'rank {dist.get_global_rank()} must pad step {plan.step} with {len(padding)} empty microbatches, but '
                    f"its microbatches are not made of tensors that Composer's default DataSpec can count; under FSDP "
                    f'with microbatching, batches must be tensors (or tuples, lists, dicts of them).',
                ),
            )
        self.last_count = len(microbatches) + len(padding)
        return microbatches + padding

    def _fail(self, microbatches: list, error: UnevenInputsError) -> list:
        """Raise ``error`` here, or (``failures`` set) keep it for the first microbatch's check, which every rank runs."""
        if self.failures is None:
            raise error
        self.failures.append(error)
        return microbatches


def _counts_as_empty(batch: Any, count: Optional[Callable[[Any], float]] = None) -> bool:
    """Whether the ``DataSpec`` (``count``; Composer's default if None) counts ``batch`` as zero samples, as UnevenJoin's shadow test does."""
    try:
        return (count(batch) if count is not None else compat.default_count(batch)) == 0
    except (ValueError, NotImplementedError, TypeError, AttributeError):
        return False
