"""A 2-rank uneven training run in which one rank fails on purpose; run under a launcher by test_failing_rank.py.

    composer -n 2 --master_port P tests/failing_rank.py WHERE WHEN OUT
    python -m torch.distributed.run --nproc_per_node 2 --master_port P tests/failing_rank.py WHERE WHEN OUT

WHERE is how the failing rank fails: ``dataloader`` (its dataset raises), ``forward`` (its model
raises), ``callback`` (a callback raises at BATCH_END), ``sigkill`` (it kills itself with SIGKILL).
WHEN is ``step``: rank 1 fails at step 1, while both ranks have data; or ``tail``: at step 3, where
rank 0 has run out and shadows (rank 0 has 2 batches, rank 1 has 6). A dataloader fails while
fetching batch ``step + 1`` (the loader fetches a step ahead), a callback at the end of the step. The failing rank is rank 1,
except ``tail`` with ``forward``/``callback``/``sigkill``, where it is the shadowing rank 0 (a
shadowing rank does not read data, so ``dataloader`` in the tail fails rank 1, the one with data;
nor does it run its model, so ``forward``/``sigkill`` in the tail fail at its ``BEFORE_FORWARD``).

Every rank writes ``OUT/rank{r}.txt`` when it leaves ``fit`` (``ok`` or the exception's type and
message, and the time), and the failing rank writes ``OUT/failed.txt`` with the time it failed,
so the test can measure how long the other rank took to stop. ``dist_timeout`` is 10 s.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from composer import Callback, Trainer
from composer.utils import dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
import devices
from composer_join import UnevenJoin, is_shadow_step
from rank_scenarios import ShardWithLen, ToyModel
from toy import shard

DIST_TIMEOUT = 10.0
SHARDS = [8, 24]  # batches of 4: rank 0 has 2, rank 1 has 6


def fail_now(out: Path, where: str) -> None:
    (out / 'failed.txt').write_text(f'{time.time()} {where}')
    if where == 'sigkill':
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f'injected failure in the {where}')


class FailingShard(ShardWithLen):
    def __init__(self, x, y, at_sample, out):
        super().__init__(x, y)
        self.at_sample, self.out = at_sample, out

    def __iter__(self):
        for i, sample in enumerate(zip(self.x, self.y)):
            if i == self.at_sample:
                fail_now(self.out, 'dataloader')
            yield sample


class FailingModel(ToyModel):
    def __init__(self, at_step, out, where):
        super().__init__('mlp')
        self.at_step, self.out, self.where = at_step, out, where
        self.state = None

    def forward(self, batch):
        if self.state is not None and int(self.state.timestamp.batch) == self.at_step:
            fail_now(self.out, self.where)
        return super().forward(batch)


class FailAt(Callback):
    def __init__(self, model, at_step, out, where):
        self.model, self.at_step, self.out, self.where = model, at_step, out, where

    def fit_start(self, state, logger):
        self.model.state = state

    def before_forward(self, state, logger):
        # a shadowing rank runs no model code under DDP (docs/shadow-steps.md): it fails here, at the
        # BEFORE_FORWARD of its shadow step, instead of in its model's forward
        if (
            self.where in ('forward', 'sigkill')
            and int(state.timestamp.batch) == self.at_step
            and is_shadow_step(state)
        ):
            fail_now(self.out, self.where)

    def batch_end(self, state, logger):
        if self.where == 'callback' and int(state.timestamp.batch) == self.at_step + 1:
            fail_now(self.out, self.where)


def main(where: str, when: str, out: Path) -> None:
    rank = int(os.environ['RANK'])
    torch.set_num_threads(1)
    step = 1 if when == 'step' else 3
    failing = 1 if when == 'step' or where == 'dataloader' else 0
    mine = rank == failing
    x, y = shard(rank, SHARDS[rank])
    dataset = FailingShard(x, y, 4 * (step + 1), out) if mine and where == 'dataloader' else ShardWithLen(x, y)
    model = FailingModel(step if mine and where in ('forward', 'sigkill') else -1, out, where)
    callback = FailAt(model, step if mine else -1, out, where)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(dataset, batch_size=4),
        max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[UnevenJoin()],
        callbacks=[callback],
        device=devices.trainer_device(),
        dist_timeout=DIST_TIMEOUT,
        progress_bar=False,
        log_to_console=False,
    )
    try:
        trainer.fit()
    except BaseException as e:
        (out / f'rank{dist.get_global_rank()}.txt').write_text(f'{time.time()} {type(e).__name__}: {e}'[:2000])
        raise
    (out / f'rank{dist.get_global_rank()}.txt').write_text(f'{time.time()} ok')


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
