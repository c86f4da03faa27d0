"""The datasets of the data-pipeline matrix (``tests/test_pipelines.py``), in a module that imports only torch.

DataLoader workers started with ``spawn`` or ``forkserver`` unpickle the dataset and the collate function,
importing this module: it stays light so that they start quickly. Not a test module.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from toy import make_module, per_sample_loss, shard

POOL = 1000
EVAL_IDS = 500  # eval ids start here
X, Y = shard(7, POOL)


def collate_ids(rows: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, ids)`` for a list of ids, or of rows ``{'id': ...}`` (Hugging Face, streaming)."""
    ids = torch.tensor([int(r['id']) if isinstance(r, dict) else int(r) for r in rows])
    return X[ids], Y[ids], ids


class IdMap(Dataset):
    """Map-style: item ``k`` is id ``first + k``."""

    def __init__(self, first: int, size: int):
        self.first, self.size = first, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> int:
        return self.first + k


class WorkerShards(IterableDataset):
    """This rank's ids, split over the DataLoader's workers with ``get_worker_info()`` (worker ``w``: ``ids[w::n]``)."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def __iter__(self):
        info = get_worker_info()
        return iter(self.ids if info is None else self.ids[info.id :: info.num_workers])


class SizedWorkerShards(WorkerShards):
    """With ``__len__``: ``claimed`` samples (``len(ids)`` undercounts the batches when each worker ends its own)."""

    def __init__(self, ids: list[int], claimed: int):
        super().__init__(ids)
        self.claimed = claimed

    def __len__(self) -> int:
        return self.claimed


class PlainState(SizedWorkerShards):
    """Resumes itself as Hugging Face's ``IterableDataset`` does: ``state_dict()`` with no argument, the
    position after the last id yielded; ``load_state_dict`` applies to the next iteration."""

    def __init__(self, ids: list[int], claimed: int):
        super().__init__(ids, claimed)
        self.position, self.start = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {'position': self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state['position']

    def __iter__(self):
        self.position, self.start = self.start, 0
        for i in self.ids[self.position :]:
            self.position += 1
            yield i


class ComposerProtocol(SizedWorkerShards):
    """Composer's protocol, not registered with UnevenJoin (left to Composer): ``state_dict(num_samples,
    from_beginning)`` keeps the count Composer hands it; the next iteration after ``load_state_dict`` skips that many
    of this rank's ids (read in this process: with workers each worker would skip them)."""

    def __init__(self, ids: list[int], claimed: int):
        super().__init__(ids, claimed)
        self.skip = 0

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, int]:
        return {'sample_in_epoch': num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state['sample_in_epoch']

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return iter(self.ids[skip:])


def generate_ids(files: list[list[int]]):
    """Hugging Face ``from_generator``: one 'file' of ids per shard."""
    for ids in files:
        for i in ids:
            yield {'id': i}


def kept(i: int) -> bool:
    """The ids a data-dependent filter keeps (Hugging Face ``.filter()`` rows): those not divisible by 3."""
    return i % 3 != 0


def keep_row(row: dict) -> bool:
    """Hugging Face ``.filter()``: whether to keep a row ``{'id': ...}``."""
    return kept(int(row['id']))


def wds_id(sample: dict) -> int:
    """webdataset: the id of a sample read from a tar shard (its ``.cls`` member, the id as text)."""
    return int(sample['cls'])


def id_row(i: int) -> dict:
    """``litdata.optimize``: the row written for input ``i``."""
    return {'id': i}


def replay(steps: list[list[list[int]]]) -> dict[str, torch.Tensor]:
    """One process trains every step of ids from the pool (each step: the ids of each of its ranks): the mean loss over
    the step's samples, times ``A_t / W_t`` (the ranks with ids, of the step's ranks). SGD, momentum 0.9, as the
    scenarios train. The single-process reference of the pipeline, resumption and elastic tests."""
    module = make_module('mlp')
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for per_rank in steps:
        active = [ids for ids in per_rank if ids]
        ids = torch.tensor([i for part in active for i in part])
        loss = per_sample_loss(module, X[ids], Y[ids]).sum() / len(ids) * len(active) / len(per_rank)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}
