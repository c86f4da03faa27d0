"""Every kind of torchmetrics state gives exact uneven evaluation and train metrics, empty ranks included.

A ``ComposerClassifier`` with one metric per state kind (``metric_kinds.py``: sums, a mean, a max,
concatenated lists of 2-D and 1-D tensors, a composition, lists with no reduction: a retrieval
metric, ``CatMetric``) trains one uneven epoch with train metrics at every step (some rank shadows
at most steps) and evaluates uneven shards, some of them empty. Every value Composer computes, on
every rank, must equal one process computing the same metric over all the data with the same
weights (torchmetrics in this process, and scikit-learn for AUROC and AP).
"""

from __future__ import annotations

import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

import metric_kinds
from harness import RankError, launch
from rank_orders import base, expand, with_rotations
from test_join_core import ok
from toy import make_module, shard

RUN = 'scenarios_metrics:metric_kinds_run'
BASE = dict(batch_size=4, eval_batch_size=4)
SCENARIOS = {
    # the shards of the issue: an empty eval rank (gloo aborted), and an empty first rank (storage overflow)
    'eval_20_7_0': dict(BASE, shards=[12, 5, 0], eval_shards=[20, 7, 0]),
    'eval_0_9': dict(BASE, shards=[4, 13], eval_shards=[0, 9]),
    'eval_20_7': dict(BASE, shards=[9, 4], eval_shards=[20, 7]),
    # eval microbatches of 3: ranks update different numbers of times per batch
    'eval_20_7_3_microbatched': dict(BASE, shards=[8, 3, 8], eval_shards=[20, 7, 3], eval_microbatch=3),
    'four_ranks_two_empty': dict(
        BASE, shards=[9, 0, 4, 12], eval_shards=[0, 11, 0, 6], eval_batch_size=3, eval_again=True
    ),
    # a list of scalars with no reduction cannot be evened out: a clear error on every rank, no hang
    'scalar_list_refused': dict(BASE, shards=[4, 4], eval_shards=[0, 9], train_kinds=(), eval_kinds=('ScalarList',)),
    # issue 28's user: ComposerClassifier over 4 classes (class 3 absent from every rank), AUROC and AP in a
    # MetricCollection, an empty eval rank; updated with probabilities, and with logits (ComposerClassifier's way)
    'four_classes_probs_0_9': dict(BASE, shards=[40, 21], eval_shards=[0, 9], eval_seed=80, four_classes=True),
    'four_classes_logits_0_9': dict(BASE, shards=[4, 13], eval_shards=[0, 9], eval_seed=80, four_classes=False),
}
# which rank is short or empty must not matter: every scenario also with its ranks rotated (one launch per world size)
SCENARIOS = with_rotations(SCENARIOS)


@pytest.fixture(scope='module')
def runs() -> dict:
    results = {}
    for world in (2, 3, 4):
        calls = [(n, RUN, {'cfg': c}) for n, c in SCENARIOS.items() if len(c['shards']) == world]
        results.update(launch(world, calls, timeout=300))
    return results


_computed: dict = {}


def reference(flat_params: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], kinds) -> dict:
    """Each metric computed in this one process over ``parts`` (every rank's samples, in rank order)."""
    key = (flat_params.numpy().tobytes(), tuple(len(p[1]) for p in parts), tuple(kinds))
    if key not in _computed:  # the ranks' parameters are identical: compute once for all of them
        _computed[key] = _reference(flat_params, parts, kinds)
    return _computed[key]


def _reference(flat_params, parts, kinds):
    module = make_module('mlp')
    torch.nn.utils.vector_to_parameters(flat_params, module.parameters())
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    with torch.no_grad():
        logits = module(x)
    out = {}
    for name in kinds:
        metric = metric_kinds.make(name)
        metric_kinds.update(metric, x, y, logits)
        out[name] = metric.compute()
    return out, y, logits.softmax(-1)


def assert_equal_values(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), where
    for name, value in want.items():
        assert got[name].shape == value.shape, (
            f'{where}: {name} has shape {tuple(got[name].shape)}, want {tuple(value.shape)}'
        )
        assert torch.allclose(got[name].float(), value.float(), atol=1e-6, rtol=0), (
            f'{where}: {name} = {got[name]}, one process over all the data: {value}'
        )


def sklearn_auroc_ap(y: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Macro AUROC and AP by scikit-learn, with torchmetrics' conventions for a class absent from ``y``.

    torchmetrics scores an absent class's AUROC 0 and keeps it in the mean over all classes; its AP
    is undefined (nan) and left out of the mean.
    """
    classes = probs.shape[1]
    present = [c for c in range(classes) if bool((y == c).any())]
    auroc = sum(roc_auc_score(y == c, probs[:, c]) for c in present) / classes
    ap = sum(average_precision_score(y == c, probs[:, c]) for c in present) / len(present)
    return auroc, ap


EXACT = [n for n, c in SCENARIOS.items() if base(n) != 'scalar_list_refused' and 'four_classes' not in c]
FOUR_CLASSES = [n for n, c in SCENARIOS.items() if 'four_classes' in c]


@pytest.mark.parametrize('name', EXACT)
def test_eval_metrics_equal_one_process_over_all_eval_data(runs, name):
    cfg = SCENARIOS[name]
    kinds = cfg.get('eval_kinds', metric_kinds.EVAL_KINDS)
    parts = [shard(50 + r, n) for r, n in enumerate(cfg['eval_shards'])]
    for rank, res in enumerate(ok(runs, name)):
        assert len(res['eval']) == (2 if cfg.get('eval_again') else 1)
        for i, got in enumerate(res['eval']):
            want, y, probs = reference(res['eval_params'][i], parts, kinds)
            assert_equal_values(got, want, f'{name}, rank {rank}, evaluation {i}')
            assert len(got['CatLoss']) == sum(cfg['eval_shards'])
            auroc, ap = sklearn_auroc_ap(y, probs)  # an independent implementation too
            assert float(got['AUROC']) == pytest.approx(auroc, abs=1e-6)
            assert float(got['AP']) == pytest.approx(ap, abs=1e-6)


def _four_class_logits(flat_params: torch.Tensor, cfg: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank: the four-class model's logits on its eval shard, and the labels."""
    module = metric_kinds.four_class_module()
    torch.nn.utils.vector_to_parameters(flat_params, module.parameters())
    parts = [shard(cfg['eval_seed'] + r, n) for r, n in enumerate(cfg['eval_shards'])]
    with torch.no_grad():
        return [(module(x), y) for x, y in parts]


@pytest.mark.parametrize('name', FOUR_CLASSES)
def test_four_class_auroc_and_ap_equal_one_process(runs, name):
    """With probabilities: scikit-learn over all the samples. With logits: torchmetrics in one process, per batch.

    torchmetrics takes an update's scores for logits (and softmaxes them) only if one of them lies outside
    [0, 1], update by update (``normalize_logits_if_needed``): fed logits, the metric depends on how the
    samples were batched, in one process as on many (docs/metrics.md). Its reference is then one process
    updating with the same batches as the ranks; the value over all samples at once may differ.
    """
    cfg = SCENARIOS[name]
    b = cfg['eval_batch_size']
    for rank, res in enumerate(ok(runs, name)):
        assert len(res['eval']) == 1
        per_rank = _four_class_logits(res['eval_params'][0], cfg)
        logits, y = torch.cat([lg for lg, _ in per_rank]), torch.cat([t for _, t in per_rank])
        assert not bool((y == 3).any())  # the premise: a class absent from every rank
        if cfg['four_classes']:
            auroc, ap = sklearn_auroc_ap(y, logits.softmax(-1))
            want = {'AUROC': torch.tensor(auroc), 'AP': torch.tensor(ap)}
        else:
            metrics = metric_kinds.four_class_collection()
            for lg, t in per_rank:
                for i in range(0, len(t), b):
                    metrics.update(lg[i : i + b], t[i : i + b])
            want = metrics.compute()
        assert_equal_values(
            {k: v.double() for k, v in res['eval'][0].items()},
            {k: v.double() for k, v in want.items()},
            f'{name}, rank {rank}',
        )


def test_logits_fed_to_auroc_depend_on_batching_in_one_process_too(runs):
    """The trigger of issue 28's report, in one process: a last batch of one sample whose logits all lie in [0, 1]."""
    cfg = SCENARIOS['four_classes_logits_0_9']
    logits, y = _four_class_logits(ok(runs, 'four_classes_logits_0_9')[0]['eval_params'][0], cfg)[1]
    assert len(y) == 9 and bool(((logits[8] >= 0) & (logits[8] <= 1)).all())  # taken for probabilities
    whole, batched = metric_kinds.four_class_collection(), metric_kinds.four_class_collection()
    whole.update(logits, y)
    for i in range(0, 9, 4):
        batched.update(logits[i : i + 4], y[i : i + 4])
    assert float(whole.compute()['AUROC']) != pytest.approx(float(batched.compute()['AUROC']), abs=1e-4)


@pytest.mark.parametrize('name', EXACT)
def test_train_metrics_equal_one_process_at_every_step(runs, name):
    """Train metrics are reset and computed at every step: each equals one process over that step's real samples."""
    cfg = SCENARIOS[name]
    kinds = cfg.get('train_kinds', metric_kinds.TRAIN_KINDS)
    b = cfg['batch_size']
    steps = max(-(-n // b) for n in cfg['shards'])
    shards = [shard(r, n) for r, n in enumerate(cfg['shards'])]
    per_rank = ok(runs, name)
    shadowed = 0
    for t in range(steps):
        parts = [(x[t * b : (t + 1) * b], y[t * b : (t + 1) * b]) for x, y in shards]
        shadowed += any(len(p[1]) == 0 for p in parts)
        for rank, res in enumerate(per_rank):
            assert len(res['train']) == steps
            want, _, _ = reference(res['step_params'][t], parts, kinds)
            assert_equal_values(res['train'][t], want, f'{name}, step {t}, rank {rank}')
    assert shadowed > 0  # some rank shadowed some step (with no train data of its own at that step)


@pytest.mark.parametrize('name', expand(['scalar_list_refused'], SCENARIOS))
def test_a_list_of_scalars_with_no_reduction_is_refused_on_every_rank(runs, name):
    for rank, res in enumerate(runs[name]):
        assert isinstance(res, RankError) and res.type == 'ValueError', f'rank {rank}: {res}'
        assert 'ScalarList.x' in res.message and 'cannot even out' in res.message and 'reshape(1)' in res.message
