"""Peak memory, step time and collectives per step of UnevenJoin under FSDP1 and FSDP2, against stock Composer.

    PYTHONPATH=. .venv/bin/python benchmarks/fsdp_memory.py      # ~2 min on 2 CPU cores

Two ranks (gloo, CPU, one thread each), an MLP of 5.3 M parameters (512-2048-2048-10, 21 MB in
fp32), batch 32, microbatch 8, SGD with momentum, one epoch. Every case runs in fresh processes,
so that each rank's peak resident memory (``ru_maxrss``) is its own; the figure is the peak minus
the resident memory at ``FIT_START`` (model and optimizer built, FSDP applied), with glibc's mmap
threshold fixed at 64 KiB so that freed tensors leave the resident set. Step times depend on what
else runs on the machine. Cases:

* ``stock, even``: stock Composer on shards of 256 and 256 samples (8 steps of 4 microbatches);
* ``UnevenJoin, even``: the same with UnevenJoin;
* ``UnevenJoin, uneven``: shards of 256 and 150 (rank 1: 4 full batches, a partial one of 22
  samples = 3 microbatches padded to 4, then 3 shadow steps of 4 two-sample shadow microbatches).

Uses the CPU workarounds of tests/scenarios_fsdp.py (gloo's reduce_scatter AVG, FSDP1's device id).
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tests'))
sys.path.insert(0, str(ROOT / 'benchmarks'))  # also on the ranks, which import this module as benchmarks.fsdp_memory

FEATURES, WIDTH, CLASSES = 512, 2048, 10
CASES = {
    'stock, even': dict(shards=[256, 256], join=False),
    'UnevenJoin, even': dict(shards=[256, 256], join=True),
    'UnevenJoin, uneven': dict(shards=[256, 150], join=True),
}


def fit(wrapper: str, shards: list[int], join: bool) -> dict:
    """One rank of one case (run by tests/harness.py's worker)."""
    import torch
    import torch.nn.functional as F
    from composer import Callback, Trainer
    from composer.models import ComposerModel
    from composer.utils import dist
    from torch.utils.data import DataLoader

    import workloads
    from common import rss_bytes
    from composer_join import CollectiveCounter, UnevenJoin
    from rank_scenarios import ShardWithLen
    from scenarios_fsdp import cpu_fsdp_workarounds, parallelism

    cpu_fsdp_workarounds()
    rank = dist.get_global_rank()

    class MLP(ComposerModel):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.module = torch.nn.Sequential(
                torch.nn.Linear(FEATURES, WIDTH),
                torch.nn.ReLU(),
                torch.nn.Linear(WIDTH, WIDTH),
                torch.nn.ReLU(),
                torch.nn.Linear(WIDTH, CLASSES),
            )

        def forward(self, batch):
            return self.module(batch[0])

        def loss(self, outputs, batch):
            return F.cross_entropy(outputs, batch[1])

    class StartRSS(Callback):
        """The resident set at ``FIT_START`` (model and optimizer built, FSDP applied), MB."""

        mb = 0.0

        def fit_start(self, state, logger):
            self.mb = rss_bytes() / 2**20

    g = torch.Generator().manual_seed(rank)
    n = shards[rank]
    data = ShardWithLen(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    model, start, timer, counter = MLP(), StartRSS(), workloads.StepTimer(), CollectiveCounter()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=32),
        max_duration='1ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        algorithms=[UnevenJoin()] if join else [],
        callbacks=[start, timer, counter],
        device='cpu',
        progress_bar=False,
        log_to_console=False,
        seed=0,
        device_train_microbatch_size=8,
        parallelism_config=parallelism(wrapper, {}),
    )
    trainer.fit()
    trainer.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        'peak_mb': peak - start.mb,
        'step_s': timer.wall,  # from EPOCH_START on; the first step is not reported
        'shadow': timer.shadow,
        'collectives': counter.steps,
    }


def main() -> None:
    from harness import launch

    os.environ['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))
    # A fixed mmap threshold: every tensor above 64 KiB gets its own mapping, returned to the system
    # when freed, so resident memory follows the live tensors instead of glibc's heap high-water mark.
    os.environ.setdefault('MALLOC_MMAP_THRESHOLD_', '65536')
    rows = []
    for wrapper in ('fsdp2', 'fsdp1'):
        for case, cfg in CASES.items():
            res = launch(2, [(case, 'benchmarks.fsdp_memory:fit', dict(wrapper=wrapper, **cfg))], timeout=600)[case]
            steps = res[0]['step_s'][1:]  # the first step includes warm-up
            kinds = sorted({k for r in res for s in r['collectives'] for k in s})
            per_step = ', '.join(f'{k} {res[0]["collectives"][2].get(k, 0)}' for k in kinds)
            last = res[1]['collectives'][-1] if res[1]['shadow'][-1] else None
            median_ms = f'{1000 * sorted(steps)[len(steps) // 2]:.1f}'
            shadow = None if last is None else ', '.join(f'{k} {last.get(k, 0)}' for k in kinds)
            rows.append((wrapper, case, [f'{r["peak_mb"]:.1f}' for r in res], median_ms, per_step, shadow))
            print(rows[-1], flush=True)
    print(
        '\n| wrapper | case | peak memory over FIT_START, rank 0 / rank 1 (MB) | median ms/step | '
        'collectives, step 3 | collectives, a shadow step |'
    )
    print('|---|---|---|---|---|---|')
    for wrapper, case, peaks, ms, per_step, shadow in rows:
        print(f'| {wrapper} | {case} | {" / ".join(peaks)} | {ms} | {per_step} | {shadow or "-"} |')


if __name__ == '__main__':
    main()
