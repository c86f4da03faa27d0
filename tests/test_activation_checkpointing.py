"""Activation checkpointing, reentrant or not, beside shadow steps (issue 40): exact, or every rank stops.

Inside a reentrant segment (``torch.utils.checkpoint(..., use_reentrant=True)``; Hugging Face's
``gradient_checkpointing_enable()``; Composer's FSDP ``activation_checkpointing_reentrant``) the parameters are not
in the loss's autograd graph: the backward recomputes the segment and gives them their gradient in a second,
inner backward pass. On a step where a shadowing rank runs the model (DDP's ``static_graph``, a marked
communicating forward, a rank with no data of its own yet), UnevenJoin takes back the zero gradient DDP gives a
parameter no real sample used; it learned the used ones from a walk of the graph, so it took back the
checkpointed block's real gradient too (silently: 1.2e-3 to 4.1e-2 off here). Now autograd's own
per-parameter hooks tell (``shadow/gradients.py``, ``UnusedParameters``).

Every scenario trains through Composer's ``Trainer`` (tests/scenarios_checkpointing.py) and is compared with the
single-process reference over the union of each step's real samples (tests/reference.py for the toy model,
tests/reference_hf.py for GPT-2, LoRA included), within 1e-6 on every rank, every sample trained. Two ranks
(the short rank first and last) for the shadowing ways, three (the empty rank first, in the middle and last) for
a rank with no data; one launch per world size, and one for the scenarios that must stop every rank (where they
do not, gloo aborts the processes). Under FSDP2, a reentrant segment that only some ranks' data
runs must stop every rank with ``UnevenInputsError`` (FSDP2 reduce-scatters only the parameters with a gradient),
as its non-reentrant twin does; before, the check read the segment as unused everywhere and gloo aborted.
No hook of UnevenJoin's stays on the model after a fit, nor after one that raises in the middle of a step
whose hooks are on (``raises_mid_step``). ``find_unused_parameters`` with a reentrant segment is refused by DDP itself ("Expected to mark a variable ready
only once", stock Composer alike), so it runs with ``static_graph`` here, as torch advises.
docs/shadow-steps.md has the matrix, with stock Composer's column (``benchmarks/checkpointing.py``).
"""

from __future__ import annotations

import pytest

import reference
import reference_hf
from harness import launch
from rank_orders import expand, with_rotations
from test_join_core import ok

TOL = 1e-6
TWO = dict(shards=[40, 21], batch_size=8, epochs=2, join={}, wrapper='ddp')
THREE = dict(shards=[24, 0, 13], batch_size=4, epochs=2, join={}, wrapper='ddp')
HF_TWO = dict(shards=[12, 7], batch_size=4, epochs=2, join={}, wrapper='ddp', checkpoint='reentrant')
HF_THREE = dict(shards=[12, 0, 7], batch_size=4, epochs=2, join={}, wrapper='ddp', checkpoint='reentrant')
MODES = ('reentrant', 'non_reentrant')

SCENARIOS: dict[str, dict] = {}
for mode in MODES:
    SCENARIOS.update(
        {
            f'static_graph_{mode}': dict(TWO, checkpoint=mode, static_graph=True),
            f'find_unused_{mode}': dict(TWO, checkpoint=mode, find_unused=True, static_graph=mode == 'reentrant'),
            f'communicating_{mode}': dict(TWO, checkpoint=mode, talk=True),
            f'no_data_{mode}': dict(THREE, checkpoint=mode),
            f'fsdp1_{mode}': dict(THREE, wrapper='fsdp1', checkpoint=mode, composer_checkpointing=True),
        }
    )
HF: dict[str, dict] = {
    'hf_static_graph': dict(HF_TWO, static_graph=True),
    'hf_lora_static_graph': dict(HF_TWO, static_graph=True, lora=True),
    'hf_no_data': dict(HF_THREE),
    'hf_lora_no_data': dict(HF_THREE, lora=True),
}
# a segment only the ranks with a full batch run (block skipped on the last, short batch): every rank stops
STOPS: dict[str, dict] = {
    f'fsdp2_branch_{mode}': dict(TWO, wrapper='fsdp2', checkpoint=mode, skip_below=8) for mode in MODES
}
# every rank raises after the loss of a step where the short rank shadows: the long rank's hooks are on then
RAISES = {'raises_mid_step': dict(TWO, checkpoint='reentrant', static_graph=True, raise_at=(3, 'after_loss'))}
ALL = with_rotations({**SCENARIOS, **HF, **STOPS, **RAISES})
STOP_NAMES = [n for n in ALL if n.split('@')[0] in STOPS]
EXACT = [n for n in ALL if n.split('@')[0] in {**SCENARIOS, **HF}]


def calls_of(names: list[str], join: bool = True) -> list[tuple[str, str, dict]]:
    """The harness calls of ``names`` (stock Composer's with ``join=False``)."""
    out = []
    for name in names:
        cfg = ALL[name] if join else dict(ALL[name], join=None)
        out.append((name, f'scenarios_checkpointing:{"hf" if name.startswith("hf") else "toy"}', {'cfg': cfg}))
    return out


@pytest.fixture(scope='module')
def runs() -> dict:
    results = {}
    for world in (2, 3):
        names = [n for n in ALL if n not in STOP_NAMES and len(ALL[n]['shards']) == world]
        results.update(launch(world, calls_of(names), timeout=600))
    return results


@pytest.fixture(scope='module')
def stops() -> dict:
    """The scenarios that must stop every rank, in a launch of their own: where they do not, gloo aborts it."""
    return launch(2, calls_of(STOP_NAMES), timeout=300)


def expected(name: str) -> dict:
    """The single-process reference's parameters for scenario ``name``."""
    cfg = ALL[name]
    if name.startswith('hf'):
        return reference_hf.train(cfg)
    return reference.train(dict(cfg, model='deep'))['params']


@pytest.mark.parametrize('name', EXACT)
def test_training_with_checkpointed_blocks_equals_one_process(runs, name):
    cfg = ALL[name]
    ref = expected(name)
    for rank, res in enumerate(ok(runs, name)):
        assert res['error'] is None, f'{name}: rank {rank} raised {res["error"]}'
        assert res['samples'] == sum(cfg['shards']) * cfg['epochs'], f'{name}: rank {rank} trained {res["samples"]}'
        diff = reference.max_abs_diff(res['params'], ref)
        assert diff < TOL, f'{name}: rank {rank} is {diff:.2e} from one process'
        assert res['hooks_left'] == 0, f'{name}: rank {rank} keeps {res["hooks_left"]} of our hooks on the model'


@pytest.mark.parametrize('name', STOP_NAMES)
def test_a_segment_only_some_ranks_run_stops_every_rank_under_fsdp2(stops, name):
    for rank, res in enumerate(ok(stops, name)):
        error = res['error'] or ''
        assert error.startswith('UnevenInputsError'), f'{name}: rank {rank}: {error or "trained"}'
        assert 'at step 2' in error and 'block.0.weight (used on 1 of 2 ranks)' in error, error
        assert res['hooks_left'] == 0, f'{name}: rank {rank} keeps {res["hooks_left"]} of our hooks on the model'


@pytest.mark.parametrize('name', expand(list(RAISES), ALL))
def test_a_run_that_raises_mid_step_leaves_no_hook_behind(runs, name):
    for rank, res in enumerate(ok(runs, name)):
        assert (res['error'] or '').startswith('RuntimeError: raised at after_loss of step 3'), res['error']
        assert res['hooks_left'] == 0, f'{name}: rank {rank} keeps {res["hooks_left"]} of our hooks on the model'
