"""Example datasets: each rank reads its own shard, so ranks have different numbers of batches.

:data:`DATASETS` names them for a config's ``data:`` section. Each returns :class:`Loaders`: ``train`` is
this rank's own shard (no ``DistributedSampler``), ``eval`` splits a held-out set evenly over the ranks.
Rank and world size come from the launcher's environment (``RANK``, ``WORLD_SIZE``), so the data can be
built before ``Trainer`` sets up distributed training.

=================  ==================================================================================
``digits``         scikit-learn's 8x8 digit images (shipped with scikit-learn). Uneven on purpose:
                   rank ``r`` gets ``shares[r % len(shares)]`` parts of the training split.
``pydoc_text``     bytes of Python's own help texts (``pydoc_data.topics``): each rank reads the same
                   number of help topics, cut into paragraph-sized sequences and packed into batches
                   of at most ``tokens_per_batch`` tokens (padding included). Uneven naturally: topics
                   differ in length, so ranks get different numbers (and sizes) of batches.
=================  ==================================================================================

Example:
    >>> loaders = DATASETS['digits'](batch_size=32, shares=[3, 1])  # of 2 ranks: rank 0 gets 1078 samples, rank 1 360
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

import torch
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from composer_join.config.registry import Registry

__all__ = ['DATASETS', 'IGNORE', 'PAD', 'Loaders', 'Shard', 'TokenBudgetBatches', 'digits', 'pad_batch', 'pydoc_text']

PAD = 256  # input id of padding (bytes are 0..255)
IGNORE = -100  # label of padding, ignored by the loss


class Loaders(NamedTuple):
    """This rank's training shard and its part of the evaluation set."""

    train: DataLoader
    eval: DataLoader


def digits(batch_size: int = 32, shares: Sequence[float] = (1,), test_fraction: float = 0.2, seed: int = 0) -> Loaders:
    """scikit-learn's digits, 64 features in [0, 1], 10 classes; this rank's share of the training split."""
    from sklearn.datasets import load_digits

    if not 0 < test_fraction < 1:
        raise ValueError(f'test_fraction must be in (0, 1), got {test_fraction}')
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    own = train[slice(*_share(len(train), shares))]
    held_out = TensorDataset(x[test], y[test])
    return Loaders(
        train=DataLoader(Shard(x[own], y[own], seed=seed + dist.get_global_rank()), batch_size=batch_size),
        eval=DataLoader(held_out, batch_size=batch_size, sampler=dist.get_sampler(held_out)),
    )


def pydoc_text(
    tokens_per_batch: int = 2048,
    max_length: int = 128,
    eval_sequences: int = 128,
    eval_batch_size: int = 16,
    fraction: float = 1.0,
    seed: int = 0,
) -> Loaders:
    """Byte sequences (at most ``max_length`` bytes) from the standard library's help texts, for a byte-level LM.

    Each help topic is a document; rank ``r`` of ``W`` reads the ``r``-th of ``W`` contiguous, equal-count
    groups of documents (alphabetical), minus ``eval_sequences`` sequences held out for evaluation.
    ``fraction`` keeps that part of each rank's sequences, for short runs. A batch is ``(inputs, labels)``,
    both ``[batch, length - 1]``: inputs padded with :data:`PAD`, labels (the next bytes) with :data:`IGNORE`.
    """
    if not 2 <= max_length <= tokens_per_batch:
        raise ValueError(f'need 2 <= max_length <= tokens_per_batch, got {max_length} and {tokens_per_batch}')
    if not 0 < fraction <= 1:
        raise ValueError(f'fraction must be in (0, 1], got {fraction}')
    docs = _documents(max_length)
    everything = [seq for doc in docs for seq in doc]
    held_out = set(random.Random(seed).sample(range(len(everything)), eval_sequences))
    rank, world = dist.get_global_rank(), dist.get_world_size()
    starts = [sum(len(d) for d in docs[: len(docs) * r // world]) for r in range(world + 1)]
    own = [everything[i] for i in range(starts[rank], starts[rank + 1]) if i not in held_out]
    eval_set = [everything[i] for i in sorted(held_out)]
    return Loaders(
        train=DataLoader(
            TokenBudgetBatches(own[: round(len(own) * fraction)], tokens_per_batch, seed), batch_size=None
        ),
        eval=DataLoader(eval_set, batch_size=eval_batch_size, sampler=dist.get_sampler(eval_set), collate_fn=pad_batch),
    )


class Shard(IterableDataset):
    """This rank's own ``(x, y)`` samples, in a new order each pass. ``len()`` is the number of samples.

    An ``IterableDataset``, so that Composer accepts it without a ``DistributedSampler``.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int = 0):
        self.x, self.y, self.seed, self.passes = x, y, seed, 0

    def __len__(self) -> int:
        return len(self.y)

    def __iter__(self):
        order = torch.randperm(len(self.y), generator=torch.Generator().manual_seed(self.seed + self.passes))
        self.passes += 1
        return ((self.x[i], self.y[i]) for i in order.tolist())


class TokenBudgetBatches(IterableDataset):
    """Sequences packed into padded batches of at most ``tokens_per_batch`` tokens, similar lengths together.

    The batches are fixed; each pass yields them in a new order. ``len()`` is the number of batches;
    use with ``DataLoader(..., batch_size=None)``.
    """

    def __init__(self, sequences: Sequence[bytes], tokens_per_batch: int, seed: int = 0):
        self.batches, current = [], []
        for seq in sorted(sequences, key=len):  # each new sequence is the longest so far
            if current and (len(current) + 1) * (len(seq) - 1) > tokens_per_batch:
                self.batches.append(pad_batch(current))
                current = []
            current.append(seq)
        if current:
            self.batches.append(pad_batch(current))
        self.seed, self.passes = seed, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.seed + self.passes))
        self.passes += 1
        return (self.batches[i] for i in order.tolist())


def pad_batch(sequences: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` for next-byte prediction, padded to the longest sequence."""
    length = max(len(s) for s in sequences) - 1
    inputs = torch.full((len(sequences), length), PAD)
    labels = torch.full((len(sequences), length), IGNORE)
    for i, seq in enumerate(sequences):
        data = torch.tensor(list(seq))
        inputs[i, : len(seq) - 1] = data[:-1]
        labels[i, : len(seq) - 1] = data[1:]
    return inputs, labels


def _documents(max_length: int, min_length: int = 8) -> list[list[bytes]]:
    """One list per help topic (alphabetical) of its paragraphs' bytes, in chunks of at most ``max_length``."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        chunks = []
        for paragraph in topics[name].split('\n\n'):
            data = ' '.join(paragraph.split()).encode()
            chunks.extend(data[i : i + max_length] for i in range(0, len(data), max_length))
        docs.append([c for c in chunks if len(c) >= min_length])
    return docs


def _share(n: int, shares: Sequence[float]) -> tuple[int, int]:
    """This rank's ``[lo, hi)`` of ``n`` items, rank ``r`` weighted ``shares[r % len(shares)]``."""
    if not shares or any(s <= 0 for s in shares):
        raise ValueError(f'shares must be positive numbers, got {list(shares)}')
    weights = [shares[r % len(shares)] for r in range(dist.get_world_size())]
    cuts = [round(n * sum(weights[:r]) / sum(weights)) for r in range(len(weights) + 1)]
    rank = dist.get_global_rank()
    return cuts[rank], cuts[rank + 1]


DATASETS = Registry('dataset', {'digits': digits, 'pydoc_text': pydoc_text})
