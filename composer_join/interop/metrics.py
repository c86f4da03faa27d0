"""torchmetrics states that every rank can sync, however much data it evaluated, none included.

What torchmetrics' ``Metric.compute`` asks of every rank (``Metric._sync_dist`` and
``gather_all_tensors`` in ``torchmetrics/metric.py`` and ``torchmetrics/utilities/distributed.py``),
per state:

* a tensor state (``'sum'``, ``'mean'``, ``'max'``, ``'min'``: accuracy, ``MeanMetric``, ...): one
  gather (a barrier, an ``all_gather`` of its shape unless it is 0-dim, an ``all_gather`` of the
  padded tensor). A rank that evaluated nothing holds the default: the same collectives, and the
  default adds nothing to a sum, so these are exact without help.
* a list state reduced by ``'cat'`` (``MulticlassAUROC`` / ``AveragePrecision`` with
  ``thresholds=None``, ``CatMetric``, ...): concatenated locally, then one gather. A rank that never
  updated holds ``[]``, which torchmetrics replaces by a 1-D ``torch.tensor([])`` of the metric's
  dtype. If the other ranks' tensors have two dimensions (AUROC's ``N x C`` scores) or another
  dtype (``int64`` targets), the ranks exchange shapes of different lengths and tensors of
  different sizes: gloo aborts, NCCL hangs or reads garbage (torchmetrics #2170).
* a list state with no reduction (``dist_reduce_fx=None``: the retrieval metrics, ...), or with
  a reduction other than ``'cat'``: one gather per element. Ranks holding different numbers of
  elements issue different numbers of collectives (torchmetrics #3336); with uneven shards this
  happens even when no rank is empty.

:class:`MetricStates` repairs the states right before Composer computes them (at
``EVAL_BATCH_END`` and ``AFTER_TRAIN_BATCH``), on every rank:

* an empty ``'cat'`` list gets one empty tensor shaped like a real update's (zero rows, the same
  trailing dimensions and dtype);
* the other lists (``None``-reduced) are padded with such empty elements to the longest rank's
  count (one ``all_reduce`` of the counts, only for metrics that have such states).

Zero rows add nothing to a concatenation, so the metric equals one process computing it over all
the data. The empty elements' shapes come from the metric itself: when a rank runs a shadow
microbatch (the two-sample template), :meth:`MetricStates.probe` updates a fresh copy of each
list-state metric with it, the way Composer would update the real one (which stays out of shadow
microbatches); the copy's states, cut to zero rows, are the empties. Their shapes are the dataloader's
(a sequence length; a key one dataloader's batches have and another's have not), so one
:class:`MetricStates` is kept per dataloader, with what else the join's loader learns from it
(``composer_join.join.loader.Learned``), never per label: two evaluations labelled ``'eval'`` may read
batches of different shapes. Learning happens once per metric and dataloader, and costs no collective.

Not repairable, and reported on every rank: a ``None``-reduced list whose elements are 0-dim
tensors (a scalar cannot be emptied) when the ranks' counts differ.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from composer.core import State
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from composer_join.core import compat
from composer_join.core.catalogue import METRIC_LISTS
from composer_join.core.exchange import TorchExchange

__all__ = ['MetricStates', 'count_shadow_update', 'has_list_states', 'shadow_update']

log = logging.getLogger(__name__)


def _leaves(metric: Metric) -> Iterator[Metric]:
    """``metric`` and the metrics inside it (a ``CompositionalMetric``'s, a wrapper's), in a fixed order."""
    seen: set[int] = set()  # by id: torchmetrics hashes a metric by its states' values
    todo: list[torch.nn.Module] = [metric]
    while todo:
        module = todo.pop(0)
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, Metric):
            yield module
        todo.extend(module.children())


def _list_states(metric: Metric) -> list[str]:
    return compat.metric_list_states(metric)


def has_list_states(metric: Any) -> bool:
    """Whether ``metric`` (or a metric inside it) has list states, which :meth:`MetricStates.fill` makes syncable."""
    return isinstance(metric, Metric) and any(_list_states(leaf) for leaf in _leaves(metric))


def _empty_like(x: Any) -> Any:
    """``x`` with zero rows (tensors), structure kept (dicts, lists, tuples); None if impossible."""
    if isinstance(x, torch.Tensor):
        return None if x.ndim == 0 else x.detach()[:0].clone()
    if isinstance(x, dict):
        mapped = {k: _empty_like(v) for k, v in x.items()}
        return None if any(v is None for v in mapped.values()) else mapped
    if isinstance(x, (list, tuple)):
        items = [_empty_like(v) for v in x]
        return None if any(v is None for v in items) else type(x)(items)
    return x  # not a tensor: torchmetrics does not sync it


def _cat_empty(elements: list) -> Optional[torch.Tensor]:
    """The empty tensor a ``'cat'`` list holding ``elements`` would concatenate to (0 rows)."""
    if not elements or not all(isinstance(e, torch.Tensor) for e in elements):
        return None
    return dim_zero_cat(list(elements)).detach()[:0].clone()


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device).clone()
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


class MetricStates:
    """One dataloader's list-state metrics: what an empty update of each looks like; every rank's states made syncable.

    Made by the join's loader for its dataloader and handed on with what else is learned from that dataloader
    (``composer_join.join.loader.Learned``); called by :class:`~composer_join.join.microbatches.Microbatches`
    on every rank at the same events. Costs nothing for metrics without list states; for those with lists
    reduced by ``None`` (retrieval metrics), one ``all_reduce`` of a few integers per :meth:`fill`.

    Args:
        to_device: moves the counts tensor to the trainer's device (``state.device.tensor_to_device``),
            so that NCCL gets a CUDA tensor.

    Example (``metrics`` a dict of torchmetrics, ``update`` as :func:`shadow_update` makes it)::

        states = MetricStates(state.device.tensor_to_device)  # one per dataloader
        states.probe(metrics, update)  # a shadow microbatch of this dataloader: learn the empty states
        states.fill(metrics)  # on every rank, right before Composer computes them
    """

    def __init__(self, to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self.to_device = to_device
        # per metric name, per leaf index, per list state: the empty element (None: unknown)
        self._empties: dict[str, list[dict[str, Any]]] = {}

    def probe(self, metrics: dict[str, Metric], update: Callable[[Metric], Any]) -> None:
        """On a shadow microbatch of this dataloader: learn the empty states of ``metrics`` not learned yet.

        ``update(metric)`` updates a metric with the shadow microbatch the way Composer would
        (``model.update_metric(batch, outputs, metric)``); it is applied to a fresh copy of each
        list-state metric, never to ``metrics`` themselves. Once per metric name.
        """
        for name, metric in metrics.items():
            if name in self._empties or not has_list_states(metric):
                continue
            copy_ = _fresh_copy(metric)
            try:
                update(copy_)
            except Exception as e:  # a metric the template does not fit: leave it as torchmetrics has it
                log.warning(
                    'UnevenJoin could not learn the empty states of metric %r (%s: %s); a rank that '
                    'evaluates no data may fail to sync it.',
                    name,
                    type(e).__name__,
                    e,
                )
                self._empties[name] = []
                continue
            self._empties[name] = [{a: _element_empty(leaf, a) for a in _list_states(leaf)} for leaf in _leaves(copy_)]

    def fill(self, metrics: dict[str, Metric]) -> None:
        """Make ``metrics``' list states syncable on this rank; call on every rank right before they are computed."""
        padding: list[tuple[str, Metric, str, Any]] = []  # (metric name, leaf, state, empty element)
        for name, metric in metrics.items():
            if not isinstance(metric, Metric):
                continue
            learned = self._empties.get(name)
            for i, leaf in enumerate(_leaves(metric)):
                for attr in _list_states(leaf):
                    value = getattr(leaf, attr)
                    if not isinstance(value, list):
                        continue  # already synced or reduced
                    known = learned[i].get(attr) if learned is not None and i < len(learned) else None
                    reduction = compat.metric_reduction(leaf, attr)
                    if reduction is dim_zero_cat:
                        if not value and known is not None:
                            value.append(_to(known, leaf.device))
                    else:  # None or another callable: torchmetrics gathers element by element
                        empty = _empty_like(value[-1]) if value else known
                        padding.append((name, leaf, attr, empty))
        if padding:
            self._pad(padding)

    def _pad(self, padding: list[tuple[str, Metric, str, Any]]) -> None:
        """Pad each ``None``-reduced list to the longest rank's count (one all_reduce of the counts).

        Every rank sends, per state, its count, minus its count, and whether it could not make an
        empty element; the MAX gives every rank the same longest and shortest counts and flags, so
        every rank pads, or raises the same error, alike.
        """
        counts = [len(getattr(leaf, attr)) for _, leaf, attr, _ in padding]
        stuck = [int(empty is None) for _, _, _, empty in padding]
        said = METRIC_LISTS.said("the all-reduce of the list-state metrics' counts")
        rows = TorchExchange(self.to_device).reduce(
            torch.tensor(counts + [-c for c in counts] + stuck, dtype=torch.int64), 'max', said
        )
        n = len(padding)
        agreed: list[int] = rows.tolist()
        longest, shortest, stuck = agreed[:n], [-c for c in agreed[n : 2 * n]], agreed[2 * n :]
        uneven = [i for i in range(n) if longest[i] != shortest[i]]
        bad = sorted({f'{padding[i][0]}.{padding[i][2]}' for i in uneven if stuck[i]})
        if bad:
            raise ValueError(
                f'UnevenJoin cannot even out the list states {", ".join(bad)} across ranks, which hold different '
                "numbers of elements (torchmetrics' sync would issue different collectives on different ranks): "
                'some rank has no empty element for them, because their elements are 0-dim tensors (a scalar '
                'cannot be emptied) or because it never saw an update of them. Append tensors of 1 or more '
                "dimensions in the metric's update (e.g. value.reshape(1)), or give the state dist_reduce_fx='cat'.",
            )
        for i in uneven:
            _, leaf, attr, empty = padding[i]
            getattr(leaf, attr).extend(_to(empty, leaf.device) for _ in range(longest[i] - counts[i]))


def count_shadow_update(metrics: dict[str, Metric]) -> None:
    """After a step (or eval batch) this rank shadowed: count it as an update of zero samples of ``metrics``.

    Composer resets the train metrics at every batch and computes them after it. A rank that shadowed
    the whole batch never updated them, and torchmetrics' ``compute`` then warns (on global rank 0 only)
    that it was called before ``update``, a warning no rank with data gives: under ``-W error``
    (Composer's own test configuration) that rank would raise alone while the others wait for it in the
    metric's sync. Every rank's states together did see the batch, so this rank's empty share counts as
    an update: torchmetrics' update counter goes to 1 on every metric (and metric inside it) still at
    0, as an update with no samples would set it; the states keep their defaults, which add nothing.
    Call only where some rank had data (a shadow step): where no rank updated, the warning is Composer's.
    """
    for metric in metrics.values():
        if isinstance(metric, Metric):
            for leaf in _leaves(metric):
                if compat.update_count(leaf) == 0:
                    compat.set_update_count(leaf, 1)


def _element_empty(leaf: Metric, attr: str) -> Any:
    value = getattr(leaf, attr)
    if not value:
        return None
    if compat.metric_reduction(leaf, attr) is dim_zero_cat:
        return _cat_empty(value)
    return _empty_like(value[-1])


def _fresh_copy(metric: Metric) -> Metric:
    """A reset deep copy of ``metric``, made without copying its list states' contents."""
    held = []
    for leaf in _leaves(metric):
        for attr in _list_states(leaf):
            held.append((leaf, attr, getattr(leaf, attr)))
            setattr(leaf, attr, [])
    try:
        probe = copy.deepcopy(metric)
    finally:
        for leaf, attr, value in held:
            setattr(leaf, attr, value)
    probe.reset()
    return probe


def shadow_update(state: State, fresh_batch: Optional[Callable[[], Any]] = None) -> Callable[[Metric], Any]:
    """``update(metric)`` as Composer would run it for the current (shadow) microbatch.

    Evaluation (``fresh_batch`` None): ``model.update_metric(state.batch, state.outputs, metric)``,
    as in Composer's eval loop. Training: Composer first turns the training outputs into eval
    outputs, ``model.eval_forward(batch, state.outputs)`` (returns them unchanged unless the model
    overrides it), on a copy of the microbatch taken before the forward: ``fresh_batch()`` gives one.
    """
    model: Any = state.model.module if isinstance(state.model, DistributedDataParallel) else state.model
    outputs = state.outputs

    def update(metric: Metric) -> Any:
        with torch.no_grad():
            if fresh_batch is None:
                return model.update_metric(state.batch, outputs, metric)
            batch = fresh_batch()
            return model.update_metric(batch, model.eval_forward(batch, outputs), metric)

    return update
