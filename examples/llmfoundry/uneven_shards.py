"""llm-foundry components for training on uneven per-rank shards; imported through the YAML's ``code_paths:``.

* ``uneven_shards`` (``llmfoundry.registry.dataloaders``): each rank reads its own file
  ``<path>/rank<R>.npy`` (``prepare.py`` writes them), an ``int64`` array of token sequences of one
  length, and streams it in order in batches of ``device_batch_size``. Shards may differ in length
  and may be empty; with ``algorithms: {uneven_join: {}}`` every rank trains and evaluates every
  sequence of its shard. llm-foundry's own ``text`` loader (``StreamingDataset``) splits one
  dataset evenly across ranks, so it never has uneven shards. Under tensor parallelism
  (``tensor_parallel_degree: T``, as in ``uneven_mpt_tp.yaml``) the shards are per data-parallel
  rank: rank ``R`` reads ``rank<R // T>.npy``, so both ranks of a TP group read the same batches
  (Composer 0.32.1's mesh puts the TP dimension innermost).
* ``run_record`` (``llmfoundry.registry.loggers``): writes, per rank, what the run did to
  ``<out>/rank<R>.pt`` at the end of ``fit``: samples and batches trained, the final weights and
  model config, the token ids of every batch it trained, and per evaluation the weights it used,
  the metrics logged and the tokens this rank evaluated. ``tests/test_llmfoundry.py`` checks these against one process.

Example (YAML)::

    code_paths: [examples/llmfoundry/uneven_shards.py]
    train_loader: {name: uneven_shards, path: /tmp/uneven-mpt/data/train, num_workers: 0, prefetch_factor: null}
    loggers: {run_record: {out: /tmp/uneven-mpt/record}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from composer.core import DataSpec, State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist
from llmfoundry.data.utils import get_tokens_per_batch_func
from llmfoundry.registry import dataloaders, loggers
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

__all__ = ['RankShard', 'RunRecord', 'uneven_shards']


class RankShard(IterableDataset):
    """One rank's token sequences (rows of an ``.npy`` file), in order, with ``__len__``."""

    def __init__(self, file: Path):
        self.ids = torch.from_numpy(np.load(file))

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.ids)


def _collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)
    return {'input_ids': ids, 'labels': ids.clone()}  # no padding, so no attention_mask


def uneven_shards(
    tokenizer: Any,
    device_batch_size: int,
    path: str,
    num_workers: int = 0,
    prefetch_factor: Optional[int] = None,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    timeout: float = 0,
    tensor_parallel_degree: int = 1,
) -> DataSpec:
    """This rank's own shard, ``<path>/rank<data-parallel rank>.npy``, as llm-foundry's dataloader builders return it.

    The data-parallel rank is the global rank divided by ``tensor_parallel_degree`` (the module docstring).
    """
    member = dist.get_global_rank() // int(tensor_parallel_degree)
    file = Path(path) / f'rank{member}.npy'
    if not file.exists():
        raise FileNotFoundError(
            f'uneven_shards: rank {dist.get_global_rank()} (data-parallel rank {member}) has no shard {file} '
            f'(run examples/llmfoundry/prepare.py with one count per data-parallel rank)'
        )
    loader = DataLoader(
        RankShard(file),
        batch_size=int(device_batch_size),
        collate_fn=_collate,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        timeout=timeout,
    )
    return DataSpec(loader, get_num_tokens_in_batch=get_tokens_per_batch_func())


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: a tensor-parallel ``DTensor`` gathered (on every rank alike), else a copy."""
    full = getattr(t, 'full_tensor', None)
    return (full() if callable(full) else t).detach().clone()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


class RunRecord(LoggerDestination):
    """Saves what this rank trained and evaluated to ``<out>/rank<R>.pt`` at the end of ``fit`` (see the module doc)."""

    def __init__(self, out: str):
        self.out = Path(out)
        self.evals: list[dict[str, Any]] = []
        self.trained: list[torch.Tensor] = []

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if self.evals:
            self.evals[-1]['metrics'].update({k: float(v) for k, v in metrics.items() if k.startswith('metrics/eval/')})

    def after_train_batch(self, state: State, logger: Logger) -> None:
        self.trained.append(state.batch['input_ids'].detach().cpu().clone())  # zero rows on a shadow step

    def eval_start(self, state: State, logger: Logger) -> None:
        self.evals.append({'params': _flat(state.model), 'metrics': {}})

    def eval_end(self, state: State, logger: Logger) -> None:
        ce = state.eval_metrics[state.dataloader_label]['LanguageCrossEntropy']
        self.evals[-1]['tokens'] = int(ce.total_items)  # this rank's (torchmetrics keeps local state after compute)

    def fit_end(self, state: State, logger: Logger) -> None:
        model = _unwrap(state.model).model  # the Hugging Face model (MPTForCausalLM) inside Composer's wrapper
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                'samples': int(state.timestamp.sample),
                'batches': int(state.timestamp.batch),
                'state_dict': {k: _full(v) for k, v in model.state_dict().items()},
                'trained': self.trained,
                'config': model.config.to_dict(),
                'evals': self.evals,
            },
            self.out / f'rank{dist.get_global_rank()}.pt',
        )


dataloaders.register('uneven_shards', func=uneven_shards)
loggers.register('run_record', func=RunRecord)
