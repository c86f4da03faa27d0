"""What Composer and a callback read is what stock Composer shows them, and on uneven data the agreed values (issue 51).

Two real ranks, one launch (``scenarios_composer_view``):

* **Differential, on even data**: every scenario (train, evaluation, ``predict()``, two fits and a third, a fit in
  pieces with and without ``spin_dataloaders``, a raise then a retry, at an epoch's start and mid-epoch, a mid-epoch
  resume from a checkpoint in a new trainer, an algorithm
  that checks the loader's type as RandAugment does) runs with stock Composer and with UnevenJoin in both modes; a
  callback records at every event what a callback can read, and the records must be equal event by event. The one
  intended difference (docs/how-it-works.md, "What Composer reads, and when"): inside a fit (from ``FIT_START`` to
  ``FIT_END``, not included), an evaluation or a ``predict()``, ``state.dataloader`` is UnevenJoin's loader over the
  same user dataloader. Final weights equal stock's.
* **On uneven data**: the learning rate of every step, from a fit's first step, on every rank, for schedulers in the
  constructor and in ``fit()``, equals a single-process replay's (:func:`replay`, no composer_join, its schedule
  formulas validated against stock Composer on even data in the same launch); the clocks, gathered at every batch
  end, never differ between ranks; the weights equal the replay's. The short rank first and last.
* **A stand-in's loss** (a mean over no token, NaN) reaches neither the logged loss nor a ``NaNMonitor``.

Measured on main before (issue 51): the fit's first step used lr 0.05 on one rank and 0.003125 on the other (step
schedule), replicas 1.6e-2 apart; ``dataloader_len`` None at ``EPOCH_START`` and in every evaluation; a raise at the
first ``EPOCH_START`` then ``fit()``: ``ValueError: max_duration cannot be specified in epochs``; a second fit with the
type check: ``TypeError``; pieces without spinning: ``UnevenInputsError: rank(s) []``; a second fit with
``CollectiveCounter``: ``register_comm_hook ... can only be called once``; the stand-in's loss: ``nan`` logged.
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from harness import launch
from test_join_core import ok
from test_rebalance import expected_steps
from toy import lm_batch, lm_shard, lm_token_losses, make_lm, make_module, per_sample_loss, shard

TOL = 1e-6
BATCH, LR, MOMENTUM = 8, 0.1, 0.9
MODES = {'stock': None, 'shadow': {}, 'rebalance': {'mode': 'rebalance'}}

EVEN = {
    'A': {'sizes': (24, 24, 24), 'seed': 0},
    'B': {'sizes': (16, 16, 16), 'seed': 10},
    'E': {'sizes': (12, 12, 12), 'seed': 20},
    'P': {'sizes': (10, 10, 10), 'seed': 30},
}
DIFFERENTIAL: dict[str, dict] = {
    'train_eval_predict': dict(
        trainer=dict(train='A', eval='E', max_duration='2ep'), calls=[['fit', {}], ['eval', 'E'], ['predict', 'P']]
    ),
    'three_fits': dict(
        trainer=dict(train='A', max_duration='1ep'),
        calls=[
            ['fit', {}],
            ['fit', {'train': 'B', 'duration': '2ep', 'schedule': 'cosine'}],
            ['fit', {'duration': '1ep'}],
        ],
        counter=True,
    ),
    'pieces': dict(
        trainer=dict(train='A'), calls=[['fit', {'duration': d}] for d in ('2ba', '3ba', '2ba')], counter=True
    ),
    'pieces_no_spin': dict(
        trainer=dict(train='A', spin=False), calls=[['fit', {'duration': d}] for d in ('2ba', '3ba', '2ba')]
    ),
    'raise_at_epoch_start': dict(
        trainer=dict(train='A', max_duration='2ep'), calls=[['fit', {}]], raise_at='epoch_start'
    ),
    'raise_mid_epoch': dict(trainer=dict(train='A', max_duration='2ep'), calls=[['fit', {}]], raise_at='batch_end'),
    # a checkpoint of batch 2 (mid-epoch), loaded by a new trainer that trains on
    'resume': dict(trainer=dict(train='A', max_duration='2ep'), calls=[['fit', {}]], resume={'at': '2ba'}),
}
_FOLDER = tempfile.mkdtemp(prefix='composer-view-')  # the checkpoints, one folder per scenario below it

# per world size: the constructor's even loader, the uneven one (every rank short once, by rotation)
UNEVEN = {
    2: {'A': {'sizes': (16, 16), 'seed': 0}, 'B': {'sizes': (40, 8), 'seed': 10}},
    3: {'A': {'sizes': (16, 16, 16), 'seed': 0}, 'B': {'sizes': (40, 24, 8), 'seed': 10}},
}
SCHEDULED: dict[str, dict] = {
    # a second fit with its own (uneven) loader and a schedule compiled in fit(), the clock going on
    'step_in_fit': dict(
        trainer=dict(train='A', max_duration='1ep'),
        calls=[['fit', {}], ['fit', {'train': 'B', 'duration': '2ep', 'schedule': 'step'}]],
    ),
    'cosine_in_fit': dict(
        trainer=dict(train='A', max_duration='1ep'),
        calls=[['fit', {}], ['fit', {'train': 'B', 'duration': '2ep', 'schedule': 'cosine'}]],
    ),
    # the constructor's schedule over an uneven loader, then a fit in pieces across the epochs
    'cosine_in_constructor': dict(trainer=dict(train='B', max_duration='2ep', schedule='cosine'), calls=[['fit', {}]]),
    'pieces_uneven': dict(
        trainer=dict(train='B', max_duration='2ep', schedule='step'),
        calls=[['fit', {'duration': d}] for d in ('2ba', '4ba', '4ba')],
    ),
}


def _scenarios(world: int) -> dict[str, dict]:
    out = {}
    for name, cfg in DIFFERENTIAL.items():
        for mode, join in MODES.items():
            out[f'{world}:even:{name}:{mode}'] = dict(cfg, loaders=EVEN, join=join)
            if 'resume' in cfg:
                folder = f'{_FOLDER}/{world}-{name}-{mode}'
                out[f'{world}:even:{name}:{mode}']['resume'] = dict(cfg['resume'], folder=folder)
    uneven = UNEVEN[world]
    for name, cfg in SCHEDULED.items():
        for rot in range(world):
            for mode in ('shadow', 'rebalance'):
                out[f'{world}:uneven:{name}:{mode}@rot{rot}'] = dict(cfg, loaders=uneven, join=MODES[mode], rot=rot)
        # the schedule formulas of the replay, checked against stock Composer where its lengths agree
        even = {'A': uneven['A'], 'B': {'sizes': (40,) * world, 'seed': 10}}
        out[f'{world}:validate:{name}'] = dict(cfg, loaders=even, join=None)
    return out


SCENARIOS = {**_scenarios(2), **_scenarios(3)}
WORLDS = (2, 3)
# the rank with no data first, in the middle and last; 2 and 3 ranks
NAN = {f'{w}:nan_loss@empty{e}': {'empty': e, 'samples': 8, 'world': w} for w in WORLDS for e in range(w)}


@pytest.fixture(scope='module')
def runs() -> dict:
    out = {}
    for world in WORLDS:
        calls = [
            (n, 'scenarios_composer_view:sequence', {'cfg': c}) for n, c in SCENARIOS.items() if n[0] == str(world)
        ]
        calls += [(n, 'scenarios_composer_view:nan_loss', {'cfg': c}) for n, c in NAN.items() if c['world'] == world]
        if world == 2:
            calls.append(('refusal', 'scenarios_composer_view:fit_after_refusal', {'cfg': {'loaders': EVEN}}))
        out.update(launch(world, calls, timeout=600))
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# -- the differential test on even data ------------------------------------------------------------------------------

_OPENS = {'fit_start', 'eval_start', 'predict_start'}
_CLOSES_AFTER = {'eval_end', 'predict_end'}  # inside their window; fit_end is outside its own


def _inside_windows(records: list[dict]) -> list[bool]:
    """Per event: whether it is inside a fit's, an evaluation's or a predict()'s window (see the module docstring)."""
    depth, inside = 0, []
    for r in records:
        event = r['event']
        if event in _OPENS:
            depth += 1
        if event == 'fit_end':
            depth = 0  # (a fit that raised left its window open: the retry's FIT_START opened another)
        inside.append(depth > 0)
        if event in _CLOSES_AFTER:
            depth -= 1
    return inside


@pytest.mark.parametrize('world', WORLDS)
@pytest.mark.parametrize('name', list(DIFFERENTIAL))
@pytest.mark.parametrize('mode', ['shadow', 'rebalance'])
def test_on_even_data_every_event_reads_what_it_reads_without_unevenjoin(runs, name, mode, world):
    stock_runs, join_runs = ok(runs, f'{world}:even:{name}:stock'), ok(runs, f'{world}:even:{name}:{mode}')
    for rank, (stock, join) in enumerate(zip(stock_runs, join_runs)):
        where = f'{name} ({mode}, {world} ranks), rank {rank}'
        assert join['raised'] == stock['raised'], where
        if 'resume' in DIFFERENTIAL[name]:  # the trainer resumed mid-epoch, at the checkpoint's batch
            first = next(r for r in join['view'] if r['event'] == 'batch_start')
            assert first['timestamp'][1:3] == (2, 2), f'{where}: {first["timestamp"]}'
        assert len(join['view']) == len(stock['view']), (
            f'{where}: {len(join["view"])} events, stock {len(stock["view"])}'
        )
        for i, (a, b, inside) in enumerate(zip(stock['view'], join['view'], _inside_windows(join['view']))):
            assert a['event'] == b['event'], f'{where}: event {i}'
            difference = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
            if inside and difference.get('dataloader') == (a['dataloader'], f'join:{a["dataloader"]}'):
                del difference['dataloader']  # the intended difference, inside a window only
            assert not difference, f'{where}: at event {i} ({a["event"]}) stock read / UnevenJoin read: {difference}'
        assert join['loader_types'] == stock['loader_types'], where  # the user's dataset, through a DataLoader
        for got, want in zip(join['results'], stock['results'], strict=True):  # an evaluation's metrics, predict()'s
            assert got == (want if not isinstance(want, dict) else pytest.approx(want, abs=TOL)), where
        assert _diff(join['params'], stock['params']) < TOL, where
        assert join['differences'] == [] and stock['differences'] == [], where


# -- uneven data: the agreed clocks, from each fit's first step ------------------------------------------------------


def _lr(schedule: Optional[str], at: int, length: int, epochs: int) -> float:
    """Composer's schedule at batch ``at`` of the clock, with ``length`` batches per epoch and a duration of ``epochs``
    epochs (the schedules of :func:`scenarios_composer_view._schedule`)."""
    if schedule == 'step':  # StepScheduler(step_size='1ep', gamma=0.5)
        return LR * 0.5 ** (at // length)
    if schedule == 'cosine':  # CosineAnnealingScheduler(t_max='1dur', alpha_f=0.1)
        return LR * (0.1 + 0.9 * (1 + math.cos(math.pi * at / (length * epochs))) / 2)
    return LR


def _batches(spec: dict, rank: int, rot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sizes = spec['sizes']
    x, y = shard(rank + spec['seed'], sizes[(rank + rot) % len(sizes)])
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(y), BATCH)]


def _steps(per_rank: list[list], rebalance: bool) -> list[list]:
    """Per step of an epoch, the batches trained: in ``mode='shadow'`` each rank's ``t``-th at step ``t``; rebalancing,
    by the README's rules (:func:`test_rebalance.expected_steps`, from the lengths alone)."""
    if not rebalance:
        return [[b[t] for b in per_rank if t < len(b)] for t in range(max(len(b) for b in per_rank))]
    return [[per_rank[owner][i] for owner, i in step] for step in expected_steps([len(b) for b in per_rank])]


def replay(cfg: dict) -> dict[str, Any]:
    """One process trains what the scenario intends: per step the union of the batches trained (:func:`_steps`), the
    mean gradient times ``A_t / W``, SGD with momentum; the learning rate of step ``b`` (the clock's batch) is the
    schedule at ``max(b - 1, start)``, ``start`` being the batch at which it was compiled (Composer steps its
    schedulers after each batch, before the clock moves on), with the epoch's length in steps. Returns the parameters
    and every step's learning rate."""
    rebalance = (cfg.get('join') or {}).get('mode') == 'rebalance'
    torch.manual_seed(0)
    module = make_module('mlp')
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    ctor, rot = cfg['trainer'], cfg.get('rot', 0)
    world = len(cfg['loaders'][ctor['train']]['sizes'])
    fits, epochs_done = [], 0
    for kind, arg in cfg['calls']:
        if kind != 'fit':
            continue
        fits.append({'train': ctor['train'] if not fits else fits[-1]['train'], **arg})
    loader, schedule, start, clock, lrs = ctor['train'], ctor.get('schedule'), 0, 0, []
    pieces_steps = None
    if all('duration' in f and f['duration'].endswith('ba') for f in fits):  # a fit in pieces: one run of the epochs
        pieces_steps = sum(int(f['duration'][:-2]) for f in fits)  # (in as many epochs as that takes)
        fits = [dict(train=ctor['train'], epochs=pieces_steps)]
    total_epochs = int(ctor['max_duration'][:-2]) if ctor.get('max_duration') else cfg.get('epochs', 0)
    for n, fit in enumerate(fits):
        if n > 0:
            loader = fit.get('train', loader)
            if 'schedule' in fit:
                schedule, start = fit['schedule'], clock
            total_epochs = epochs_done + int(fit['duration'][:-2])
        steps = _steps([_batches(cfg['loaders'][loader], r, rot) for r in range(world)], rebalance)
        length = len(steps)
        epochs = fit.get('epochs', total_epochs - epochs_done)
        for _ in range(epochs):
            if pieces_steps is not None and clock == pieces_steps:
                break
            for active in steps:
                if pieces_steps is not None and clock == pieces_steps:
                    break
                x = torch.cat([b[0] for b in active])
                y = torch.cat([b[1] for b in active])
                rate = _lr(schedule, max(clock - 1, start), length, total_epochs)
                for group in optimizer.param_groups:
                    group['lr'] = rate
                lrs.append(rate)
                optimizer.zero_grad()
                (per_sample_loss(module, x, y).mean() * len(active) / world).backward()
                optimizer.step()
                clock += 1
            epochs_done += 1
    return {'params': {k: v.detach().clone() for k, v in module.named_parameters()}, 'lrs': lrs}


@pytest.mark.parametrize('world', WORLDS)
@pytest.mark.parametrize('name', list(SCHEDULED))
def test_the_replays_schedules_are_composers(runs, name, world):
    """The replay's learning rates and weights equal stock Composer's where every rank has the same length."""
    cfg = SCENARIOS[f'{world}:validate:{name}']
    ref = replay(cfg)
    for rank, res in enumerate(ok(runs, f'{world}:validate:{name}')):
        assert res['lrs'] == pytest.approx(ref['lrs'], abs=1e-12), f'{name}: rank {rank}'
        assert _diff(res['params'], ref['params']) < TOL, f'{name}: rank {rank}'


ROTATED = [(world, rot) for world in WORLDS for rot in range(world)]


@pytest.mark.parametrize('name', list(SCHEDULED))
@pytest.mark.parametrize(('world', 'rot'), ROTATED)
@pytest.mark.parametrize('mode', ['shadow', 'rebalance'])
def test_on_uneven_data_every_step_uses_the_agreed_schedule_from_the_first(runs, name, world, rot, mode):
    cfg = SCENARIOS[f'{world}:uneven:{name}:{mode}@rot{rot}']
    ref = replay(cfg)
    for rank, res in enumerate(ok(runs, f'{world}:uneven:{name}:{mode}@rot{rot}')):
        where = f'{name}, {world} ranks, rotated {rot}, {mode}: rank {rank}'
        assert res['lrs'] == pytest.approx(ref['lrs'], abs=1e-12), where
        assert res['differences'] == [], f'{where}: clocks differ between ranks: {res["differences"][:2]}'
        diff = _diff(res['params'], ref['params'])
        assert diff < TOL, f'{where}: {diff:.2e} from the single-process replay'


# -- a stand-in's loss --------------------------------------------------------------------------------------------


def _lm_replay(cfg: dict) -> dict[str, Any]:
    """One process: per step, the batches of the ranks with data (4 sequences each, the first two prompt-only), the
    mean over all their loss-generating tokens, times ``A_t / W`` for the gradient; the loss each step logs is that
    mean (Composer's token-weighted loss over the real ranks)."""
    module = make_lm()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    ranks = [r for r in range(cfg['world']) if r != cfg['empty']]
    shards, logged = [lm_shard(r, cfg['samples']) for r in ranks], []
    for i in range(0, cfg['samples'], 4):
        batches = [lm_batch(seqs[i : i + 4]) for seqs in shards]
        for batch in batches:
            batch['labels'][:2] = -100
        loss = torch.cat([lm_token_losses(module, batch) for batch in batches]).mean()
        logged.append(float(loss))
        optimizer.zero_grad()
        (loss * len(ranks) / cfg['world']).backward()
        optimizer.step()
    return {'logged': logged, 'params': {k: v.detach().clone() for k, v in module.named_parameters()}}


@pytest.mark.parametrize('name', list(NAN))
def test_a_stand_ins_loss_reaches_no_log_and_no_nan_monitor(runs, name):
    ref = _lm_replay(NAN[name])
    for rank, res in enumerate(ok(runs, name)):
        assert res['finite'], f'{name}: rank {rank} logged {res["logged"]}'
        assert res['logged'] == pytest.approx(ref['logged'], abs=TOL), f'{name}: rank {rank}'
        assert _diff(res['params'], ref['params']) < TOL, f'{name}: rank {rank}'


def test_a_fit_refused_at_its_start_leaves_nothing_and_the_next_fit_is_stocks(runs):
    for rank, res in enumerate(ok(runs, 'refusal')):
        assert 'GhostBatchNorm' in res.get('refused', ''), f'rank {rank}: {res.get("refused")}'
        assert res['left'] == 'user', f'rank {rank}: state.dataloader after the refusal: {res["left"]}'
        assert _diff(res['joined'], res['stock']) < TOL, f'rank {rank}'


# -- the docs' list of changes to objects UnevenJoin does not own -------------------------------------------------

ROOT = Path(__file__).parent.parent
# a change to another's object: through a register of changes, or by hand where it is undone at once or never
_CHANGE = re.compile(
    r'\b(changes|stand_ins)\.(set|call|hook|remove_from)\(|\bsetattr\(|\bcompat\.(set_\w+|dataloader_cap_off)\('
    r'|\.set_dataloader\(|serialized_attributes\.(remove|append)\('
)
_IMPLEMENTS = {'core/changes.py', 'core/compat.py'}  # the register itself, and the private names' one place


def test_every_module_that_changes_anothers_object_is_in_the_docs_list_and_only_those():
    text = (ROOT / 'docs' / 'how-it-works.md').read_text()
    section = text.split('Every change UnevenJoin makes to an object it does not own', 1)[1]
    listed = {m for row in section.splitlines() if row.startswith('|') for m in re.findall(r'`([\w/]+\.py)`', row)}
    changing = set()
    for path in (ROOT / 'composer_join').rglob('*.py'):
        module = path.relative_to(ROOT / 'composer_join').as_posix()
        code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith(('#', '>>>', '...'))]
        if module not in _IMPLEMENTS and any(_CHANGE.search(line) for line in code):
            changing.add(module)
    assert changing - listed == set(), f'changes made in modules the docs do not list: {sorted(changing - listed)}'
    assert listed - changing == set(), f'modules the docs list that change nothing: {sorted(listed - changing)}'
