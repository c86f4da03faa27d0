"""The scenario fuzzer (issue 47): seeded draws from the documented feature space, run on real ranks, checked
against an independent reference (``tests/fuzz_reference.py``), failures confirmed alone and shrunk.

A scenario is a plain JSON-printable dict (:func:`draw` from a seed; :func:`normalize` makes any dict valid).
Drawn now:

* data: world size 2 or 3; per-rank shards of 0 to 3 batches + 1 (empty and one-batch shards often), which rank
  is short drawn like everything else; sources ``len`` (an ``IterableDataset`` with an exact ``len()``),
  ``nolen`` (none), ``over``/``under`` (a ``len()`` one batch too high / low: an ``UnevenInputsError`` predicted
  where docs/limits.md says so; rebalancing, always: docs/rebalancing.md), ``exact`` (map-style with ``composer_join.ExactDistributedSampler``), ``torch``
  (map-style with torch's padding ``DistributedSampler``), shuffled or not; DataLoader workers 0-2; tuple or dict
  batches; ``batch_transforms`` that change the dtype (``float``), drop a sample (``drop``) or double the samples
  (``views``); a ``microbatch_transforms`` (``mb_transform``);
* model: ``mlp``, ``branch`` (a head only label-0 samples use: data-dependent unused parameters), ``bn``
  (BatchNorm), ``deep`` with ``ckpt`` None / reentrant / non-reentrant activation checkpointing, ``frozen`` (a
  layer without gradients), ``sparse`` (``nn.Embedding(sparse=True)`` with ``SparseAdam``), ``sync`` (a
  ``shadow_forward`` normalisation whose forward all-reduces its statistics: ``fuzz_reference.SyncNorm``);
* training: microbatch size, every ``ddp_sync_strategy``, ``find_unused_parameters`` (an algorithm asking for it),
  DDP ``static_graph``, SGD with momentum or Adam, gradient clipping (Composer's ``GradientClipping``: another
  algorithm), ``mode='shadow'``/``'rebalance'``, both ``divide_by_initial_world_size``, durations in epochs,
  batches, samples or tokens;
* life: evaluation with the Trainer's own loader and with a passed one (accuracy, a per-sample mean loss and a
  list-state metric of the ids seen), ``predict()``, a second ``fit()``;

* wrappers: DDP, FSDP1, FSDP2 (``wrapper``; on CPU with ``tests/scenarios_fsdp.py``'s gloo workarounds);
* life: a checkpoint after a random step of the first fit (the 'branch' model's not before its head's first
  gradient: stock Composer cannot load that, docs/limits.md), resumed on the same world size (``resume_at``); an
  exception raised on every rank at a random event (``raise_at``: fit, epoch, batch start, after the dataloader,
  before the forward at a random step; evaluation or predict start), the call then retried on the same trainer;
* life: that checkpoint resumed on another world size, 1 to 3 (``resume_world``; about 3% of the scenarios, over a third
  of them from an epoch's last batch): a second launch on ``resume_world`` ranks lives the rest of the scenario
  (the rest of the first fit, a second fit, evaluations, predict), per-rank lists (train shards of per-rank data,
  eval and predict shards) covering ``max(world, resume_world)`` ranks, each run taking its first ones; per-rank
  shard data resumed mid-epoch is expected to stop every rank of the second launch with ``UnevenInputsError``.
* life: a chain of resumptions (``chain_world``, ``chain_at``; drawn for 30% of those on another world size, kept
  where the rules below allow: about 8% of the ``--elastic`` draws, 34 of seeds 400000's first 400; ``--chain``
  draws only them): the second launch fits on saving after every batch, and its checkpoint after step
  ``chain_at`` (aimed a third each inside the rest of the epoch the first resumption interrupted, where it has two
  steps or more, at an epoch's last batch, where there is one, and anywhere after ``resume_at``, where the others
  fall back to) is resumed by a third launch on ``chain_world`` ranks (1 to 3, not ``resume_world``; it may be
  ``world``: 2 -> 3 -> 2), which lives the rest of the scenario; per-rank lists cover every run's ranks. The
  reference deals what the second run's ranks had not used of their shares over the third run's
  (``fuzz_reference.epoch_batches``). Per-rank shard data resumed again mid-epoch is expected to stop every rank of
  the third launch with ``UnevenInputsError``; per-rank shard data resumed mid-epoch the first time (the second
  launch refused) gets no chain, nor does a resumed run with no step after ``resume_at`` but its last.

* life: one ``UnevenJoin`` in two Trainers (``twin``: after the first fit, a second Trainer given the first's
  ``UnevenJoin`` trains the first fit again from scratch; the first Trainer's life then goes on).

* life: evaluation before the first ``fit()`` (``eval_first``: ``[calls, kind]``, about 12% of the scenarios): 1 or
  2 ``eval()`` calls on the fresh Trainer, each with its own loader ('own'), a passed one ('passed') or both, which
  must equal the reference's evaluation of the initial weights; then the rest of the scenario as before. Resumed on
  another world size, the first launch evaluates so before its saving fit, and the second launch's first call is
  such an evaluation too, of the checkpoint it just loaded (its parameters the reference's after ``resume_at``
  steps) over the new world size's eval shards. A Trainer's own loader added for it also evaluates inside ``fit()``.

* automatic microbatching (``oom``: Composer's out-of-memory retry, simulated on CPU as ``tests/scenarios_oom.py``
  does: one rank's forward, loss or backward raises Composer's recognised OOM at one of its real steps; Composer
  halves the microbatch size on every rank and retries the step).

Not yet drawn: DDP's ``static_graph`` where a resumed Trainer's first step splits into different microbatch counts
(its new DDP's first iteration: every rank of that launch stops, by design; not predicted), an exception on only
some ranks, a chain of three resumptions or more, a chained resumption on the world size it resumes
(``chain_world == resume_world``: the layout-keeping rule, each rank going on with its own share, is not in the
reference), a twin or an out-of-memory error beside any resumption, a raise at ``EVAL_START`` beside evaluations
before the first fit (stock Composer then trains the next fit on the eval loader, seed 623337).

A scenario passes when: every rank's parameters are within :data:`TOL` of the reference's (or, where the scenario
amplifies float32 rounding past it, within :data:`NOISE` times the reference's own distance from the same training
in float64: ``fuzz_reference.float_noise``, BatchNorm over small microbatches, seed 642866), every rank holds the
same state (parameters and buffers), each step trained exactly the reference's samples (so every id as often as
its shard holds it, checked per epoch against the data itself: loaded once each, before the batch transform, and
trained as the transform leaves the data's batches, except an epoch resumed mid-epoch on another world size with
'drop', whose rest is batched anew: ``fuzz_reference.regrouped``), the timestamp counts the reference's steps and
samples, evaluations equal one process's over the union (every eval id exactly once; those before the first fit
with the initial weights), predictions are every
rank's own samples; or, where the scenario predicts it, every rank raised ``UnevenInputsError``. A hang is a
launch timeout. Resumed on another world size, the steps before ``resume_at`` are the first launch's (which must
have succeeded), the rest, the timestamp, evaluations and predictions the second's; chained, the steps from
``resume_at`` to before ``chain_at`` are the second launch's (which must have succeeded too), the rest the third's.


Command line (``make fuzz N=500 SEED=...``)::

    python tests/scenario_fuzz.py --seed 1234 --n 200        # seeds 1234..1433, failures confirmed and shrunk
    python tests/scenario_fuzz.py --seed 1240                 # one seed
    python tests/scenario_fuzz.py --scenario '{"world": 2, ...}'   # one literal scenario
    python tests/scenario_fuzz.py --seed 1 --n 30 --elastic   # the first 30 seeds from 1 resumed on another world size
    python tests/scenario_fuzz.py --seed 1 --n 20 --elastic --only transform=drop   # ... whose transform is 'drop'
    python tests/scenario_fuzz.py --seed 1 --n 20 --chain     # the first 20 from 1 resumed twice (2 -> 3 -> 2 ...)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).parent))

import fuzz_reference as ref

TOL = 1e-6
NOISE = 4  # a rank within this many times the reference's own float32 noise (float32 vs float64) also passes
CHUNK = 20  # scenarios per launch
COMMAND = 'PYTHONPATH=. python tests/scenario_fuzz.py'


# ----------------------------------------------------------------------------------------------- the generator
def _size(rng: random.Random, batch: int) -> int:
    return rng.choice([0, 1, batch, rng.randint(0, 3 * batch + 1), rng.randint(0, 3 * batch + 1)])


def _sizes(rng: random.Random, world: int, batch: int) -> list[int]:
    sizes = [_size(rng, batch) for _ in range(world)]
    if sum(sizes) == 0:
        sizes[rng.randrange(world)] = rng.randint(1, 2 * batch + 1)
    return sizes


def draw(seed: int) -> dict[str, Any]:
    """A scenario from ``seed`` (deterministic), already :func:`normalize` d."""
    rng = random.Random(seed)
    world = rng.choice([2, 2, 3])
    batch = rng.randint(1, 5)
    sc: dict[str, Any] = {'seed': seed, 'world': world, 'batch': batch}
    sc['source'] = rng.choice(['len'] * 4 + ['nolen'] * 2 + ['exact'] * 2 + ['torch', 'over', 'under'])
    sc['shards'] = _sizes(rng, world, batch)
    sc['map_size'] = rng.randint(1, 3 * batch * world + 1)
    sc['shuffle'] = rng.random() < 0.5
    sc['workers'] = rng.choice([0, 0, 0, 1, 2])
    sc['fmt'] = rng.choice(['tuple', 'dict'])
    sc['transform'] = rng.choice([None, None, None, 'float', 'drop', 'views'])
    sc['mb_transform'] = rng.random() < 0.2
    sc['model'] = rng.choice(['mlp', 'mlp', 'branch', 'bn', 'deep', 'frozen', 'sparse'])
    sc['ckpt'] = rng.choice([None, 'reentrant', 'non_reentrant'])
    sc['microbatch'] = None if rng.random() < 0.5 else rng.randint(1, batch)
    sc['sync'] = rng.choice([None, 'single_auto_sync', 'multi_auto_sync', 'forced_sync'])
    sc['find_unused'] = rng.random() < 0.2
    sc['static_graph'] = rng.random() < 0.1
    sc['optimizer'] = rng.choice(['sgd', 'adam'])
    sc['clip'] = rng.random() < 0.25
    sc['mode'] = 'rebalance' if rng.random() < 0.25 else 'shadow'
    sc['divide'] = rng.random() < 0.7
    unit = rng.choice(['ep', 'ep', 'ep', 'ba', 'sp'])
    sc['duration'] = [rng.randint(1, 2), unit]
    if unit != 'ep':  # set from the data in normalize (a fraction of two epochs)
        sc['duration'] = [rng.random(), unit]
    sc['refit'] = rng.random() < 0.2
    sc['wrapper'] = rng.choice([None] * 6 + ['fsdp1', 'fsdp2'])
    sc['resume_at'] = rng.random() if rng.random() < 0.15 else None  # a fraction of the first fit's steps
    sc['eval'] = rng.choice([None, None, 'own', 'passed', 'both'])
    sc['eval_batch'] = rng.randint(1, 5)
    sc['eval_shards'] = _sizes(rng, world, sc['eval_batch'])
    sc['eval_microbatch'] = None if rng.random() < 0.5 else rng.randint(1, sc['eval_batch'])
    sc['predict_shards'] = _sizes(rng, world, batch) if rng.random() < 0.25 else None
    # (new draws go last, so that a seed's earlier features stay what they were)
    sc['raise_at'] = [rng.choice(RAISE_EVENTS), rng.random()] if rng.random() < 0.2 else None
    if unit == 'sp' and rng.random() < 0.5:
        sc['duration'][1] = 'tok'
    sc['twin'] = rng.random() < 0.1
    if rng.random() < 0.1:
        sc['model'] = 'sync'
    sc['oom'] = [rng.random(), rng.choice(['forward', 'loss', 'backward'])] if rng.random() < 0.12 else None
    # resumed on another world size: 15% of the resumptions drawn above, and a resumption added to 2% of the others
    boundary, where, fraction = False, 'any', 0.0
    if rng.random() < (0.15 if sc['resume_at'] is not None else 0.02):
        sc['resume_world'] = rng.choice([w for w in (1, 2, 3) if w != world])
        sc['resume_at'] = sc['resume_at'] if sc['resume_at'] is not None else rng.random()
        extra = max(0, sc['resume_world'] - world)  # the ranks only the second run has: shards of their own
        sc['shards'] += [_size(rng, batch) for _ in range(extra)]
        sc['eval_shards'] += [_size(rng, sc['eval_batch']) for _ in range(extra)]
        if sc['predict_shards'] is not None:
            sc['predict_shards'] += [_size(rng, batch) for _ in range(extra)]
        boundary = rng.random() < 0.35  # from the checkpoint of an epoch's last batch (the nearest one)
        if rng.random() < 0.3:  # a chain: the resumed run's own checkpoint resumed on a third world size
            sc['chain_world'] = rng.choice([w for w in (1, 2, 3) if w != sc['resume_world']])
            fraction, where = rng.random(), rng.choice(['any', 'rest', 'boundary'])
            sc['chain_at'] = fraction
            extra = max(0, sc['chain_world'] - max(world, sc['resume_world']))  # the third run's own ranks
            sc['shards'] += [_size(rng, batch) for _ in range(extra)]
            sc['eval_shards'] += [_size(rng, sc['eval_batch']) for _ in range(extra)]
            if sc['predict_shards'] is not None:
                sc['predict_shards'] += [_size(rng, batch) for _ in range(extra)]
    # evaluations before the first fit: 1 or 2 eval() calls, each of the Trainer's own loader, a passed one or both
    sc['eval_first'] = [rng.choice([1, 1, 2]), rng.choice(['own', 'passed', 'both'])] if rng.random() < 0.12 else None
    sc = normalize(sc)
    if boundary and sc.get('resume_world'):
        ends = epoch_ends(sc)
        if ends:
            resume_at = min(ends, key=lambda e: (abs(e - sc['resume_at']), e))
            sc = normalize({**sc, 'resume_at': resume_at, **({'chain_at': fraction} if 'chain_at' in sc else {})})
    if sc.get('chain_at') is not None and where != 'any':
        sc = normalize({**sc, 'chain_at': _chain_at(sc, where, fraction) or sc['chain_at']})
    return sc


def epoch_ends(sc: dict) -> list[int]:
    """The steps after which a checkpoint of ``sc``'s first fit (on ``world`` ranks) is an epoch's last batch's, other
    than the fit's last: the ``resume_at`` values that resume at an epoch boundary."""
    steps = ref.planned_steps({**sc, 'refit': False, 'resume_world': None})
    return [t + 1 for t in range(len(steps) - 1) if steps[t][0] != steps[t + 1][0]]


def chain_ends(sc: dict) -> list[int]:
    """The steps after which a checkpoint of ``sc``'s resumed run (its first fit, from ``resume_at`` on) is an epoch's
    last batch's, other than the fit's last: the ``chain_at`` values that resume again at an epoch boundary."""
    steps = ref.planned_steps({**sc, 'refit': False, 'chain_world': None, 'chain_at': None})
    return [t + 1 for t in range(sc['resume_at'], len(steps) - 1) if steps[t][0] != steps[t + 1][0]]


def _chain_at(sc: dict, where: str, fraction: float) -> Optional[int]:
    """A ``chain_at`` of ``where``: 'boundary' (the epoch end of the resumed run nearest its fraction), 'rest' (a
    step inside the rest of the epoch the first resumption interrupted, if it has two steps or more); else None."""
    ends = chain_ends(sc)
    if where == 'boundary' and ends:
        return min(ends, key=lambda e: (abs(e - sc['chain_at']), e))
    if where == 'rest' and ref.mid_epoch({**sc, 'chain_world': None}):
        end = next((e for e in ends), _second_fit_steps(sc))  # the interrupted epoch's end (or the fit's)
        if end - sc['resume_at'] >= 2:
            return (
                sc['resume_at'] + 1 + min(math.floor(fraction * (end - sc['resume_at'] - 1)), end - sc['resume_at'] - 2)
            )
    return None


RAISE_EVENTS = ['fit_start', 'epoch_start', 'batch_start', 'after_dataloader', 'before_forward', 'eval_start']
RAISE_EVENTS += ['predict_start']


def normalize(sc: dict[str, Any]) -> dict[str, Any]:
    """``sc`` made valid and minimal: what a feature needs, and nothing that no feature reads."""
    sc = copy.deepcopy(sc)
    world, batch = sc['world'], sc['batch']
    sc.setdefault('model', 'mlp')
    sc.setdefault('source', 'len')
    sc.setdefault('duration', [1, 'ep'])
    sc.setdefault('shards', [batch] * world)
    if sc.get('resume_world') not in (None, 1, 2, 3) or sc.get('resume_world') == world:
        sc['resume_world'] = None
    if sc.get('chain_world') not in (None, 1, 2, 3) or sc.get('chain_world') == sc.get('resume_world'):
        sc['chain_world'] = None
    if not sc.get('resume_world') or not sc.get('chain_world'):  # a chain needs a first resumption
        sc.pop('chain_world', None)
        sc.pop('chain_at', None)
    ranks = _ranks(sc)  # per-rank lists cover every run's ranks (the first resume_world of them after the resume)
    sc['shards'] = (sc['shards'] + [0] * ranks)[:ranks]
    empty = any(sum(sc['shards'][:w]) == 0 for w in _worlds(sc))
    if empty and sc['source'] not in ('exact', 'torch'):
        sc['shards'][0] = 1
    if sc['source'] in ('exact', 'torch'):
        sc.pop('shards', None)
    else:
        sc.pop('map_size', None)
        sc.pop('shuffle', None)
    if sc['source'] == 'nolen':
        sc['mode'] = 'shadow'  # the read-ahead rule has its own fuzz (tests/test_rebalance_unsized.py)
    if sc['source'] in ('over', 'under'):
        sc['workers'] = min(sc.get('workers', 0), 1)  # >1 workers over an IterableDataset: len() may undercount
        sc['duration'] = [sc['duration'][0] if sc['duration'][1] == 'ep' else 1, 'ep']
    if sc['source'] == 'nolen' and sc['duration'][1] == 'ep':
        sc['duration'] = [0.5, 'ba']
    if sc.get('wrapper'):  # FSDP: no DDP options; no frozen layer in a flat parameter, no sparse gradients
        sc.update(sync=None, find_unused=False, static_graph=False)
        # and no head only some samples use: FSDP has no find_unused_parameters, UnevenJoin raises by design
        # when ranks' microbatches use different parameters (seeds 1026, 1038)
        if sc['model'] in ('frozen', 'sparse', 'bn', 'branch', 'sync'):
            sc['model'] = 'mlp'
    if sc.get('static_graph') and sc['model'] in ('branch', 'sparse'):
        sc['static_graph'] = False
    if sc.get('static_graph'):  # docs/limits.md: only multi_auto_sync, and step 0 alike everywhere (else an error)
        sc.update(sync='multi_auto_sync', microbatch=None, find_unused=False)
    if sc['model'] == 'branch' and not sc.get('wrapper'):  # DDP needs find_unused_parameters for it (stock too)
        sc['find_unused'] = True
    if sc['model'] != 'deep':
        sc.pop('ckpt', None)
    elif sc.get('ckpt') == 'reentrant' and sc.get('find_unused'):  # DDP raises there, stock too (shadow-steps.md)
        sc['ckpt'] = 'non_reentrant'
    if sc['model'] == 'sparse':
        sc['optimizer'] = 'sparseadam'
        sc['clip'] = False
        # stock too: loading a checkpoint steps the optimizer with dense zero gradients (torch.distributed.checkpoint's
        # _init_optim_state), which SparseAdam refuses (seed 1074: 'SparseAdam does not support dense gradients',
        # also on even shards without UnevenJoin)
        sc['resume_at'] = None
    elif sc.get('optimizer') == 'sparseadam':
        sc['optimizer'] = 'sgd'
    if sc['model'] in ('bn', 'sync') and sc.get('optimizer') == 'adam':
        # a direction whose true gradient is 0 (BatchNorm removes the mean) carries float noise, which Adam turns into
        # steps of its learning rate: stock Composer on even shards is 1.7e-6 to 3.1e-5 from the reference there
        # (seeds 1012, 647676 made even), so the comparison cannot tell a bug; SGD with momentum shows one
        sc['optimizer'] = 'sgd'
    if sc.get('microbatch') is not None and sc['microbatch'] >= batch * (2 if sc.get('transform') == 'views' else 1):
        sc['microbatch'] = None
    if sc.get('eval_first') is not None:  # [calls, kind]: 1 or 2 calls of 'own', 'passed' or 'both'
        first = sc['eval_first'] if isinstance(sc['eval_first'], list) else [sc['eval_first'], 'own']
        calls = min(max(int(first[0] if first else 1), 1), 2)
        kind = first[1] if len(first) > 1 and first[1] in ('own', 'passed', 'both') else 'own'
        sc['eval_first'] = [calls, kind] if first and first[0] else None
    if not sc.get('eval') and not sc.get('eval_first'):
        for k in ('eval', 'eval_batch', 'eval_shards', 'eval_microbatch', 'eval_first'):
            sc.pop(k, None)
    else:
        sc.setdefault('eval_batch', 2)
        sc.setdefault('eval_shards', [sc['eval_batch']] * _ranks(sc))
        sc['eval_shards'] = (sc['eval_shards'] + [0] * _ranks(sc))[: _ranks(sc)]
        if sum(sc['eval_shards'][:world]) == 0:
            sc['eval_shards'][0] = 1
        if sc.get('eval_microbatch') is not None and sc['eval_microbatch'] >= sc['eval_batch']:
            sc['eval_microbatch'] = None
    if sc['duration'][1] != 'ep':
        sc['refit'] = False
    if isinstance(sc['duration'][0], float):  # a fraction of two epochs, in batches or samples
        steps = ref.epoch_steps(sc, 0)
        counted = [i for st in steps for s in st if s for i, _ in s]
        total = {'ba': len(steps), 'sp': len(counted), 'tok': ref.tokens_of(counted)}[sc['duration'][1]]
        sc['duration'] = [max(1, math.ceil(sc['duration'][0] * 2 * total)), sc['duration'][1]]
    if sc.get('resume_at') is not None:  # a fraction of the first fit's steps, made a step in [1, steps - 1]
        first = _first_fit_steps(sc)
        at = sc['resume_at']
        at = max(1, math.floor(at * first)) if isinstance(at, float) else at
        sc['resume_at'] = at if 1 <= at < first and sc['source'] not in ('over', 'under') else None
    if sc.get('resume_at') is not None and sc['model'] == 'branch':
        # stock too: a checkpoint saved before the head's first gradient holds no optimizer state for it (Adam's or
        # SGD's momentum), and loading it raises KeyError in torch.distributed.checkpoint's _split_optim_state_dict
        # on any world size, without UnevenJoin too (docs/limits.md; seed 403094): the checkpoint is taken once the
        # head has had one, or not at all
        used = _head_first_trained(sc)
        sc['resume_at'] = max(sc['resume_at'], used) if used is not None and used < _first_fit_steps(sc) else None
    if sc.get('resume_at') is None and sc.get('resume_world'):  # no resumption: no other world size to resume on
        sc['resume_world'] = None
        _per_rank_lists(sc, world)
    if sc.get('chain_world'):
        sc['chain_at'] = _chain_step(sc)
        if sc['chain_at'] is None:  # no chain: per-rank lists of the two runs' ranks
            sc['chain_world'] = None
            _per_rank_lists(sc, _ranks(sc))
    if sc.get('resume_world'):
        _per_rank_lists(sc, _ranks(sc))
        shards = sc.get('eval_shards')  # something to evaluate on every world size
        if shards is not None and any(sum(shards[:w]) == 0 for w in _worlds(sc)):
            shards[0] = 1
    if sc.get('raise_at') is not None:  # an event on every rank, at a step of the first fit, retried once
        event, at = sc['raise_at']
        first = _first_fit_steps(sc)
        at = min(math.floor(at * first), first - 1) if isinstance(at, float) else at
        # eval_start: only a passed evaluation's (a raise at the Trainer's own evaluation inside fit(), retried,
        # has stock Composer train the next steps on the eval loader: found by the stock validation)
        # epoch_start where UnevenJoin lifts Composer's length cap (an IterableDataset read by 2 workers may yield more
        # than its len()): the cap stays lifted, and Composer's retried fit() refuses a duration in epochs before any
        # event (docs/limits.md; seeds 301260, 301345)
        lifted = sc['source'] == 'len' and sc.get('workers', 0) > 1 and sc.get('mode', 'shadow') == 'shadow'
        # nor before a fit (eval_first): Composer's _eval_loop restores the train loader it backed up only when its
        # loop ends, so a passed eval() raised at EVAL_START leaves the eval loader as the trainer's, the retried one
        # backs that up, and the next fit() trains on it (seed 623337: stock Composer on even shards too)
        needs = {
            'eval_start': sc.get('eval') == 'passed' and not sc.get('eval_first'),
            'predict_start': sc.get('predict_shards') is not None,
            'epoch_start': not lifted,
        }
        ok = needs.get(event, True) and sc['source'] not in ('over', 'under')
        sc['raise_at'] = [
            event,
            at if event in ('epoch_start', 'batch_start', 'after_dataloader', 'before_forward') else 0,
        ]
        sc['raise_at'] = sc['raise_at'] if ok else None
    if sc.get('static_graph') and _step0_microbatches(sc) is None:  # a rank without a batch at step 0: not drawn
        sc['static_graph'] = False
    if sc.get('static_graph') and not _resumed_first_steps_alike(sc):
        # a resumed Trainer wraps a new DDP, whose first static-graph iteration is its first step: split differently
        # there, every rank of that launch stops with UnevenInputsError (by design, composer_join/wrappers/
        # static_graph.py); not predicted by the checker beyond the first launch, so not drawn (seed 762516)
        sc['static_graph'] = False
    if sc.get('oom') is not None:
        sc['oom'] = _oom_step(sc)
    if sc['model'] == 'bn' and _tiny_microbatch(sc):  # BatchNorm cannot train a microbatch of one sample
        sc['model'] = 'mlp'
    if sc.get('resume_world'):  # the second Trainer would train on the new world size: not drawn together
        sc['twin'] = False
    for k in [k for k, v in sc.items() if (v is None or v is False) and k != 'divide']:
        del sc[k]
    if sc.get('divide', True):
        sc.pop('divide', None)
    for k, default in (('workers', 0), ('fmt', 'tuple'), ('mode', 'shadow'), ('optimizer', 'sgd')):
        if sc.get(k) == default:
            del sc[k]
    return sc


def _ranks(sc: dict) -> int:
    """How many ranks the per-rank lists (shards, eval and predict shards) cover: every run's world sizes."""
    return max(_worlds(sc))


def _worlds(sc: dict) -> list[int]:
    """The world sizes of the scenario's runs: ``world``, then ``resume_world`` and ``chain_world`` if drawn."""
    return [sc['world']] + [sc[k] for k in ('resume_world', 'chain_world') if sc.get(k)]


def _second_fit_steps(sc: dict) -> int:
    """The steps of the first ``fit()`` resumed on ``resume_world`` (counted from the first launch's step 0): the
    run a chained resumption takes its checkpoint from."""
    return len(ref.planned_steps({**sc, 'refit': False, 'chain_world': None, 'chain_at': None}))


def _chain_step(sc: dict) -> Optional[int]:
    """``chain_at`` made a step of the resumed run's first fit after ``resume_at`` (a fraction: of the steps in
    ``[resume_at + 1, steps - 1]``), or None where no chain is drawn: no such step, or per-rank shard data resumed
    mid-epoch the first time (its second launch stops with ``UnevenInputsError``: nothing to resume again)."""
    at, first = sc.get('chain_at'), sc.get('resume_at')
    if at is None or first is None or not sc.get('resume_world'):
        return None
    if sc['source'] not in ('exact', 'torch') and ref.mid_epoch({**sc, 'chain_world': None}):
        return None
    second = _second_fit_steps(sc)
    if isinstance(at, float):
        at = first + 1 + math.floor(at * max(0, second - first - 1))
    return at if first < at < second else None


def _per_rank_lists(sc: dict, ranks: int) -> None:
    for key in ('shards', 'eval_shards', 'predict_shards'):
        if sc.get(key) is not None:
            sc[key] = (sc[key] + [0] * ranks)[:ranks]


def _first_fit_steps(sc: dict) -> int:
    """The steps of the first ``fit()`` on ``world`` ranks (the run a resumption takes its checkpoint from)."""
    return len(ref.planned_steps({**sc, 'refit': False, 'resume_world': None, 'resume_at': None}))


def _head_first_trained(sc: dict) -> Optional[int]:
    """The first ``resume_at`` whose checkpoint follows a step that trained a label-0 sample (the 'branch' model's
    head has had a gradient), or None: no step of the first ``fit()`` does."""
    steps = ref.planned_steps({**sc, 'refit': False, 'resume_world': None, 'resume_at': None})
    for t, (_, step) in enumerate(steps):
        if any(int(ref.sample(i)[1]) == 0 for part in step if part for i, _ in part):
            return t + 1
    return None


def _tiny_microbatch(sc: dict) -> bool:
    plans = [ref.planned_steps({**sc, 'refit': sc.get('refit')})]
    if sc.get('resume_world'):  # the first launch trains its whole first fit on the old world size
        plans.append(ref.planned_steps({**sc, 'refit': False, 'resume_world': None}))
    if sc.get('chain_world'):  # and the second its whole first fit from resume_at on
        plans.append(ref.planned_steps({**sc, 'refit': False, 'chain_world': None}))
    return any(
        len(part[k : k + ref.microbatch_at(sc, t)]) == 1
        for plan in plans
        for t, (_, step) in enumerate(plan)
        for part in step
        if part
        for k in range(0, len(part), ref.microbatch_at(sc, t))
    )


def _step0_microbatches(sc: dict) -> Optional[list[int]]:
    """Each rank's microbatch count at the first fit's step 0, or None if some rank has no batch there."""
    first = ref.planned_steps({**sc, 'refit': False, 'oom': None})
    if not first or not all(first[0][1]):
        return None
    mb = ref.microbatch_at({**sc, 'oom': None}, 0)
    return [math.ceil(len(part) / mb) for part in first[0][1] if part]


def _resumed_first_steps_alike(sc: dict) -> bool:
    """Whether the first step of every resumed Trainer on more than one rank (``resume_at`` on ``resume_world`` or
    ``world``; chained, ``chain_at`` on ``chain_world``) splits into the same number of microbatches on every rank,
    each rank having a batch."""
    if sc.get('resume_at') is None:
        return True
    firsts = [(sc['resume_at'], sc.get('resume_world') or sc['world'])]
    if sc.get('chain_world'):
        firsts.append((sc['chain_at'], sc['chain_world']))
    steps = ref.planned_steps({**sc, 'oom': None})
    for t, world in firsts:
        if world > 1 and t < len(steps):
            parts, mb = steps[t][1], ref.microbatch_at({**sc, 'oom': None}, t)  # (no OOM beside a resumption)
            if not all(parts) or len({math.ceil(len(p) / mb) for p in parts if p}) > 1:
                return False
    return True


def _oom_step(sc: dict) -> Optional[list]:
    """An out-of-memory error under automatic microbatching (``oom``: a fraction choosing the rank and step, and the
    point: forward, loss or backward) made ``[rank, step, point]``: a rank with a real batch at a step of the first
    fit, so that its model runs (a shadow microbatch under DDP runs none); None where not drawn: FSDP (Composer's
    FSDP OOM hooks patch FSDP for the whole process), a microbatch of one sample (Composer cannot halve it), a
    checkpoint, a raise or ``static_graph`` beside it."""
    if sc.get('wrapper') or sc.get('resume_at') is not None or sc.get('raise_at') or sc.get('static_graph'):
        return None
    if (sc.get('microbatch') or sc['batch']) < 2 or sc['source'] in ('over', 'under'):
        return None
    if len(sc['oom']) == 3:  # made already
        return sc['oom']
    fraction, point = sc['oom']
    first = ref.planned_steps({**sc, 'refit': False, 'oom': None})
    where = [(r, t) for t, (_, step) in enumerate(first) for r in range(sc['world']) if step[r]]
    if not where:
        return None
    rank, t = where[min(int(fraction * len(where)), len(where) - 1)]
    # docs/limits.md: an OOM inside a backward that syncs gradients hangs, as in stock Composer; it syncs unless the
    # strategy is single_auto_sync (the default without find_unused_parameters), the microbatch is not the batch's
    # last, and the step is not the fit's first (automatic microbatching syncs every microbatch there)
    single = sc.get('sync', None if not sc.get('find_unused') else 'multi') in (None, 'single_auto_sync')
    step = first[t][1][rank] or []
    if point == 'backward' and not (single and t >= 1 and len(step) > ref.microbatch_at({**sc, 'oom': None}, 0)):
        point = 'forward'
    if sc['model'] == 'sync':  # docs/limits.md: an OOM before a communicating forward's collectives (or in its
        point = 'loss'  # backward) leaves them unmatched, with or without UnevenJoin (seed 301162)
    return [rank, t, point]


def predicted_error(sc: dict) -> Optional[str]:
    """The error every rank must stop with, or None: a loader yielding fewer batches than its ``len()``, or more than
    the longest ``len()`` (docs/limits.md); rebalancing, any ``len()`` that miscounts (docs/rebalancing.md); DDP's
    ``static_graph`` where step 0 splits into different microbatch counts (docs/limits.md); every rank of the second
    run, resumed on another world size from a mid-epoch checkpoint of per-rank shard data (no global index space:
    docs/reliability.md, "On another number of ranks"; chained: the third run, from such a checkpoint of the
    second)."""
    if sc.get('resume_world') and sc['source'] not in ('exact', 'torch') and not sc.get('stock') and ref.mid_epoch(sc):
        return 'UnevenInputsError'
    if _step0_refused(sc):
        return 'UnevenInputsError'  # docs/limits.md: the static graph's first step must split alike everywhere
    if sc['source'] not in ('over', 'under'):
        return None
    b = sc['batch']
    actual = [math.ceil(n / b) for n in sc['shards']]
    claimed = [math.ceil(({'over': n + b, 'under': max(0, n - b)}[sc['source']]) / b) for n in sc['shards']]
    if any(a < c for a, c in zip(actual, claimed)) or max(actual) > max(claimed):
        return 'UnevenInputsError'
    if sc.get('mode') == 'rebalance' and actual != claimed:
        return 'UnevenInputsError'
    return None


def _step0_refused(sc: dict) -> bool:
    """DDP's ``static_graph`` where the first fit's step 0 splits into different microbatch counts: every rank stops
    there (docs/limits.md); resumed on another world size, in the first launch already (seed 701301: its second
    launch then has no checkpoint to load)."""
    return bool(sc.get('static_graph')) and len(set(_step0_microbatches(sc) or [0])) > 1


def known_failure(sc: dict) -> Optional[str]:
    """The known, not yet analysed failure (``tests/fuzz_regressions.json``) a scenario runs into, or None: the CI
    slice leaves such scenarios out (their regression entries are strict xfails), long runs report them apart. Each
    signature is coarse, wider than the failure, with its regression entry. None is known now: of the first ones, a
    raise retried around a resumption on another world size (seeds 400183..402027) and a BatchNorm model with the
    'drop' transform beside a rank without data (seed 330025) were the package's (fixed), the 'drop' transform's
    counts after such a resumption (seed 401498) the checker's (fixed), a checkpoint before a head's first gradient
    (seed 403094) stock torch's (no longer drawn)."""
    return None


# ----------------------------------------------------------------------------------------------- the checker
def check(
    sc: dict, per_rank: list[Any], before: Optional[list[Any]] = None, middle: Optional[list[Any]] = None
) -> list[str]:
    """What is wrong with the ranks' results for ``sc`` (empty: it passed). Resumed on another world size:
    ``per_rank`` is the last launch's (``resume_world`` ranks, or chained ``chain_world``), ``before`` the first's
    (``world`` ranks: the steps before ``resume_at`` are theirs), ``middle`` a chain's second (``resume_world``
    ranks: the steps from ``resume_at`` to before ``chain_at``)."""
    from harness import RankError

    problems: list[str] = []
    if before is not None and _step0_refused(sc):  # the first launch stops at step 0, as predicted: nothing to resume
        errors = [None if isinstance(res, RankError) else res['error'] for res in before]
        if any(e is None or e[0] != 'UnevenInputsError' for e in errors):
            problems.append(f'expected every rank of the first launch to raise UnevenInputsError; got {errors}'[:800])
        return problems
    for which, runs, ranks in (('first', before, sc['world']), ('second', middle, sc.get('resume_world'))):
        for rank, res in enumerate(runs or []):
            if isinstance(res, RankError) or res['error'] is not None:
                why = res if isinstance(res, RankError) else f'{res["error"][0]}: {res["error"][1][:400]}'
                return [f'the {which} launch ({ranks} ranks, saving) failed on rank {rank}: {why}'[:500]]
    for rank, res in enumerate(per_rank):
        if isinstance(res, RankError):
            return [f'rank {rank} failed outside the run: {res}'[:500]]
    errors = [res['error'] for res in per_rank]
    expected = predicted_error(sc)
    if expected is not None:
        if any(e is None or e[0] != expected for e in errors):
            problems.append(f'expected every rank to raise {expected}; got {errors}'[:800])
        return problems
    if any(errors):  # (where: the traceback's last frame)
        where = [_last_frame(res.get('traceback', '')) for res in per_rank]
        return [f'rank {r} raised {e[0]}: {e[1][:400]} (at {where[r]})' for r, e in enumerate(errors) if e]
    want = ref.train(sc)
    names = list(want['params'])
    noise: Optional[float] = None
    for rank, res in enumerate(per_rank):
        params = {k: res['state'][k] for k in names}
        diff = ref.max_abs_diff(params, want['params'])
        if not diff < TOL:  # past TOL: within NOISE times the reference's own float32 noise passes (ref.float_noise)
            noise = ref.float_noise(sc, want['params']) if noise is None else noise
            if not diff < NOISE * noise:
                problems.append(f'rank {rank} is {diff:.2e} from the reference (its own float32 noise {noise:.1e})')
        keys = names if sc.get('stock') else list(res['state'])  # stock Composer leaves BatchNorm buffers per rank
        if any(not torch.equal(res['state'][k], per_rank[0]['state'][k]) for k in keys):
            problems.append(f'rank {rank} holds another state than rank 0')
        if (res['batch'], res['sample'], res['token']) != (len(want['steps']), want['samples'], want['tokens']):
            problems.append(
                f'rank {rank}: timestamp {res["batch"]} batches, {res["sample"]} samples, {res["token"]} tokens; '
                f'reference {len(want["steps"])}, {want["samples"]}, {want["tokens"]}'
            )
    recorded = [res['steps'] for res in per_rank]
    if before is not None:  # the steps before the resumption are the first launch's (chained: then the second's)
        at, last = sc['resume_at'], sc.get('chain_at') if middle is not None else None
        recorded = [{t: v for t, v in res['steps'].items() if t >= (last or at)} for res in per_rank]
        recorded += [{t: v for t, v in res['steps'].items() if t < at} for res in before]
        recorded += [{t: v for t, v in res['steps'].items() if at <= t < last} for res in middle or []]
    got_steps = max((max(steps, default=-1) for steps in recorded), default=-1) + 1
    for t in range(max(got_steps, len(want['steps']))):
        got = sorted(i for steps in recorded for i in steps.get(t, []))
        exp = sorted(i for part in (want['steps'][t] if t < len(want['steps']) else []) for i in part)
        if got != exp:
            problems.append(f'step {t} trained ids {got}, reference {exp}')
            break
    if sc['duration'][1] == 'ep':  # the reference itself: every full epoch loads every id once as its data holds it
        for epoch in range(sc['duration'][0] + (1 if sc.get('refit') else 0)):  # and trains what the transform leaves
            loaded, trained = want['loaded'].get(epoch, {}), want['trained'].get(epoch, {})
            if loaded != ref.expected_loaded(sc, epoch):
                problems.append(f'epoch {epoch}: reference loads {loaded}')
            if ref.regrouped(sc, epoch):  # the rest batched anew: 'drop' leaves other samples than the old batches
                if any(n > loaded.get(i, 0) for i, n in trained.items()):
                    problems.append(f'epoch {epoch}: reference trains {trained}, more than it loads {loaded}')
            elif trained != ref.expected_counts(sc, epoch):
                problems.append(f'epoch {epoch}: reference trains {trained}')
    problems += _check_twin(sc, per_rank) + _check_eval(sc, per_rank) + _check_predict(sc, per_rank)
    return problems + _check_eval_first(sc, per_rank, before)


def _last_frame(traceback: str) -> str:
    frames = [line.strip() for line in traceback.splitlines() if line.strip().startswith('File ')]
    return frames[-1] if frames else '?'


def _check_twin(sc: dict, per_rank: list[dict]) -> list[str]:
    """The second Trainer with the same ``UnevenJoin`` (``twin``) trained the first fit as a fresh one would."""
    if not sc.get('twin'):
        return []
    alone = {k: v for k, v in sc.items() if k not in ('refit', 'resume_at', 'oom')}  # (no OOM: its own)
    want = ref.train(alone)
    problems = []
    for rank, res in enumerate(per_rank):
        diff = ref.max_abs_diff({k: res['twin'][k] for k in want['params']}, want['params'])
        if not diff < TOL and not diff < NOISE * ref.float_noise(alone, want['params']):  # (seed 680003)
            problems.append(f'twin: rank {rank} is {diff:.2e} from the reference')
        if res['twin_time'] != [len(want['steps']), want['samples']]:
            problems.append(
                f'twin: rank {rank} timestamp {res["twin_time"]}, reference {len(want["steps"])}, {want["samples"]}'
            )
    return problems


def _check_eval(sc: dict, per_rank: list[dict]) -> list[str]:
    problems: list[str] = []
    labels = {'own': ['eval_own'], 'passed': ['eval_passed'], 'both': ['eval_own', 'eval_passed']}
    for label in labels.get(sc.get('eval') or '', []):
        want = ref.evaluate(per_rank[0]['state'], sc)
        ids = sorted(i for r in range(ref.final_world(sc)) for i in ref.eval_ids(sc, r))
        for rank, res in enumerate(per_rank):
            problems += _compare_eval(label, rank, res.get(label), want, ids)
    return problems


def _compare_eval(label: str, rank: int, got: Optional[dict], want: dict, ids: list[int]) -> list[str]:
    """One rank's evaluation metrics against the reference's over the union (every eval id exactly once)."""
    if got is None:
        return [f'{label}: rank {rank} has no result']
    problems = []
    if got['ids'] != ids:
        problems.append(f'{label}: rank {rank} evaluated ids {got["ids"]}, expected {ids}')
    if not (abs(got['accuracy'] - want['accuracy']) <= 1e-6 and abs(got['loss'] - want['loss']) <= 1e-5):
        problems.append(f'{label}: rank {rank} got {got["accuracy"]}, {got["loss"]}; reference {want}')
    return problems


def _check_eval_first(sc: dict, per_rank: list[dict], before: Optional[list[dict]]) -> list[str]:
    """The evaluations before the first ``fit()`` (``eval_first``): with the initial weights over every rank's eval
    shard of ``world`` (resumed on another world size: the first launch's); resumed on another world size, also the
    second launch's (chained: the third's), its first call, with the checkpoint's weights (the reference's
    parameters after ``resume_at`` steps, chained ``chain_at``; buffers, which the reference does not follow, rank
    0's) over that launch's ranks' eval shards."""
    if not sc.get('eval_first'):
        return []
    calls, kind = sc['eval_first']
    kinds = ['own', 'passed'] if kind == 'both' else [kind]
    runs = [('eval_first', before or per_rank, ref.initial_state(sc), sc['world'])]
    problems: list[str] = []
    if before is not None:
        loaded_at = sc.get('chain_at') if sc.get('chain_world') else sc['resume_at']  # chained: the third launch's
        want = ref.train(sc, upto=loaded_at)['params']
        for rank, res in enumerate(per_rank):
            state = res.get('eval_first_state')
            if state is None:
                problems.append(f'eval_first resumed: rank {rank} has no state')
                continue
            diff = ref.max_abs_diff({k: state[k] for k in want}, want)
            if not diff < TOL and not diff < NOISE * ref.float_noise(sc, want, upto=loaded_at):
                problems.append(f'eval_first resumed: rank {rank} loaded a state {diff:.2e} from the reference')
            if any(not torch.equal(state[k], per_rank[0]['eval_first_state'][k]) for k in state):
                problems.append(f'eval_first resumed: rank {rank} loaded another state than rank 0')
        if problems:
            return problems
        runs.append(('eval_first resumed', per_rank, per_rank[0]['eval_first_state'], ref.final_world(sc)))
    for tag, results, state, world in runs:
        want_metrics = ref.evaluate(state, sc, world)
        ids = sorted(i for r in range(world) for i in ref.eval_ids(sc, r))
        for rank, res in enumerate(results):
            got = res.get('eval_first') or []
            if len(got) != calls:
                problems.append(f'{tag}: rank {rank} made {len(got)} calls, not {calls}')
                continue
            for c, by_kind in enumerate(got):
                for k in kinds:
                    problems += _compare_eval(f'{tag} call {c} {k}', rank, by_kind.get(k), want_metrics, ids)
    return problems


def _check_predict(sc: dict, per_rank: list[dict]) -> list[str]:
    if sc.get('predict_shards') is None:
        return []
    problems = []
    for rank, res in enumerate(per_rank):
        ids = [1000 * (70 + rank) + i for i in range(sc['predict_shards'][rank])]
        want, _ = ref.outputs(per_rank[0]['state'], sc, ids)
        got = res.get('predictions')
        if got is None or got.shape != want.shape or not torch.allclose(got, want, atol=1e-5):
            shape = None if got is None else tuple(got.shape)
            problems.append(f'predict: rank {rank} returned {shape}, expected {tuple(want.shape)}')
    return problems


# ----------------------------------------------------------------------------------------------- running
sc_times: list[tuple[float, Any]] = []  # (seconds on the slowest rank, seed) of every scenario run in this process


def run_launch(world: int, scs: list[dict]) -> list[list[str]]:
    """Run ``scs`` (all of world size ``world``) in one launch; per scenario, its problems."""
    from harness import launch

    calls = [(f's{i}', 'fuzz_rank:run', {'sc': sc}) for i, sc in enumerate(scs)]
    try:
        results = launch(world, calls, timeout=90 + 30 * len(scs), collective_timeout=30)
    except AssertionError as e:  # a rank died or the launch hung: every scenario of it is suspect
        return [[f'launch failed: {str(e)[-1500:]}'] for _ in scs]
    out = []
    for i, sc in enumerate(scs):
        seconds = [r.get('seconds', 0.0) for r in results[f's{i}'] if isinstance(r, dict)]
        sc_times.append((max(seconds, default=0.0), sc.get('seed', i)))
        try:
            out.append(check(sc, results[f's{i}']))
        except Exception as e:  # a checker crash is a failure to look at
            out.append([f'checker raised {type(e).__name__}: {e}'])
    return out


def run_resumed(worlds: tuple[int, ...], scs: list[dict]) -> list[list[str]]:
    """Run ``scs`` resumed on other world sizes: ``worlds`` are the launches' (``world``, ``resume_world``, and chained
    ``chain_world``), every scenario of ``scs`` the same. The first launch fits on ``worlds[0]`` ranks saving after
    every batch into a folder of each scenario's own; a chain's middle launch loads its checkpoint after
    ``resume_at`` and fits on, saving after every batch into a second folder; the last launch loads the checkpoint
    before it (after ``resume_at``, chained ``chain_at``) and lives the rest of the scenario. The folders are made
    here and removed after the last launch. Per scenario, its problems (a failed launch fails them all)."""
    import shutil
    import tempfile

    from harness import launch

    tag = 'fuzz47-' + 'to'.join(map(str, worlds)) + '-'
    folders = [[tempfile.mkdtemp(prefix=tag) for _ in scs] for _ in worlds[:-1]]  # per saving launch
    saving = ['fuzz_rank:save_first_fit', 'fuzz_rank:save_resumed_fit']
    results: list[dict[str, list[Any]]] = []
    try:
        timeout = 90 + 30 * len(scs)
        for n, world in enumerate(worlds):
            if n == len(worlds) - 1:
                calls = [(f's{i}', 'fuzz_rank:run', {'sc': sc, 'folder': folders[-1][i]}) for i, sc in enumerate(scs)]
            elif n == 0:
                calls = [(f's{i}', saving[0], {'sc': sc, 'folder': folders[0][i]}) for i, sc in enumerate(scs)]
            else:
                calls = [
                    (f's{i}', saving[1], {'sc': sc, 'folder': folders[n - 1][i], 'save_folder': folders[n][i]})
                    for i, sc in enumerate(scs)
                ]
            try:
                results.append(launch(world, calls, timeout=timeout, collective_timeout=30))
            except AssertionError as e:
                role = 'saving' if n < len(worlds) - 1 else 'the rest of the scenario'
                return [
                    [f'launch {n + 1} of {len(worlds)} ({world} ranks, {role}) failed: {str(e)[-1500:]}'] for _ in scs
                ]
    finally:
        for folder in (f for per_launch in folders for f in per_launch):
            shutil.rmtree(folder, ignore_errors=True)
    out = []
    for i, sc in enumerate(scs):
        earlier = {'before': results[0][f's{i}']}
        if len(worlds) == 3:
            earlier['middle'] = results[1][f's{i}']
        try:
            out.append(check(sc, results[-1][f's{i}'], **earlier))
        except Exception as e:  # a checker crash is a failure to look at
            out.append([f'checker raised {type(e).__name__}: {e}'])
    return out


def launch_key(sc: dict) -> tuple[int, int, int]:
    """Scenarios with the same key share launches: the world size, the one resumed on (0: none) and the one
    resumed on again (chained; 0: none)."""
    return sc['world'], sc.get('resume_world') or 0, sc.get('chain_world') or 0


def _run_group(key: tuple[int, int, int], scs: list[dict]) -> list[list[str]]:
    worlds = tuple(w for w in key if w)
    return run_resumed(worlds, scs) if len(worlds) > 1 else run_launch(key[0], scs)


def run_many(scs: list[dict], chunk: int = CHUNK, confirm: bool = True, log=None) -> list[list[str]]:
    """Problems per scenario; scenarios of a :func:`launch_key` share launches of ``chunk`` (resumed on another world
    size: two or three launches, :func:`run_resumed`). A scenario that failed in a shared launch is run again alone
    (``confirm``): a hang poisons the scenarios after it. ``log``: a line per launch."""
    problems: list[list[str]] = [[] for _ in scs]
    for key in sorted({launch_key(sc) for sc in scs}):
        idx = [i for i, sc in enumerate(scs) if launch_key(sc) == key]
        for k in range(0, len(idx), chunk):
            part, started = idx[k : k + chunk], time.monotonic()
            for i, p in zip(part, _run_group(key, [scs[i] for i in part])):
                problems[i] = p
            if log is not None:
                failed = [scs[i].get('seed', i) for i in part if problems[i]]
                where = f'{key[0]} ranks' + (f', resumed on {key[1]}' if key[1] else '')
                where += f', then on {key[2]}' if key[2] else ''
                slow = ', '.join(
                    f'{seed}: {t:.1f} s' for t, seed in sorted(sc_times[-len(part) :], key=lambda x: -x[0])[:3]
                )
                log(
                    f'  {len(part)} scenarios on {where} in {time.monotonic() - started:.0f} s (slowest {slow}); failed: {failed}'
                )
    if confirm:
        for i, sc in enumerate(scs):
            if problems[i] and sum(1 for sc2 in scs if launch_key(sc2) == launch_key(sc)) > 1:
                problems[i] = _run_group(launch_key(sc), [sc])[0]
                if log is not None:
                    log(f'  alone: {sc.get("seed", i)} {"fails" if problems[i] else "passes"}')
    return problems


# ----------------------------------------------------------------------------------------------- the shrinker
def simplifications(sc: dict) -> list[dict]:
    """Smaller scenarios than ``sc``: one feature dropped, a shard shrunk, a rank dropped (each normalized)."""
    out = []
    defaults: dict[str, Any] = {
        'transform': None,
        'mb_transform': None,
        'clip': None,
        'find_unused': None,
        'static_graph': None,
        'refit': None,
        'eval': None,
        'eval_first': None,
        'predict_shards': None,
        'chain_world': None,
        'chain_at': None,
        'resume_world': None,
        'resume_at': None,
        'raise_at': None,
        'twin': None,
        'oom': None,
        'wrapper': None,
        'workers': None,
        'fmt': None,
        'microbatch': None,
        'sync': None,
        'ckpt': None,
        'model': 'mlp',
        'optimizer': None,
        'mode': None,
        'divide': None,
        'shuffle': None,
        'eval_microbatch': None,
        'source': 'len',
    }
    for key, value in defaults.items():
        if sc.get(key) is not None and sc.get(key) != value:
            cand = {k: v for k, v in sc.items() if k != key}
            if value is not None:
                cand[key] = value
            if key == 'source' and 'shards' not in cand:
                cand['shards'] = [len(ref.rank_ids(sc, r, 0)) for r in range(sc['world'])]
            out.append(cand)
    if sc.get('eval_first'):  # one call; one kind of loader
        calls, kind = sc['eval_first']
        if calls > 1:
            out.append({**sc, 'eval_first': [1, kind]})
        if kind == 'both':
            out += [{**sc, 'eval_first': [calls, 'own']}, {**sc, 'eval_first': [calls, 'passed']}]
    if sc['duration'] != [1, 'ep']:
        out.append({**sc, 'duration': [1, 'ep']})
        if sc['duration'][1] != 'ep' and sc['duration'][0] > 1:
            out.append({**sc, 'duration': [sc['duration'][0] - 1, sc['duration'][1]]})
    for key in ('shards', 'eval_shards', 'predict_shards'):
        for r, n in enumerate(sc.get(key) or []):
            for smaller in sorted({0, n // 2, n - 1}):
                if 0 <= smaller < n:
                    out.append({**sc, key: [smaller if q == r else m for q, m in enumerate(sc[key])]})
    if sc['world'] == 3:
        for r in range(3):
            cand = {**sc, 'world': 2}
            for key in ('shards', 'eval_shards', 'predict_shards'):
                if sc.get(key) is not None:
                    cand[key] = [m for q, m in enumerate(sc[key]) if q != r]
            out.append(cand)
    for w in range(1, sc.get('resume_world') or 1):  # resumed on fewer ranks
        if w != sc['world']:
            out.append({**sc, 'resume_world': w})
    for w in range(1, sc.get('chain_world') or 1):  # resumed again on fewer ranks
        if w != sc['resume_world']:
            out.append({**sc, 'chain_world': w})
    if sc.get('map_size', 0) > 1:
        out.append({**sc, 'map_size': sc['map_size'] - 1})
    if sc['batch'] > 1:
        out.append({**sc, 'batch': sc['batch'] - 1})
    result, seen = [], {json.dumps(sc, sort_keys=True)}
    for cand in out:
        try:
            cand = normalize(cand)
        except Exception:  # a simplification that makes no scenario is skipped
            continue
        key = json.dumps(cand, sort_keys=True)
        if key not in seen and _valid(cand):
            seen.add(key)
            result.append(cand)
    return result


def _valid(sc: dict) -> bool:
    return (sc.get('shards') is None or sum(sc['shards']) > 0) and (
        sc.get('eval_shards') is None or sum(sc['eval_shards']) > 0
    )


def shrink(sc: dict, fails: Optional[Callable[[list[dict]], list[bool]]] = None, rounds: int = 30, log=print) -> dict:
    """The smallest failing scenario found by dropping features one at a time while it still fails. ``fails`` runs
    candidates (default: on real ranks, all candidates of a round in one launch per world size, the one kept
    confirmed alone)."""
    fails = fails or (lambda cands: [bool(p) for p in run_many(cands, chunk=len(cands) or 1, confirm=False)])
    for _ in range(rounds):
        cands = simplifications(sc)
        if not cands:
            break
        failing = [c for c, f in zip(cands, fails(cands)) if f]
        merged = _merge(sc, failing) if len(failing) > 1 else None
        if merged is not None and fails([merged])[0]:  # every failing simplification at once: a big step
            sc = merged
        else:
            kept = next((c for c in failing if fails([c])[0]), None)  # else the first that fails alone
            if kept is None:
                break
            sc = kept
        log(f'  still fails: {json.dumps(sc)}', flush=True)
    return sc


def _merge(sc: dict, cands: list[dict]) -> Optional[dict]:
    """``sc`` with the changes of every one of ``cands`` applied (normalized), or None if that makes no scenario."""
    out = dict(sc)
    for cand in cands:
        for key in set(sc) | set(cand):
            if cand.get(key) != sc.get(key):
                if key in cand:
                    out[key] = cand[key]
                else:
                    out.pop(key, None)
    if out.get('world') == 2:  # a dropped rank: per-rank lists of two (or of the world size resumed on)
        for key in ('shards', 'eval_shards', 'predict_shards'):
            if out.get(key) is not None:
                out[key] = out[key][: _ranks(out)]
    try:
        out = normalize(out)
    except Exception:  # changes that make no scenario together
        return None
    return out if _valid(out) and out != sc else None


# ----------------------------------------------------------------------------------------------- the command line
def reproduce(sc: dict) -> str:
    if sc.get('seed') is not None and draw(sc['seed']) == sc:
        return f'{COMMAND} --seed {sc["seed"]}'
    return f"{COMMAND} --scenario '{json.dumps(sc)}'"


def elastic_seeds(seed: int, n: int, only: Optional[dict[str, Any]] = None) -> list[int]:
    """The first ``n`` seeds from ``seed`` on whose scenarios resume on another world size (and have every value of
    ``only``)."""
    return chosen_seeds(seed, n, {**(only or {}), 'resume_world': ANY})


ANY = object()  # in ``only``: any value but None


def chosen_seeds(seed: int, n: int, only: dict[str, Any]) -> list[int]:
    """The first ``n`` seeds from ``seed`` on whose drawn scenarios have every value of ``only``."""
    out, s = [], seed
    while len(out) < n:
        sc = draw(s)
        if all(sc.get(k) is not None if v is ANY else sc.get(k) == v for k, v in only.items()):
            out.append(s)
        s += 1
    return out


def _only(pairs: list[str]) -> dict[str, Any]:
    """``--only KEY=VALUE`` pairs: VALUE as JSON if it parses, else a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition('=')
        if value == '*':  # any value but None
            out[key] = ANY
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def fuzz(
    seed: int,
    n: int,
    do_shrink: bool = True,
    log=print,
    elastic: bool = False,
    only: Optional[dict] = None,
    chain: bool = False,
) -> list[dict]:
    """Seeds ``seed .. seed + n - 1`` (``elastic``: the first ``n`` from ``seed`` whose scenarios resume on another
    world size; ``chain``: whose scenarios resume twice; ``only``: the first ``n`` whose scenarios have these
    values); the failures (each with its problems and, shrunk, its smallest form)."""
    chosen = {**(only or {}), **({'resume_world': ANY} if elastic else {}), **({'chain_world': ANY} if chain else {})}
    seeds = chosen_seeds(seed, n, chosen) if chosen else list(range(seed, seed + n))
    if chosen:
        log(f'seeds: {seeds}', flush=True)
    scs = [draw(s) for s in seeds]
    started = time.monotonic()
    problems = run_many(scs, log=lambda line: log(line, flush=True))
    failures = []
    for sc, p in zip(scs, problems):
        if p and known_failure(sc):
            log(f'known failure {known_failure(sc)}: seed {sc["seed"]}')
        elif p:
            log(f'FAILED seed {sc["seed"]}: {p[:3]}\n  reproduce: {reproduce(sc)}')
            failure = {'scenario': sc, 'problems': p}
            if do_shrink:
                failure['shrunk'] = shrink(sc, log=log)
                log(f'  smallest: {reproduce(failure["shrunk"])}')
            failures.append(failure)
    known = sum(1 for sc, p in zip(scs, problems) if p and known_failure(sc))
    log(
        f'{n} scenarios from seed {seed}: {n - len(failures) - known} passed, {known} known failures, '
        f'{len(failures)} new failures '
        f'({time.monotonic() - started:.0f} s)'
    )
    return failures


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--seed', type=int, default=None, help='first seed (default: from the clock)')
    parser.add_argument('--n', type=int, default=1, help='number of seeds')
    parser.add_argument('--scenario', help='one scenario as JSON instead of seeds')
    parser.add_argument('--no-shrink', action='store_true')
    parser.add_argument('--show', action='store_true', help='print the drawn scenarios, run nothing')
    parser.add_argument(
        '--elastic', action='store_true', help='only scenarios resumed on another world size (the first N from SEED)'
    )
    parser.add_argument(
        '--chain', action='store_true', help='only scenarios resumed twice, 2 -> 3 -> 2 say (the first N from SEED)'
    )
    parser.add_argument(
        '--only',
        action='append',
        default=[],
        metavar='KEY=VALUE',
        help='only scenarios whose drawn KEY is VALUE (JSON, else a string; *: any but None; repeatable), e.g. '
        'transform=drop, eval_first=*',
    )
    args = parser.parse_args(argv)
    if args.scenario:
        sc = normalize(json.loads(args.scenario))
        print(json.dumps(sc), flush=True)
        problems = run_many([sc])[0]
        print('\n'.join(problems) or 'passed', flush=True)
        if problems and not args.no_shrink:
            print(f'smallest: {reproduce(shrink(sc))}')
        return 1 if problems else 0
    seed = args.seed if args.seed is not None else int(time.time()) % 10**6
    flag = (' --elastic' if args.elastic else '') + (' --chain' if args.chain else '')
    flag += ''.join(f' --only {pair}' for pair in args.only)
    only = _only(args.only)
    print(f'seed {seed} (reproduce this run: {COMMAND} --seed {seed} --n {args.n}{flag})', flush=True)
    if args.show:
        chosen = {
            **only,
            **({'resume_world': ANY} if args.elastic else {}),
            **({'chain_world': ANY} if args.chain else {}),
        }
        for s in chosen_seeds(seed, args.n, chosen) if chosen else range(seed, seed + args.n):
            print(json.dumps(draw(s)))
        return 0
    failures = fuzz(seed, args.n, do_shrink=not args.no_shrink, elastic=args.elastic, only=only, chain=args.chain)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
