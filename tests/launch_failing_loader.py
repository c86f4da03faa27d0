"""Run under Composer's launcher by tests/test_failure_launcher.py: rank 1's dataloader raises at batch 1.

Batch 1 is a step planned from the lengths (both ranks have 5 batches), so no agreement carries the failure;
every rank must still stop with an error. The process group's timeout is 30 s. Not a test module.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from composer.utils import dist  # noqa: E402

import rank_scenarios  # noqa: E402

if __name__ == '__main__':
    dist.initialize_dist('cpu', timeout=30)
    rank_scenarios.train(dict(shards=[40, 40], batch_size=8, epochs=1, join={}, fail_at={1: 12}))
    print(f'[rank {dist.get_global_rank()}] finished training', flush=True)
