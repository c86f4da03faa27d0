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
from test_join_core import ok
from toy import CLASSES, make_module, shard

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
}


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


EXACT = [n for n in SCENARIOS if n != 'scalar_list_refused']


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
            if len(set(y.tolist())) == CLASSES:  # an independent implementation too
                auroc = roc_auc_score(y, probs, multi_class='ovr', average='macro')
                ap = sum(average_precision_score(y == c, probs[:, c]) for c in range(CLASSES)) / CLASSES
                assert float(got['AUROC']) == pytest.approx(auroc, abs=1e-6)
                assert float(got['AP']) == pytest.approx(ap, abs=1e-6)


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


def test_a_list_of_scalars_with_no_reduction_is_refused_on_every_rank(runs):
    for rank, res in enumerate(runs['scalar_list_refused']):
        assert isinstance(res, RankError) and res.type == 'ValueError', f'rank {rank}: {res}'
        assert 'ScalarList.x' in res.message and 'cannot even out' in res.message and 'reshape(1)' in res.message
