"""Rank-side scenarios for ranks that differ beyond their data: UnevenJoin's settings, custom DataSpecs, list batches.

Not a test module.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from composer import Trainer
from composer.utils import dist

from composer_join import UnevenInputsError, UnevenJoin
from rank_scenarios import ToyModel, make_loader


def with_settings(per_rank: list[Optional[dict]], shards: list[int], batch_size: int = 4) -> dict[str, Any]:
    """One epoch with ``UnevenJoin(**per_rank[rank])`` on each rank (``None``: no UnevenJoin on that rank).

    Returns the error (``UnevenInputsError``'s message, or another error's type and message), the
    steps trained and the seconds from the start of ``fit`` to the error.
    """
    rank = dist.get_global_rank()
    model = ToyModel('mlp')
    settings = per_rank[rank]
    cfg = dict(shards=shards, batch_size=batch_size)
    trainer = Trainer(model=model, train_dataloader=make_loader(cfg, rank), max_duration='1ep',
                      algorithms=[UnevenJoin(**settings)] if settings is not None else [],
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.1), device='cpu', progress_bar=False,
                      log_to_console=False)
    start = time.monotonic()
    error: Optional[str] = None
    try:
        trainer.fit()
    except UnevenInputsError as e:
        error = str(e)
    except Exception as e:  # what a rank without UnevenJoin sees
        error = f'{type(e).__name__}: {e}'
    seconds = time.monotonic() - start
    # printed too: where a rank aborts, the launch returns no results, only every rank's output
    print(f'rank {rank} stopped after {seconds:.2f} s at batch {int(trainer.state.timestamp.batch)}: {error}', flush=True)
    try:
        trainer.close()
    except RuntimeError:  # a barrier, where another rank has died
        pass
    return {'error': error, 'batch': int(trainer.state.timestamp.batch), 'seconds': seconds}
