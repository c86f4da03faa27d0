"""One rank of an uneven 4-rank run, under Composer's launcher on one or several "nodes"; run by test_multinode.py.

    composer -n 4 --master_port P tests/multinode_train.py OUT
    composer --world_size 4 --nproc 2 --node_rank 0 --master_addr 127.0.0.1 --master_port P tests/multinode_train.py OUT
    composer --world_size 4 --nproc 2 --node_rank 1 --master_addr 127.0.0.1 --master_port P tests/multinode_train.py OUT

Each rank trains its shard of ``CONFIG`` through Composer's Trainer with UnevenJoin (the same
``rank_scenarios.train`` the in-process tests use) and saves its results to ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from composer.utils import dist

from rank_scenarios import train

# an empty shard, a short one; microbatches of 3 with uneven counts
CONFIG = dict(
    shards=[21, 0, 13, 8],
    batch_size=4,
    epochs=2,
    microbatch=3,
    sync='multi_auto_sync',
    join={'divide_by_initial_world_size': True},
)

if __name__ == '__main__':
    torch.set_num_threads(1)
    result = train(CONFIG)
    keep = ('params', 'optimizer', 'timestamp', 'reports')
    torch.save(
        {k: result[k] for k in keep} | {'node_rank': dist.get_node_rank()},
        Path(sys.argv[1]) / f'rank{dist.get_global_rank()}.pt',
    )
