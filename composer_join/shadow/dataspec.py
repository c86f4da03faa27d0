"""The ``DataSpec`` Composer counts and splits batches with, as UnevenJoin must count and split them too.

Composer counts a batch's samples with its ``DataSpec``'s ``get_num_samples_in_batch`` and splits
it into microbatches with its ``split_batch``; either may be the user's own (``DataSpec(loader,
get_num_samples_in_batch=..., split_batch=...)``). UnevenJoin's per-step agreement, its per-rank
report and its microbatch bookkeeping (DDP's last-microbatch sync under ``multi_auto_sync``,
FSDP's padding) use the same functions:

* :func:`spec_for`: the ``DataSpec`` of an evaluation's or ``predict()``'s dataloader, found from inside one of
  Composer's events; an evaluator is the one whose ``DataSpec`` holds the dataloader itself (:func:`evaluator_for`:
  by identity, never by label, which two evaluators may share). A fit's is the trainer's train ``DataSpec``, found
  once by the fit's session on the call stack (:func:`composer_join.core.compat.train_view`);
* :func:`made_as_composer_makes_it`: a batch as the dataloader yields it, made into the first microbatch Composer
  would make of it (the ``DataSpec``'s ``batch_transforms``, the device, its split, ``microbatch_transforms``): a
  stand-in from a template a rank has not trained on (:class:`~composer_join.join.microbatches.Microbatches`);
* :func:`count_microbatches`: Composer's default split makes ``ceil(samples / microbatch size)``
  microbatches (computed, nothing split); a custom ``split_batch`` is called on the batch and its
  microbatches counted;
* :class:`ShadowSplit`: a shadow batch (zero samples) must be exactly one microbatch on every rank,
  whatever the ``split_batch``: Composer's default cannot split an empty list (``range()`` with a
  step of 0), and a custom one may return no microbatch at all. Put on the ``DataSpec`` for as long
  as a register of changes holds it (:mod:`composer_join.core.changes`: the join's loader holds one per
  iteration over a dataloader), it hands a batch the ``DataSpec`` counts as zero samples back whole, and
  splits every other batch as before. The ``DataSpec`` may be the user's own
  (``Trainer(train_dataloader=DataSpec(...))``, ``Evaluator(dataloader=DataSpec(...))``): once the iteration
  ends, normally or because the run raised, its ``split_batch`` is the one it had, and a later ``Trainer``
  without UnevenJoin splits as stock Composer does.

Example::

    with Changes() as changes:
        spec = ShadowSplit.install(spec_for(state, dataloader), changes)
        count_microbatches(spec, batch, 4, samples=10)  # 3 with Composer's default split
    # spec.split_batch is the one it had before
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from composer.core import DataSpec, Evaluator, State

from composer_join.core import compat
from composer_join.core.changes import Changes

__all__ = [
    'ShadowSplit',
    'count_microbatches',
    'count_samples',
    'evaluator_for',
    'made_as_composer_makes_it',
    'spec_for',
    'split_gave_empty',
    'unwrapped_split',
]

_COUNT_ERRORS = (ValueError, NotImplementedError, TypeError, AttributeError, IndexError, KeyError)


def evaluator_for(state: State, dataloader: Any) -> Optional[Evaluator]:
    """The evaluator whose ``DataSpec`` holds ``dataloader`` itself (by identity), None if none does.

    By identity, never by label: ``trainer.eval(eval_dataloader=Y)`` on a Trainer built with its own
    ``eval_dataloader`` gives two evaluators labelled ``'eval'``. Composer appends Y's after the Trainer's and runs only
    those it appended, so of several evaluators holding the same dataloader object the last is the one it runs.
    Cost: a look at each of ``state.evaluators``.
    """
    found = None
    for evaluator in state.evaluators:
        if isinstance(evaluator.dataloader, DataSpec) and evaluator.dataloader.dataloader is dataloader:
            found = evaluator
    return found


def spec_for(state: State, dataloader: Any) -> DataSpec:
    """The ``DataSpec`` Composer counts and splits an evaluation's or ``predict()``'s ``dataloader``'s batches with,
    from inside one of its events: the ``DataSpec`` of the evaluator that holds ``dataloader`` (:func:`evaluator_for`),
    or the one ``predict()`` was given, if it holds ``dataloader`` (:func:`composer_join.core.compat.predict_data_spec`);
    ``DataSpec(dataloader)`` (Composer's defaults) where there is none. (A fit's is the Trainer's train ``DataSpec``,
    found once by its session: :func:`composer_join.core.compat.train_view`.)
    """
    evaluator = evaluator_for(state, dataloader)
    spec = evaluator.dataloader if evaluator is not None else None
    if spec is None:
        predicting = compat.predict_data_spec(state)
        spec = predicting if predicting is not None and predicting.dataloader is dataloader else None
    return spec if spec is not None else DataSpec(dataloader)


def made_as_composer_makes_it(spec: DataSpec, batch: Any, to_device: Callable[[Any], Any], microbatch_size: Any) -> Any:
    """``batch``, as the dataloader yields it, made into the first microbatch Composer makes of it.

    Composer's loops, in order: ``spec.batch_transforms`` (right after the dataloader yields), ``to_device`` (the
    trainer's ``batch_to_device``), ``split_batch`` with ``microbatch_size`` (the user's or Composer's, without
    UnevenJoin's wrappers; none where the size is not a positive number, as in ``predict()``, which does not
    split), ``spec.microbatch_transforms``. Cost: the user's transforms, once, on ``batch``.
    """
    batch = to_device(spec.batch_transforms(batch))
    if isinstance(microbatch_size, (int, float)) and microbatch_size > 0:
        try:
            batch = next(iter(unwrapped_split(spec)(batch, microbatch_size)), batch)
        except Exception:  # a split of the user's that refuses this small batch: the batch whole
            pass
    return spec.microbatch_transforms(batch)


def unwrapped_split(spec: DataSpec) -> Callable[[Any, Any], Any]:
    """``spec.split_batch`` without UnevenJoin's wrappers.

    They are :class:`ShadowSplit` and :class:`~composer_join.shadow.padding.MicrobatchPadding`.
    """
    return _unwrapped(spec.split_batch)


def _wrappers(split: Any) -> list:
    found = []
    while getattr(split, 'uneven_join_wrapper', False):
        found.append(split)
        split = split.split
    return found


def count_samples(spec: DataSpec, batch: Any) -> int:
    """``spec.get_num_samples_in_batch(batch)``, or -1 if it cannot count it."""
    try:
        return int(spec.get_num_samples_in_batch(batch))
    except _COUNT_ERRORS:
        return -1


def count_microbatches(spec: DataSpec, batch: Any, microbatch_size: Any, samples: int) -> int:
    """Microbatches Composer will split ``batch`` into (``samples`` of them counted by ``spec``); 0 if unknown."""
    if not isinstance(microbatch_size, int) or microbatch_size <= 0:
        return 0
    split = unwrapped_split(spec)
    if split is compat.default_split_batch():
        return max(1, -(-samples // microbatch_size)) if samples >= 0 else 0
    try:
        return max(1, len(list(split(batch, microbatch_size))))
    except Exception:  # the user's split_batch refuses this batch here; Composer will say so when it splits
        return 0


class ShadowSplit:
    """``split_batch`` for a ``DataSpec`` that returns a zero-sample (shadow) batch whole: one microbatch.

    It also notes whether its last split gave a microbatch the ``DataSpec`` counts as zero samples out of a batch
    that has some (:attr:`gave_empty`: a ``split_batch`` of the user's may; Composer's default never does, and is
    not counted): UnevenJoin runs such a microbatch as a stand-in (:func:`split_gave_empty`).
    """

    uneven_join_wrapper = True

    def __init__(self, spec: DataSpec, split: Callable[[Any, Any], Any]):
        self.spec, self.split = spec, split
        self._own = _unwrapped(split) is not compat.default_split_batch()  # a split of the user's: counted
        self.gave_empty = False

    @classmethod
    def install(cls, spec: DataSpec, changes: Changes) -> DataSpec:
        """Wrap ``spec.split_batch`` until ``changes`` is undone (once: inside any padding, which then pads one
        shadow microbatch; a ``DataSpec`` already wrapped, one shared by training and evaluation, is left as it is)."""
        if not any(isinstance(s, cls) for s in _wrappers(spec.split_batch)):
            changes.set(spec, 'split_batch', cls(spec, spec.split_batch))
        return spec

    def __call__(self, batch: Any, microbatch_size: Any) -> Any:
        self.gave_empty = False
        if count_samples(self.spec, batch) == 0:
            return [batch]
        microbatches = self.split(batch, microbatch_size)
        if self._own:
            microbatches = list(microbatches)
            self.gave_empty = any(count_samples(self.spec, m) == 0 for m in microbatches)
        return microbatches


def split_gave_empty(spec: Optional[DataSpec]) -> bool:
    """Whether the last split of ``spec`` (through its :class:`ShadowSplit`) gave a microbatch of no samples out of a
    batch that has some. Cost: a look at ``spec.split_batch`` and the wrappers around it."""
    wrappers = _wrappers(spec.split_batch) if spec is not None else []
    return any(s.gave_empty for s in wrappers if isinstance(s, ShadowSplit))


def _unwrapped(split: Any) -> Any:
    """The user's (or Composer's) ``split_batch`` inside UnevenJoin's wrappers."""
    wrappers = _wrappers(split)
    return wrappers[-1].split if wrappers else split
