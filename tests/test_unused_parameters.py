"""One semantics for unused parameters, whatever DDP's settings (issue 34): as in one process.

On a step where some rank shadows, a parameter that no real sample of the step used gets no gradient, so an
optimizer with momentum leaves it alone, as one process training the same samples would. The scenario is torch's
``UnusedParamModule`` case: a layer (``extra``) only the short rank's data uses, ``find_unused_parameters``, SGD with
momentum, 2 ranks (the short rank first and last). Under DDP's default the shadowing rank runs no model code; under
``static_graph`` it runs the model on the template (a zero-weighted loss that reaches ``extra``), where DDP, like
torch's own join, would give ``extra`` a zero gradient and momentum would move it. torch's ``DDP.join`` on the same
data and model is measured too, and differs (docs/shadow-steps.md gives the figure).
"""

from __future__ import annotations

import pytest
import torch

from harness import launch
from reference import max_abs_diff
from scenarios_unused import labelled
from test_join_core import ok
from toy import make_module, per_sample_loss

SCENARIOS = {
    f'{graph}{suffix}': dict(shards=shards, short=short, static_graph=graph == 'static_graph')
    for graph in ('default', 'static_graph')
    for suffix, shards, short in (('', [16, 6], 1), ('@1', [6, 16], 0))
}


@pytest.fixture(scope='module')
def runs() -> dict:
    calls = [(name, 'scenarios_unused:fit', {'cfg': cfg}) for name, cfg in SCENARIOS.items()]
    calls += [('torch_join', 'scenarios_unused:torch_join', {'cfg': SCENARIOS['default']})]
    return launch(2, calls, timeout=300)


def replay(cfg: dict, steps: list[dict[int, list[int]]]) -> dict[str, torch.Tensor]:
    """One process trains every recorded step: the mean loss over the step's real samples, times A_t / W."""
    data = [labelled(r, n, uses_extra=r == cfg['short']) for r, n in enumerate(cfg['shards'])]
    module = make_module('branch')
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for step in sorted(steps[0]):
        per_rank = [s[step] for s in steps]
        ids = [i for part in per_rank for i in part]
        x = torch.stack([data[i // 1000][0][i % 1000] for i in ids])
        y = torch.stack([data[i // 1000][1][i % 1000] for i in ids])
        active = sum(1 for part in per_rank if part)
        loss = per_sample_loss(module, x, y).sum() / len(ids) * active / len(per_rank)
        optimizer.zero_grad()  # set_to_none: a parameter no sample uses keeps no gradient
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.named_parameters()}


@pytest.mark.parametrize('name', list(SCENARIOS))
def test_a_parameter_no_real_sample_used_gets_no_gradient(runs, name):
    cfg = SCENARIOS[name]
    per_rank = ok(runs, name)
    expected = replay(cfg, [res['steps'] for res in per_rank])
    # the tail steps train the long rank's data only: extra unused there, left alone by momentum
    assert any(not res['steps'][s] for res in per_rank for s in res['steps']), 'no step with a shadowing rank'
    for rank, res in enumerate(per_rank):
        diff = max_abs_diff(res['params'], expected)
        assert diff < 1e-5, f'{name}: rank {rank} is {diff:.2e} from one process'


def test_torch_join_gives_such_a_parameter_a_zero_gradient_instead(runs):
    # what docs/shadow-steps.md says torch does: its joined rank re-sends its last used-parameter map, so extra
    # gets a zero gradient on the tail steps and momentum moves it on
    ours = ok(runs, 'default')[0]
    theirs = ok(runs, 'torch_join')[0]
    extra = [k for k in theirs['params'] if k.startswith('extra')]
    gap = max_abs_diff({k: ours['params'][k] for k in extra}, {k: theirs['params'][k] for k in extra})
    body = [k for k in theirs['params'] if k.startswith('body')]
    assert gap > 1e-3, f'torch join and one process agree on extra ({gap:.2e})'
    print(
        f'torch DDP.join vs one process, extra: {gap:.3f}; body: {max_abs_diff({k: ours["params"][k] for k in body}, {k: theirs["params"][k] for k in body}):.3f}'
    )
