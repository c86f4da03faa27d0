"""The scenario fuzzer's independent reference: what a drawn scenario should train, in one process, plain torch.

No ``composer_join`` and no Composer here (``tests/test_scenario_fuzz.py`` checks the imports): the rank side
(``tests/fuzz_rank.py``) builds its data and models from this module, and this module replays what the scenario
means, written from the documented semantics (docs/what-it-computes.md, docs/rebalancing.md):

* every sample has an id, and an id alone gives its features and label (:func:`sample`): id ``1000 * g + i`` is
  sample ``i`` of the fixed pool ``g`` (train shards: ``g = rank``; a map-style dataset: ``g = 7``; eval shards
  ``50 + rank``; predict shards ``70 + rank``);
* each rank's loader yields, per epoch, its ids in order (a shard; or torch's ``DistributedSampler`` shard, or an
  exact strided shard of a permutation seeded ``seed + epoch``), cut into batches, then ``batch_transforms``;
* step ``t`` of an epoch: in ``mode='shadow'`` rank ``r`` trains its ``t``-th batch if it has one; in
  ``mode='rebalance'`` the schedule of docs/rebalancing.md (own batches first, then donations from the rank with
  most left, ties to the lowest rank, receivers in rank order);
* the gradient of a step is the mean of the per-sample losses over its ``S_t`` real samples, times ``A_t / W``
  (``divide``) or 1, each microbatch (:func:`microbatch_at`: halved from an out-of-memory error's step on, as
  automatic microbatching does) run on its own; gradient clipping (by norm) is applied to that gradient; then the optimizer steps;
* durations in epochs, batches (steps), samples or tokens (real ones: the run ends after the step that reaches
  them; sample ``i`` has ``1 + i % 3`` tokens, a 'views' copy as many again: :func:`tokens_of`); a second ``fit``
  trains one more epoch;
* resumed on another world size (``resume_world``, docs/reliability.md "Elastic resumption"): the steps before
  ``resume_at`` on ``world`` ranks; the rest of that epoch (map-style data) is every sample no old rank had used
  (old rank 0's unused tail of its shard, then old rank 1's, ...; used as the loader yielded them, before the
  batch transform), new rank ``q`` of ``W'`` taking every ``W'``-th from the ``q``-th, in batches of the loader's
  batch size, then the batch transform (on the new batches: 'drop' drops their last samples, not the old
  batches'), scheduled by the mode on ``W'`` ranks (a checkpoint of an epoch's last batch leaves nothing); later
  epochs (and a second ``fit``) shard for ``W'``; each step's gradient is times ``A_t / W_t`` with the world size
  that trains it;
* a chained resumption (``chain_world``, ``chain_at``: the resumed run's checkpoint resumed again on ``W''``): the
  same rule on what the second run's ranks had not used of their shares (inside the rest of an interrupted epoch:
  its shares of that rest, each new rank's used prefix dropped, concatenated in rank order, dealt every ``W''``-th;
  :func:`epoch_batches`), then ``W''``'s epochs.

BatchNorm normalises each rank's microbatch by itself: the reference runs every microbatch's forward on its own,
so trained parameters do not depend on running statistics (those are left to the ranks: evaluation is checked with
rank 0's final state). The ``sync`` model's :class:`SyncNorm` communicates in its forward (``shadow_forward``,
docs/shadow-steps.md): its microbatch ``k`` is normalised over the union of every rank's ``k``-th real microbatch of
the step, and the gradient flows through those statistics to every rank's samples; the reference runs that union as
one forward.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.data import DistributedSampler

FEATURES, CLASSES, POOL, VOCAB = 6, 3, 200, 32
SAMPLER_SEED = 3
CLIP = 0.5
Sample = tuple[int, int]  # (id, view): view 1 is the mirrored copy the 'views' transform adds


def pool(group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool ``group``'s features (float64) and labels."""
    g = torch.Generator().manual_seed(100 + group)
    return torch.randn(POOL, FEATURES, generator=g, dtype=torch.float64), torch.randint(
        0, CLASSES, (POOL,), generator=g
    )


_POOLS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    if i // 1000 not in _POOLS:
        _POOLS[i // 1000] = pool(i // 1000)
    x, y = _POOLS[i // 1000]
    return x[i % 1000], y[i % 1000]


def tensors(samples: list[Sample], sc: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (float32, mirrored for view 1, halved by the microbatch transform) and labels of ``samples``."""
    if not samples:
        return torch.zeros(0, FEATURES), torch.zeros(0, dtype=torch.long)
    x = torch.stack([sample(i)[0] for i, _ in samples]).float()
    views = torch.tensor([v for _, v in samples], dtype=torch.bool)
    x = torch.where(views[:, None], x.flip(-1), x)
    if sc.get('mb_transform'):
        x = x * 0.5
    return x, torch.stack([sample(i)[1] for i, _ in samples])


# ----------------------------------------------------------------------------------------------- models
class SyncNorm(torch.nn.Module):
    """Batch normalisation whose training statistics (sum, sum of squares, count) are all-reduced across ranks with
    a differentiable all-reduce when ``distributed`` (``shadow_forward = True``: a shadowing rank runs it on zero
    samples, which add nothing); running statistics (momentum 0.1) normalise in eval mode, without communicating.
    The statistics are summed in float64 and ``eps`` is large (0.1), so that the ranks' order of summation (not the
    reference's) stays float noise: with 1e-3, two-sample microbatches put stock Composer on even shards 2.6e-6 from
    the reference."""

    shadow_forward = True

    def __init__(self, channels: int, distributed: bool, eps: float = 0.1):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))
        self.register_buffer('running_mean', torch.zeros(channels))
        self.register_buffer('running_var', torch.ones(channels))
        self.distributed, self.eps = distributed, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            mean, var = self.running_mean, self.running_var
        else:
            x64 = x.double()  # the statistics in float64: the ranks' sum order is not the reference's
            stats = torch.cat([x64.sum(0), (x64 * x64).sum(0), x64.new_full((1,), float(len(x)))])
            if self.distributed:
                from torch.distributed.nn.functional import all_reduce

                stats = all_reduce(stats)
            c = len(self.weight)
            n = stats[2 * c]
            mean = stats[:c] / n
            var = stats[c : 2 * c] / n - mean * mean
            mean, var = mean.to(x.dtype), var.to(x.dtype)  # (float32 but in the float-noise estimate)
            if n > 0:
                with torch.no_grad():
                    self.running_mean.lerp_(mean.detach(), 0.1)
                    self.running_var.lerp_(var.detach(), 0.1)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Net(torch.nn.Module):
    """Every drawn model: ``forward(x, y)``. ``kind``: mlp, branch (a head only label-0 samples use), bn, sync
    (:class:`SyncNorm`),
    deep (``ckpt``: None, 'reentrant', 'non_reentrant' activation checkpointing of its block), frozen (the first
    layer does not train), sparse (an ``nn.Embedding(sparse=True)`` bag over tokens computed from the features)."""

    def __init__(self, kind: str, ckpt: Optional[str] = None, distributed: bool = False):
        super().__init__()
        self.kind, self.ckpt = kind, ckpt
        if kind == 'sparse':
            self.emb = torch.nn.Embedding(VOCAB, CLASSES, sparse=True)
            return
        # no bias before BatchNorm: its true gradient is 0, and Adam would turn float noise there into steps of lr
        self.inp = torch.nn.Linear(FEATURES, 8, bias=kind not in ('bn', 'sync'))
        # eps 0.1 as SyncNorm's: with BatchNorm1d's 1e-5, a two-sample microbatch (a 'views' batch of 3 split 4 + 2)
        # turns the ranks' float noise into 2.0e-6 from the reference, stock Composer on even shards too (seed 642866)
        norms = {'bn': lambda: torch.nn.BatchNorm1d(8, eps=0.1), 'sync': lambda: SyncNorm(8, distributed)}
        self.norm = norms.get(kind, torch.nn.Identity)()
        if kind == 'deep':
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        self.out = torch.nn.Linear(8, CLASSES)
        if kind == 'branch':
            self.extra = torch.nn.Linear(FEATURES, CLASSES)
        if kind == 'frozen':
            self.inp.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == 'sparse':
            tokens = ((x[:, :3].clamp(-1.99, 1.99) + 2) * VOCAB / 4).long()
            return self.emb(tokens).sum(1)
        h = torch.tanh(self.norm(self.inp(x)))
        if self.kind == 'deep':
            if self.ckpt is None:
                h = self.block(h)
            else:
                h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.ckpt == 'reentrant')
            h = torch.tanh(h)
        out = self.out(h)
        if self.kind == 'branch':
            chosen = (y == 0).nonzero().flatten()
            if len(chosen):
                out = out.index_add(0, chosen, self.extra(x[chosen]))
        return out


def make_model(sc: dict, distributed: bool = False) -> Net:
    """The scenario's model, the same initial weights every time; ``distributed``: the ranks' copy (a ``sync``
    model's statistics are all-reduced across ranks there; the reference's one process sees the union itself)."""
    torch.manual_seed(0)
    return Net(sc.get('model', 'mlp'), sc.get('ckpt'), distributed)


def make_optimizer(sc: dict, params) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    name = sc.get('optimizer', 'sgd')
    if name == 'adam':
        return torch.optim.Adam(params, lr=0.01)
    if name == 'sparseadam':
        return torch.optim.SparseAdam(params, lr=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ----------------------------------------------------------------------------------------------- data
def exact_shard(n: int, world: int, rank: int, shuffle: bool, epoch: int) -> list[int]:
    """Strided shard of ``range(n)`` (a permutation seeded ``SAMPLER_SEED + epoch`` if ``shuffle``), no padding."""
    if shuffle:
        g = torch.Generator().manual_seed(SAMPLER_SEED + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    return order[rank::world]


def rank_ids(sc: dict, rank: int, epoch: int, world: Optional[int] = None) -> list[int]:
    """The ids rank ``rank`` of ``world`` (default: ``sc['world']``)'s loader yields in epoch ``epoch``, in order
    (per-rank shards: rank ``r``'s own, ``sc['shards'][r]``, at any world size)."""
    source, world = sc['source'], world or sc['world']
    if source == 'exact':
        return [7000 + i for i in exact_shard(sc['map_size'], world, rank, sc.get('shuffle', False), epoch)]
    if source == 'torch':
        sampler = DistributedSampler(
            range(sc['map_size']), num_replicas=world, rank=rank, shuffle=sc.get('shuffle', False), seed=SAMPLER_SEED
        )
        sampler.set_epoch(epoch)
        return [7000 + i for i in sampler]
    return [1000 * rank + i for i in range(sc['shards'][rank])]


def tokens_of(ids) -> int:
    """The tokens of samples ``ids`` (each occurrence counted): ``1 + i % 3`` each."""
    return sum(1 + int(i) % 3 for i in ids)


def transform(batch: list[int], kind: Optional[str]) -> list[Sample]:
    """``batch_transforms``: 'float' (a dtype change: no sample change here), 'drop' (the last sample of a batch of
    two or more is dropped), 'views' (every sample twice, the second mirrored)."""
    out = [(i, 0) for i in batch]
    if kind == 'drop' and len(out) >= 2:
        out = out[:-1]
    if kind == 'views':
        out = out + [(i, 1) for i in batch]
    return out


def rank_batches(sc: dict, rank: int, epoch: int, world: Optional[int] = None) -> list[list[Sample]]:
    ids, b = rank_ids(sc, rank, epoch, world), sc['batch']
    return [transform(ids[k : k + b], sc.get('transform')) for k in range(0, len(ids), b)]


Owned = tuple[int, list[int]]  # (the rank whose loader yielded a batch, its ids before the batch transform)


def schedule(sc: dict, per_rank: list[list[Owned]]) -> list[list[Optional[Owned]]]:
    """Per step, per rank, the batch it trains (None: none), from each rank's batches: in ``mode='shadow'`` rank
    ``r``'s ``t``-th at step ``t``; in ``mode='rebalance'`` own batches first, then donations from the rank with
    most left (ties to the lowest rank), receivers in rank order (docs/rebalancing.md)."""
    world = len(per_rank)
    if sc.get('mode', 'shadow') != 'rebalance':
        steps = max((len(b) for b in per_rank), default=0)
        return [[b[t] if t < len(b) else None for b in per_rank] for t in range(steps)]
    queues = [deque(b) for b in per_rank]
    out = []
    while any(queues):
        step: list[Optional[Owned]] = [q.popleft() if q else None for q in queues]
        for r in range(world):
            if step[r] is None:
                donor = max(range(world), key=lambda d: (len(queues[d]), -d))
                if queues[donor]:
                    step[r] = queues[donor].popleft()
        out.append(step)
    return out


def _samples(sc: dict, steps: list[list[Optional[Owned]]]) -> list[list[Optional[list[Sample]]]]:
    return [[None if b is None else transform(b[1], sc.get('transform')) for b in step] for step in steps]


def owned_steps(sc: dict, epoch: int, world: int) -> list[list[Optional[Owned]]]:
    """:func:`schedule` of every rank's loader of ``epoch`` on ``world`` ranks."""
    b = sc['batch']
    per_rank = []
    for r in range(world):
        ids = rank_ids(sc, r, epoch, world)
        per_rank.append([(r, ids[k : k + b]) for k in range(0, len(ids), b)])
    return schedule(sc, per_rank)


def epoch_steps(sc: dict, epoch: int, world: Optional[int] = None) -> list[list[Optional[list[Sample]]]]:
    """Per step of the epoch on ``world`` ranks (default: ``sc['world']``), per rank, the samples it trains (None:
    it has none)."""
    return _samples(sc, owned_steps(sc, epoch, world or sc['world']))


def resumptions(sc: dict) -> list[tuple[int, int]]:
    """Each resumption on another world size, in order: ``(global step of its checkpoint, world size resuming it)``;
    the first (``resume_at`` on ``resume_world``), then the chained one (``chain_at`` on ``chain_world``: the resumed
    run's own checkpoint resumed by a third run), which needs the first."""
    if not sc.get('resume_world') or sc.get('resume_at') is None:
        return []
    out = [(sc['resume_at'], sc['resume_world'])]
    if sc.get('chain_world') and sc.get('chain_at') is not None:
        out.append((sc['chain_at'], sc['chain_world']))
    return out


def world_at(sc: dict, step: int) -> int:
    """The world size that trains global step ``step`` (0-based): the last resumption whose checkpoint is at or
    before it."""
    world = sc['world']
    for at, new in resumptions(sc):
        if at <= step:
            world = new
    return world


def _scheduled(sc: dict, shares: list[list[int]]) -> list[list[Optional[Owned]]]:
    """:func:`schedule` of the ranks' ``shares`` (each rank's ids, in its loader's order) in batches."""
    b = sc['batch']
    return schedule(sc, [[(r, ids[k : k + b]) for k in range(0, len(ids), b)] for r, ids in enumerate(shares)])


def _dealt(shares: list[list[int]], done: list[list[Optional[Owned]]], new: int) -> list[list[int]]:
    """Per rank of ``new``, its share of what the ranks of ``shares`` had not used after the steps ``done``: each old
    rank's share without the samples it had used (trained, or given away rebalancing: a prefix of its loader),
    concatenated in old rank order; new rank ``q`` takes every ``new``-th from the ``q``-th
    (``composer_join.data.elastic.shard_of``'s rule, written here from docs/reliability.md; ``shares`` is itself a
    share of a resumed epoch for a chained resumption inside it)."""
    used = [0] * len(shares)
    for step in done:
        for batch in step:
            if batch is not None:
                used[batch[0]] += len(batch[1])
    left = [i for r, ids in enumerate(shares) for i in ids[used[r] :]]
    return [left[q::new] for q in range(new)]


def rest_ids(sc: dict, epoch: int, done: int) -> list[list[int]]:
    """Per rank of ``resume_world``, the ids of ``epoch`` it trains after a checkpoint taken ``done`` steps into that
    epoch on ``world`` ranks (map-style data): every old rank's shard of the epoch, without the samples it had used
    (trained, or given away rebalancing: a prefix of its loader), concatenated in old rank order; new rank ``q`` of
    ``W'`` takes every ``W'``-th from the ``q``-th."""
    old = sc['world']
    shares = [rank_ids(sc, r, epoch, old) for r in range(old)]
    return _dealt(shares, owned_steps(sc, epoch, old)[:done], sc['resume_world'])


def rest_batches(sc: dict, epoch: int, done: int) -> list[list[Optional[Owned]]]:
    """The steps of ``epoch`` after a checkpoint ``done`` steps into it, resumed on ``resume_world`` ranks, as the
    loaders yield them (before the batch transform): each new rank's :func:`rest_ids` in batches of the loader's
    batch size, scheduled by the mode. Per-rank shard data resumes only from an epoch's last batch (nothing left;
    mid-epoch it is refused: none here either)."""
    if sc['source'] not in ('exact', 'torch'):
        return []
    return _scheduled(sc, rest_ids(sc, epoch, done))


def rest_steps(sc: dict, epoch: int, done: int) -> list[list[Optional[list[Sample]]]]:
    """:func:`rest_batches` through the batch transform: the samples each new rank trains. The rest is batched anew,
    so a transform that depends on a batch's make-up ('drop': a batch's last sample) acts on the new batches and
    drops other samples than the old shards' batches would have (seed 401498, 2 ranks resumed on 1: the rest
    [7010, 7012] + [7011, 7013] is one batch, 7013 dropped, where the old batches [7010, 7012] and [7011, 7013]
    dropped 7012 and 7013)."""
    return _samples(sc, rest_batches(sc, epoch, done))


def epoch_batches(sc: dict, epoch: int, start: int) -> list[list[Optional[Owned]]]:
    """The steps of ``epoch``, whose first step is global step ``start``, as the loaders yield them: the shards of
    the world size training ``start``, cut at each resumption on another world size inside the epoch, the rest
    dealt over the new ranks (:func:`_dealt`) and scheduled anew, again at a chained resumption inside that rest.
    Per-rank shard data leaves no rest (mid-epoch it is refused). A checkpoint of the epoch's last batch cuts
    nothing: the next epoch starts on the new world size (:func:`world_at`)."""
    return _epoch(sc, epoch, start)[0]


def _epoch(sc: dict, epoch: int, start: int) -> tuple[list[list[Optional[Owned]]], list[int]]:
    """:func:`epoch_batches`, and the global steps of the checkpoints that cut it (mid-epoch resumptions)."""
    world = world_at(sc, start)
    shares = [rank_ids(sc, r, epoch, world) for r in range(world)]
    out: list[list[Optional[Owned]]] = []
    cuts: list[int] = []
    while True:
        steps = _scheduled(sc, shares)
        here = start + len(out)
        cut = next(((at, new) for at, new in resumptions(sc) if here < at < here + len(steps)), None)
        if cut is None:
            return out + steps, cuts
        done = steps[: cut[0] - here]
        out += done
        cuts.append(cut[0])
        shares = _dealt(shares, done, cut[1]) if sc['source'] in ('exact', 'torch') else [[] for _ in range(cut[1])]


def resumptions_in(sc: dict) -> list[tuple[int, int, bool]]:
    """Per resumption on another world size (:func:`resumptions`): ``(epoch, steps of it done, mid-epoch)`` at its
    checkpoint (the checkpoint of an epoch's last batch: ``done`` its length, not mid-epoch)."""
    wanted = [at for at, _ in resumptions(sc)]
    out: list[tuple[int, int, bool]] = []
    start, epoch = 0, 0
    while len(out) < len(wanted) and epoch < 1000:
        steps, cuts = _epoch(sc, epoch, start)
        out += [(epoch, at - start, at in cuts) for at in wanted if start < at <= start + len(steps)]
        start, epoch = start + len(steps), epoch + 1
    return out


def resumed_in(sc: dict) -> Optional[tuple[int, int]]:
    """For a scenario resumed on another world size: ``(epoch, steps of it done)`` at its (first) checkpoint (done =
    the epoch's length for the checkpoint of its last batch: an epoch boundary); else None."""
    found = resumptions_in(sc)
    return (found[0][0], found[0][1]) if found else None


def mid_epoch(sc: dict) -> bool:
    """Resumed on another world size from a checkpoint inside an epoch (not after its last batch): the first
    resumption's, or a chained one's."""
    return any(mid for _, _, mid in resumptions_in(sc))


def world_of(sc: dict, epoch: int) -> int:
    """The world size whose shards make ``epoch``'s data: the world size it started on (the new one after an epoch
    a resumption interrupted or ended)."""
    world = sc['world']
    for (e, _, _), (_, new) in zip(resumptions_in(sc), resumptions(sc)):
        if e < epoch:
            world = new
    return world


def final_world(sc: dict) -> int:
    """The world size the scenario ends on (evaluations and predictions run there)."""
    found = resumptions(sc)
    return found[-1][1] if found else sc['world']


def planned_batches(sc: dict) -> list[tuple[int, list[Optional[Owned]]]]:
    """Every step the run trains, with its epoch, as the loaders yield it (before the batch transform): the duration,
    then one more epoch if ``refit``; resumed on another world size: the steps of ``world`` up to ``resume_at``, the
    interrupted epoch's rest dealt over ``resume_world`` ranks, then ``resume_world``'s epochs, and so on at a
    chained resumption (:func:`epoch_batches`; durations count across the runs, in the samples and tokens the
    transform leaves)."""
    value, unit = sc['duration']
    out: list[tuple[int, list[Optional[Owned]]]] = []
    samples, epoch = 0, 0
    while True:
        if unit == 'ep' and epoch == value:
            break
        for step in epoch_batches(sc, epoch, len(out)):
            out.append((epoch, step))
            counted = [i for s in _samples(sc, [step])[0] if s for i, _ in s]
            samples += len(counted) if unit == 'sp' else tokens_of(counted)
            if (unit == 'ba' and len(out) == value) or (unit in ('sp', 'tok') and samples >= value):
                break
        else:
            epoch += 1
            continue
        break
    if sc.get('refit'):
        out += [(epoch, step) for step in epoch_batches(sc, epoch, len(out))]
    return out


def planned_steps(sc: dict) -> list[tuple[int, list[Optional[list[Sample]]]]]:
    """:func:`planned_batches` through the batch transform: every step the run trains, with its epoch, per rank the
    samples it trains (None: it has none)."""
    return [(epoch, _samples(sc, [step])[0]) for epoch, step in planned_batches(sc)]


# ----------------------------------------------------------------------------------------------- training
def microbatch_at(sc: dict, t: int) -> int:
    """The microbatch size in force at step ``t`` of the run: the scenario's (Composer's default: the dataloader's
    batch size; a 'views' batch is two of them), halved (at least 1) from the step of an out-of-memory error on
    (``oom``: automatic microbatching retries that step with half the size and keeps it)."""
    mb = sc.get('microbatch') or sc['batch']
    oom = sc.get('oom')
    return max(mb // 2, 1) if oom is not None and t >= oom[1] else mb


def step_loss(module: Net, sc: dict, step: list[Optional[list[Sample]]], t: int = 0) -> torch.Tensor:
    """The step's loss: per-sample losses over its real samples summed (each microbatch run on its own), over S_t,
    times A_t / W_t when ``divide`` (W_t: the step's world size, ``len(step)``)."""
    parts = [s for s in step if s]
    total = sum(len(s) for s in parts)
    mb = microbatch_at(sc, t)
    loss = torch.zeros(())
    if sc.get('model') == 'sync':  # microbatch k of the step: the union of every rank's k-th, as one forward
        chunks = [[s[k : k + mb] for k in range(0, len(s), mb)] for s in parts]
        together = [[x for c in chunks if k < len(c) for x in c[k]] for k in range(max(map(len, chunks), default=0))]
    else:
        together = [s[k : k + mb] for s in parts for k in range(0, len(s), mb)]
    for samples in together:
        x, y = tensors(samples, sc)
        x = x.to(next(module.parameters()).dtype)  # (float64 in the float-noise estimate: train(double=True))
        loss = loss + F.cross_entropy(module(x, y), y, reduction='none').sum()
    factor = len(parts) / len(step) if sc.get('divide', True) else 1.0
    return loss / total * factor


def train(sc: dict, upto: Optional[int] = None, double: bool = False) -> dict[str, Any]:
    """The parameters after the scenario's training, the steps (ids per rank), and what each epoch trained;
    ``upto``: after its first ``upto`` steps only (a checkpoint's: ``resume_at``); ``double``: the same training in
    float64 (its distance from the float32 one measures how much the scenario amplifies float32 rounding:
    :func:`float_noise`)."""
    module = make_model(sc).double() if double else make_model(sc)
    module.train()
    optimizer = make_optimizer(sc, module.parameters())
    batches = planned_batches(sc)[:upto]
    steps = [(epoch, _samples(sc, [step])[0]) for epoch, step in batches]
    for t, (_, step) in enumerate(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss(module, sc, step, t).backward()
        if sc.get('clip'):
            torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], CLIP)
        optimizer.step()
    trained: dict[int, dict[int, int]] = {}
    for epoch, step in steps:
        for part in step:
            for i, _ in part or []:
                trained.setdefault(epoch, {})[i] = trained.setdefault(epoch, {}).get(i, 0) + 1
    loaded: dict[int, dict[int, int]] = {}
    for epoch, owned in batches:
        for batch in owned:
            for i in batch[1] if batch is not None else []:
                loaded.setdefault(epoch, {})[i] = loaded.setdefault(epoch, {}).get(i, 0) + 1
    return {
        'params': {n: p.detach().clone() for n, p in module.named_parameters()},
        'steps': [[sorted(i for i, _ in s) if s else [] for s in step] for _, step in steps],
        'samples': sum(len(s) for _, step in steps for s in step if s),
        'tokens': tokens_of(i for _, step in steps for s in step if s for i, _ in s),
        'trained': trained,
        'loaded': loaded,
    }


def expected_counts(sc: dict, epoch: int) -> dict[int, int]:
    """How often each id is in the scenario's data in ``epoch`` (transforms included): what an epoch must train (an
    epoch resumed on another world size: as the old shards' batches hold it; not what a :func:`regrouped` epoch
    trains)."""
    counts: dict[int, int] = {}
    world = world_of(sc, epoch)
    for r in range(world):
        for batch in rank_batches(sc, r, epoch, world):
            for i, _ in batch:
                counts[i] = counts.get(i, 0) + 1
    return counts


def expected_loaded(sc: dict, epoch: int) -> dict[int, int]:
    """How often each id is in the scenario's data in ``epoch`` as the loaders yield it (before the batch
    transform): what an epoch must load, every sample of each shard once (an epoch resumed on another world size:
    the old shards, docs/reliability.md "Elastic resumption": every sample of the interrupted epoch exactly once)."""
    counts: dict[int, int] = {}
    world = world_of(sc, epoch)
    for r in range(world):
        for i in rank_ids(sc, r, epoch, world):
            counts[i] = counts.get(i, 0) + 1
    return counts


def regrouped(sc: dict, epoch: int) -> bool:
    """``epoch`` was resumed mid-epoch on another world size and the batch transform depends on a batch's make-up
    ('drop': its last sample): the rest of the epoch is batched anew (:func:`rest_steps`), so the samples the
    transform leaves are not :func:`expected_counts`' (the old shards' batches); the samples loaded still are
    :func:`expected_loaded`."""
    return sc.get('transform') == 'drop' and any(e == epoch and mid for e, _, mid in resumptions_in(sc))


# ----------------------------------------------------------------------------------------------- eval, predict
def eval_ids(sc: dict, rank: int, group: int = 50) -> list[int]:
    return [1000 * (group + rank) + i for i in range(sc['eval_shards'][rank])]


def outputs(state: dict[str, torch.Tensor], sc: dict, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the model with ``state`` (parameters and buffers) in eval mode on ``ids``, and the labels.
    (Evaluation and prediction loaders only change the dtype, never the samples.)"""
    module = make_model(sc)
    module.load_state_dict(state)
    module.eval()
    x, y = tensors([(i, 0) for i in ids], {})
    with torch.no_grad():
        return module(x, y), y


def initial_state(sc: dict) -> dict[str, torch.Tensor]:
    """The scenario's model's state (parameters and buffers) before any training: what an evaluation before the
    first ``fit()`` evaluates (``eval_first``)."""
    return {k: v.detach().clone() for k, v in make_model(sc).state_dict().items()}


def evaluate(state: dict[str, torch.Tensor], sc: dict, world: Optional[int] = None) -> dict[str, float]:
    """Accuracy and mean per-sample loss over every rank's eval samples (of ``world`` ranks; default: the world the
    scenario ends on) at once."""
    out, y = outputs(state, sc, [i for r in range(world or final_world(sc)) for i in eval_ids(sc, r)])
    return {
        'accuracy': float((out.argmax(1) == y).float().mean()) if len(y) else math.nan,
        'loss': float(F.cross_entropy(out, y)) if len(y) else math.nan,
    }


def float_noise(sc: dict, params: Optional[dict[str, torch.Tensor]] = None, upto: Optional[int] = None) -> float:
    """How far the float32 reference's parameters (``params``, else trained here) are from the same training in
    float64: the scenario's own float32 noise. BatchNorm over small microbatches can amplify rounding far past
    1e-6 (seed 642866: 1.0e-5; the ranks, and stock Composer on even shards, 2.0e-6 to 5.5e-6 from the float32
    reference), where no order of summation is more right than another. ``upto``: as :func:`train`'s."""
    params = params if params is not None else train(sc, upto)['params']
    return max_abs_diff(params, {k: v.float() for k, v in train(sc, upto, double=True)['params'].items()})


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(float((a[k].detach().double() - b[k].detach().double()).abs().max()) for k in a)
