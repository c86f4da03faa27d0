"""What a run learns from a dataloader is that dataloader's, whatever its label (issue 40, second case).

One trainer with UnevenJoin, 2 ranks, runs calls on dataloaders of different shapes (``scenarios_learned.DATA``):
sequences of 8 tokens without a mask, of 12 and of 16 with one. ``trainer.eval(eval_dataloader=...)`` labels every
evaluation ``'eval'``, and every fit trains under ``'train'``; a rank that shadows must still shape its stand-in
batch, and the empty states of its list-state metrics (``CatMetric`` of the per-token outputs), after the
dataloader of the current call, never after an earlier one with the same label. Measured on the code before
(issue 40): the rank whose shard of the second evaluation is empty evaluated the first one's template, and both
ranks raised ``Sizes of tensors must match`` in the metric sync; two fits did the same with their train metrics.

Each call (fit: train metrics at every step and the weights after it; evaluation: the metrics; predict(): each
rank's outputs) must equal the single-process reference (:func:`toy_seq.reference`, which runs the same calls in
order) to 1e-6. Every scenario runs with the short (or empty) rank first and last, in one launch.
"""

from __future__ import annotations

import pytest
import torch

from harness import launch
from scenarios_learned import BATCH, per_rank
from test_join_core import ok
from toy_seq import reference

SEQUENCES = {
    # eval(X), then eval(Y) of another shape on which the short rank has no sample; predict() between them
    'evals': ['fit A', 'eval X', 'predict P', 'eval Y', 'eval X'],
    # two fits on differently shaped train loaders (the short rank with a little data, then none), predict() between
    'fits': ['fit A', 'predict P', 'fit B', 'eval X', 'fit B0'],
}
SCENARIOS = {
    f'{name}@short{short}': dict(calls=calls, short=short) for name, calls in SEQUENCES.items() for short in (0, 1)
}
TOL = 1e-6


@pytest.fixture(scope='module')
def runs() -> dict:
    return launch(
        2, [(name, 'scenarios_learned:sequence', {'cfg': cfg}) for name, cfg in SCENARIOS.items()], timeout=300
    )


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize('name', list(SCENARIOS))
def test_every_call_equals_one_process_whatever_came_before(runs, name):
    cfg = SCENARIOS[name]
    calls = [c.split() for c in cfg['calls']]
    expected = reference([(kind, per_rank(data, cfg['short'])) for kind, data in calls], BATCH)
    for rank, res in enumerate(ok(runs, name)):
        for (kind, data), got, want in zip(calls, res['results'], expected):  # the calls that ran, first
            where = f'{name}: rank {rank}, {kind} {data}'
            if kind == 'fit':
                assert len(got['train_tokens']) == len(want['train_tokens']), where
                for step, (a, b) in enumerate(zip(got['train_tokens'], want['train_tokens'])):
                    assert _diff(a, b) < TOL, f'{where}: train metric at step {step}'
                diff = max(_diff(got['params'][k], want['params'][k]) for k in want['params'])
                assert diff < TOL, f'{where}: weights {diff:.2e} from the reference'
            elif kind == 'eval':
                assert _diff(got['Tokens'], want['Tokens']) < TOL, where
                assert got['MeanLoss'] == pytest.approx(want['MeanLoss'], abs=TOL), where
            else:
                mine = want['predictions'][rank]
                if mine is None:
                    assert got['predictions'] is None or got['predictions'].numel() == 0, where
                else:
                    assert _diff(got['predictions'], mine) < TOL, where
        assert res['error'] is None, f'{name}: rank {rank}, call {cfg["calls"][res["error"][0]]!r}: {res["error"][1]}'
        assert len(res['results']) == len(calls)
