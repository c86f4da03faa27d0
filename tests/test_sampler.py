"""Tests for composer_join.data.sampler.ExactDistributedSampler (single process; ranks are simulated)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, TensorDataset

from composer_join.data.sampler import ExactDistributedSampler

PROPS = settings(max_examples=150, deadline=None, derandomize=True)

sizes = st.integers(0, 500)
replicas = st.integers(1, 8)
seeds = st.integers(0, 2**31)
epochs = st.integers(0, 10_000)


class Indexed(Dataset):
    """``ds[i] == i``; records what was fetched."""

    def __init__(self, n: int):
        self.n = n
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.fetched.append(int(i))
        return torch.tensor([float(i)]), torch.tensor(int(i))


def shards(n, world, *, seed=0, epoch=0, shuffle=True, dataset=None):
    ds = list(range(n)) if dataset is None else dataset
    out = []
    for rank in range(world):
        s = ExactDistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def global_order(parts):
    """Re-interleave strided shards into the epoch's full order."""
    world = len(parts)
    n = sum(map(len, parts))
    return [parts[i % world][i // world] for i in range(n)]


# ---------------------------------------------------------------- properties


@PROPS
@given(n=sizes, world=replicas, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_shards_partition_the_dataset_exactly_once(n, world, seed, epoch, shuffle):
    ds = list(range(n))
    parts = []
    for rank in range(world):
        s = ExactDistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        s.set_epoch(epoch)
        part = list(s)
        parts.append(part)
        # len() and the attributes Composer/torch read are truthful.
        assert len(s) == len(part) == s.num_samples == s.shard_length(rank)
        assert s.num_samples == math.ceil(max(0, n - rank) / world)
        assert s.total_size == n == len(s.dataset)
        assert s.drop_last is False
        # Composer's eval loop (trainer.py `_eval_loop`): padding = total_size - len(dataset);
        # ranks with global_rank >= world_size - padding drop one sample. Must never trigger.
        padding = s.total_size - len(s.dataset)
        assert padding == 0 and not rank >= world - padding
    flat = [i for p in parts for i in p]
    assert sorted(flat) == ds  # union is everything, exactly once (hence disjoint)
    assert len(set(flat)) == len(flat)
    lengths = [len(p) for p in parts]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the longer shards are the low ranks
    assert sum(lengths) == n


@PROPS
@given(n=sizes, world=replicas, seed=seeds, epoch=epochs)
def test_shuffled_order_is_torch_randperm_seeded_with_seed_plus_epoch(n, world, seed, epoch):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    assert global_order(shards(n, world, seed=seed, epoch=epoch)) == torch.randperm(n, generator=g).tolist()


@PROPS
@given(n=st.integers(1, 500), world=replicas, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_shard_is_torch_shard_without_its_padding(n, world, seed, epoch, shuffle):
    for rank in range(world):
        ours = ExactDistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        theirs = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        mine, torchs = list(ours), list(theirs)
        assert torchs[: len(mine)] == mine
        assert len(torchs) - len(mine) in (0, 1)
        if n % world == 0:
            assert mine == torchs and ours.total_size == theirs.total_size


@PROPS
@given(n=sizes, world=replicas, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_deterministic_per_seed_and_epoch(n, world, seed, epoch, shuffle):
    first = shards(n, world, seed=seed, epoch=epoch, shuffle=shuffle)
    assert shards(n, world, seed=seed, epoch=epoch, shuffle=shuffle) == first  # fresh samplers agree
    s = ExactDistributedSampler(list(range(n)), num_replicas=world, rank=world - 1, shuffle=shuffle, seed=seed)
    s.set_epoch(epoch + 1)
    list(s)
    s.set_epoch(epoch)
    assert list(s) == list(s) == first[world - 1]  # no hidden state between iterations / epochs


@PROPS
@given(
    n=st.integers(20, 500),
    world=replicas,
    seed=seeds,
    epochs_=st.lists(epochs, min_size=2, max_size=2, unique=True),
)
def test_different_epochs_give_different_orders(n, world, seed, epochs_):
    e1, e2 = epochs_
    a = shards(n, world, seed=seed, epoch=e1)
    b = shards(n, world, seed=seed, epoch=e2)
    assert global_order(a) != global_order(b)
    assert [len(p) for p in a] == [len(p) for p in b]  # shard lengths do not depend on the epoch


@PROPS
@given(n=st.integers(20, 500), world=replicas, seeds_=st.lists(seeds, min_size=2, max_size=2, unique=True))
def test_different_seeds_give_different_orders(n, world, seeds_):
    assert global_order(shards(n, world, seed=seeds_[0])) != global_order(shards(n, world, seed=seeds_[1]))


@PROPS
@given(n=sizes, world=replicas, seed=seeds, epoch=epochs)
def test_no_shuffle_is_strided_ascending_and_ignores_seed_and_epoch(n, world, seed, epoch):
    parts = shards(n, world, seed=seed, epoch=epoch, shuffle=False)
    assert parts == [list(range(rank, n, world)) for rank in range(world)]
    assert global_order(parts) == list(range(n))


# ---------------------------------------------------------------- edge cases


def test_empty_dataset_gives_every_rank_an_empty_shard():
    for rank in range(3):
        s = ExactDistributedSampler([], num_replicas=3, rank=rank)
        assert list(s) == [] and len(s) == 0 and s.total_size == 0
        assert len(DataLoader([], batch_size=4, sampler=s)) == 0


def test_dataset_smaller_than_world_leaves_high_ranks_empty():
    parts = shards(3, 8, seed=5, epoch=2)
    assert [len(p) for p in parts] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert sorted(i for p in parts for i in p) == [0, 1, 2]


def test_dataloader_batches_the_shard():
    ds = TensorDataset(torch.arange(11))
    s = ExactDistributedSampler(ds, num_replicas=3, rank=1, seed=3)
    s.set_epoch(4)
    loader = DataLoader(ds, batch_size=2, sampler=s)
    assert len(loader) == math.ceil(len(s) / 2) == 2
    assert [int(x) for (b,) in loader for x in b] == list(s)


@pytest.mark.parametrize('drop_last', [True, 1])
def test_drop_last_true_is_rejected(drop_last):
    with pytest.raises(ValueError, match=r'drop_last=.*only drop_last=False is allowed'):
        ExactDistributedSampler(list(range(10)), num_replicas=2, rank=0, drop_last=drop_last)


def test_drop_last_false_is_accepted():
    assert ExactDistributedSampler(list(range(3)), num_replicas=2, rank=0, drop_last=False).drop_last is False


@pytest.mark.parametrize('world,rank', [(2, 2), (2, -1), (1, 1), (4, 7)])
def test_invalid_rank(world, rank):
    with pytest.raises(ValueError, match=rf'Invalid rank {rank}, rank should be in the interval \[0, {world - 1}\]'):
        ExactDistributedSampler(list(range(10)), num_replicas=world, rank=rank)


@pytest.mark.parametrize('world', [0, -3])
def test_invalid_num_replicas(world):
    with pytest.raises(ValueError, match=rf'Invalid num_replicas {world}, num_replicas should be a positive integer'):
        ExactDistributedSampler(list(range(10)), num_replicas=world, rank=0)


@pytest.mark.parametrize(
    'kwargs', [dict(num_replicas=2.0, rank=0), dict(num_replicas=2, rank=0.5), dict(num_replicas=True, rank=0)]
)
def test_non_integer_rank_or_num_replicas(kwargs):
    with pytest.raises(TypeError, match='must be an int'):
        ExactDistributedSampler(list(range(10)), **kwargs)


def test_defaults_come_from_torch_distributed_like_torch():
    assert not torch.distributed.is_initialized()
    with pytest.raises((ValueError, RuntimeError)):
        DistributedSampler(list(range(4)))
    with pytest.raises((ValueError, RuntimeError)):
        ExactDistributedSampler(list(range(4)))


def test_dataset_length_change_is_an_error():
    ds = list(range(6))
    s = ExactDistributedSampler(ds, num_replicas=2, rank=0)
    ds.append(6)
    with pytest.raises(RuntimeError, match='constant length'):
        iter(s)


def test_shard_length_rejects_bad_rank():
    s = ExactDistributedSampler(list(range(5)), num_replicas=2, rank=0)
    assert [s.shard_length(r) for r in range(2)] == [3, 2]
    with pytest.raises(ValueError, match='Invalid rank 2'):
        s.shard_length(2)


# ---------------------------------------------------------------- Composer integration


def test_module_exports():
    import composer_join.data.sampler as mod

    assert mod.__all__ == ['ExactDistributedSampler', 'shard_by_layout']
    assert issubclass(ExactDistributedSampler, DistributedSampler)


def test_composer_dataspec_accepts_it_with_world_size_above_one(monkeypatch):
    """composer/core/data_spec.py raises when world_size > 1 and the loader has no DistributedSampler."""
    from composer.core.data_spec import DataSpec
    from composer.trainer.trainer import _get_distributed_sampler
    from composer.utils import dist

    monkeypatch.setattr(dist, 'get_world_size', lambda: 2)
    ds = TensorDataset(torch.arange(9).float().unsqueeze(1), torch.arange(9))
    sampler = ExactDistributedSampler(ds, num_replicas=2, rank=1)
    loader = DataLoader(ds, batch_size=2, sampler=sampler)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        spec = DataSpec(loader)
    assert spec.num_samples == 9
    assert _get_distributed_sampler(loader) is sampler

    # The check is live under the patch: a plain loader is refused...
    with pytest.raises(ValueError, match='does not use DistributedSampler'):
        DataSpec(DataLoader(ds, batch_size=2))
    # ...and so is our sampler hidden inside a custom batch_sampler (Composer looks only at
    # dataloader.sampler and dataloader.batch_sampler themselves): pass it as sampler=.
    hidden = DataLoader(ds, batch_sampler=BatchSampler(sampler, batch_size=2, drop_last=False))
    with pytest.raises(ValueError, match='does not use DistributedSampler'):
        DataSpec(hidden)


def _trainer(train_ds, eval_ds, train_sampler, eval_sampler, metric):
    from composer import Trainer
    from composer.models import ComposerClassifier

    model = ComposerClassifier(
        torch.nn.Linear(1, 2),
        num_classes=2,
        train_metrics=metric.clone(),
        val_metrics=metric,
        loss_fn=lambda outputs, targets: outputs.pow(2).mean(),
    )
    return Trainer(
        model=model,
        train_dataloader=DataLoader(train_ds, batch_size=3, sampler=train_sampler),
        eval_dataloader=DataLoader(eval_ds, batch_size=3, sampler=eval_sampler),
        eval_interval=0,
        max_duration='2ep',
        device='cpu',
        progress_bar=False,
        log_to_console=False,
        save_folder=None,
        seed=1,
    )


def test_composer_trainer_uses_it_for_fit_and_eval_without_dropping_samples():
    """End to end, world size 1: Composer calls set_epoch(epoch) in fit and evaluates every sample once."""
    from torchmetrics import CatMetric

    class SeenIds(CatMetric):
        def update(self, outputs, targets):  # type: ignore[override]
            super().update(targets.float())

    n = 7  # not a multiple of the batch size: the last eval batch is partial
    train_ds, eval_ds = Indexed(n), Indexed(n)
    train_sampler = ExactDistributedSampler(train_ds, num_replicas=1, rank=0, seed=11)
    eval_sampler = ExactDistributedSampler(eval_ds, num_replicas=1, rank=0, seed=11)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        trainer = _trainer(train_ds, eval_ds, train_sampler, eval_sampler, SeenIds())
        trainer.fit()
        trainer.eval()
    assert not [w for w in caught if 'DistributedSampler' in str(w.message)]

    expected = []
    for epoch in range(2):
        g = torch.Generator()
        g.manual_seed(11 + epoch)
        expected += torch.randperm(n, generator=g).tolist()
    assert train_ds.fetched == expected  # Composer called set_epoch(0) then set_epoch(1)

    seen = trainer.state.eval_metrics['eval']['SeenIds'].compute()
    assert sorted(int(i) for i in seen) == list(range(n))  # nothing dropped as "padding"
