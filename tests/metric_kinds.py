"""One torchmetrics metric per kind of metric state, and how the toy classifier updates each.

Shared by the ranks (``scenarios_metrics.py``) and the single-process reference (``test_metrics.py``),
like ``toy.py``. The kinds, by how ``Metric._sync_dist`` syncs their states:

========================  ===================================================================
name                      state kind
========================  ===================================================================
``Accuracy``              tensor sums (``MulticlassAccuracy``, micro)
``MeanLoss``              tensor sums that make a mean (``MeanMetric``, per-sample loss)
``MaxLoss``               tensor max (``MaxMetric``)
``AUROC``                 lists concatenated (``'cat'``): ``N x C`` float scores, ``N`` int64 targets
``AP``                    the same (``MulticlassAveragePrecision``, ``thresholds=None``)
``AUROCplusAP``           a ``CompositionalMetric`` of the two (torchmetrics' ``test_ddp`` composition)
``CatLoss``               a list concatenated, 1-D (``CatMetric``)
``MRR``                   lists with no reduction (``RetrievalMRR``): one gather per element
``ListSum``               a list with no reduction of non-contiguous tensors (torchmetrics' #3336
                          regression test and its non-contiguous test)
========================  ===================================================================

Lists of dicts are not a state torchmetrics 1.7.4 supports: ``Metric._apply`` (``.to(device)``,
which Composer calls on every metric before each use) calls ``.to`` on each list element, and
``Metric.__hash__`` hashes the elements; a list of dicts fails at both, even on one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import CatMetric, MaxMetric, MeanMetric, Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassAveragePrecision
from torchmetrics.retrieval import RetrievalMRR

from toy import CLASSES, FEATURES

EVAL_KINDS = ('Accuracy', 'MeanLoss', 'MaxLoss', 'AUROC', 'AP', 'AUROCplusAP', 'CatLoss', 'MRR', 'ListSum')
TRAIN_KINDS = ('Accuracy', 'AUROC', 'CatLoss', 'MRR', 'ListSum')


class ListSum(Metric):
    """The sum of everything appended to a list state that has no reduction."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state('x', default=[], dist_reduce_fx=None)

    def update(self, x: torch.Tensor) -> None:
        self.x.append(x)

    def compute(self) -> torch.Tensor:
        return torch.cat(self.x).sum() if self.x else torch.tensor(0.0)


class ScalarList(ListSum):
    """A list with no reduction of 0-dim tensors: cannot be evened out across ranks (a scalar has no empty form)."""

    def update(self, x: torch.Tensor) -> None:
        self.x.append(x.sum())

    def compute(self) -> torch.Tensor:
        return torch.stack(self.x).sum() if self.x else torch.tensor(0.0)


def make(name: str) -> Metric:
    if name == 'Accuracy':
        return MulticlassAccuracy(num_classes=CLASSES, average='micro')
    if name == 'MeanLoss':
        return MeanMetric()
    if name == 'MaxLoss':
        return MaxMetric()
    if name == 'AUROC':
        return MulticlassAUROC(num_classes=CLASSES, thresholds=None)
    if name == 'AP':
        return MulticlassAveragePrecision(num_classes=CLASSES, thresholds=None)
    if name == 'AUROCplusAP':
        return make('AUROC') + make('AP')
    if name == 'CatLoss':
        return CatMetric()
    if name == 'MRR':
        return RetrievalMRR()
    if name == 'ListSum':
        return ListSum()
    if name == 'ScalarList':
        return ScalarList()
    raise ValueError(name)


FOUR = 4  # classes of the four-class model; the toy data's labels hold 0-2 only


def four_class_module() -> torch.nn.Module:
    """The toy MLP with four outputs, always from the same weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, FOUR))


def four_class_collection() -> MetricCollection:
    """AUROC and AP over four classes in a ``MetricCollection`` (its default compute groups, as a user writes it)."""
    return MetricCollection(
        {
            'AUROC': MulticlassAUROC(num_classes=FOUR, thresholds=None),
            'AP': MulticlassAveragePrecision(num_classes=FOUR, thresholds=None),
        }
    )


def collection(names) -> MetricCollection:
    return MetricCollection({n: make(n) for n in names}, compute_groups=False)


def query(x: torch.Tensor) -> torch.Tensor:
    """The retrieval query a sample belongs to (four queries, from its features)."""
    return (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def update(metric: Metric, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> None:
    """Update ``metric`` (any of :func:`make`'s) with samples ``x, y`` and the model's ``logits``."""
    probs = logits.softmax(-1)
    if isinstance(metric, MulticlassAccuracy):
        metric.update(logits, y)
    elif isinstance(metric, (MeanMetric, MaxMetric, CatMetric)):
        metric.update(F.cross_entropy(logits, y, reduction='none'))
    elif isinstance(metric, RetrievalMRR):
        metric.update(probs[:, 0], y == 0, indexes=query(x))
    elif isinstance(metric, ListSum):
        metric.update(x[:, 0])  # a non-contiguous column
    else:  # AUROC, AP and their composition
        metric.update(probs, y)
