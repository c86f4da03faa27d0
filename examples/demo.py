"""Two ranks, uneven shards, one small classifier: what UnevenJoin trains and what stock Composer drops.

Run it with Composer's launcher (one process per rank, gloo on CPU)::

    composer -n 2 examples/demo.py

It trains twice on the same shards (40 and 21 samples, batch 8, two epochs), once with
UnevenJoin and once with stock Composer, and rank 0 prints what each trained.
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from composer.utils import dist, reproducibility
from torch.utils.data import DataLoader, IterableDataset

from composer_join import UnevenJoin

SHARD_SIZES = (40, 21)  # samples per rank
BATCH_SIZE = 8


class Shard(IterableDataset):
    """This rank's own slice of a synthetic 3-class problem, read in order, with a length."""

    def __init__(self, rank: int, size: int, features: int = 10):
        g = torch.Generator().manual_seed(1000 + rank)
        self.x = torch.randn(size, features, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __iter__(self):
        return iter(zip(self.x, self.y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--epochs', type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings('ignore')
    for stock in (False, True):
        run(stock, args.epochs)


def run(stock: bool, epochs: int) -> None:
    reproducibility.seed_all(0)
    rank = dist.get_global_rank()
    shards = SHARD_SIZES + tuple(SHARD_SIZES[-1] for _ in range(dist.get_world_size() - len(SHARD_SIZES)))
    dataset = Shard(rank, shards[rank])
    model = ComposerClassifier(
        torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)), num_classes=3
    )
    join = UnevenJoin()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(dataset, batch_size=BATCH_SIZE),
        max_duration=f'{epochs}ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[] if stock else [join],
        device='cpu',
        progress_bar=False,
        log_to_console=False,
        seed=0,
    )
    trainer.fit()
    samples = int(trainer.state.timestamp.sample)
    total = sum(shards[: dist.get_world_size()]) * epochs
    if rank == 0:
        print(
            f'{"stock Composer" if stock else "UnevenJoin"}: trained {samples} of {total} samples '
            f'in {int(trainer.state.timestamp.batch)} steps, final loss {trainer.state.total_loss_dict}'
        )
        for report in join.reports:
            print(report.summary())
    trainer.close()


if __name__ == '__main__':
    main()
