"""One rank of a failover run under a real launcher; run by tests/test_failover_agents.py.

    composer -n 3 --master_port P tests/failover_train.py OUT '{"kill": {"rank": 2, "at": [0, 2]}}'
    composer -n 2 --master_port P tests/failover_train.py OUT          # the relaunch, on fewer ranks
    FAILOVER_NODE=B torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:P \\
        --max-restarts=2 tests/failover_train.py OUT '{"kill": {"node": "B", "at": [0, 2]}}'

``OUT`` holds the checkpoints (``OUT/ckpt``), every process's records (``OUT/records``) and, once a launch has
finished the run, every rank's final parameters (``OUT/final-rank<r>.pt``) or, where its fit raised, its error
(``OUT/error-rank<r>.txt``). The JSON argument: ``cfg`` (``scenarios_failover``'s, default 41 ids, batches of 4,
``ExactDistributedSampler``), ``kill`` (``scenarios_failover.Kill``'s), ``dist_timeout`` (s). The Trainer is built
inside ``composer_join.launcher_compat()``, as a torchrun script must (``NODE_RANK``, per-node signal files).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from composer.utils import dist

import scenarios_failover

CFG = dict(sampler='exact', size=41, batch_size=4)

if __name__ == '__main__':
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    timeout = args.get('dist_timeout', 60)
    dist.initialize_dist('cpu', timeout=timeout)  # as Trainer() would; the samplers need the world size first
    result = scenarios_failover.fit(
        {**CFG, **args.get('cfg', {})}, str(out), kill=args.get('kill'), dist_timeout=timeout
    )
    rank = dist.get_global_rank()
    if result['error'] is not None:
        (out / f'error-rank{rank}.txt').write_text(f'{time.time()} {result["error"][0]}: {result["error"][1]}')
        sys.exit(1)
    torch.save(result['params'], out / f'final-rank{rank}.pt')
