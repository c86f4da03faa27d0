"""The host collective of FSDP's used-unit check (``GradientUnits.check``), per microbatch: gloo's all-reduce against
the pairwise sum (recursive doubling) that ``TorchExchange.host_sum`` uses from ``PAIRWISE_FROM`` ranks on.

    PYTHONPATH=. .venv/bin/python benchmarks/fsdp_check.py      # ~20 s on 2 CPU cores

On 2 and 3 ranks (gloo, CPU, one thread each, one launch at a time), for payloads of ``units + 1`` int32 (17 and 257),
each way is called ``--calls`` times in a row, as the check calls it once per microbatch: ``before`` is the check's
former call (``TorchExchange.reduce``, gloo's ring all-reduce), ``ring`` is ``host_sum`` under ``PAIRWISE_FROM``
(the same all-reduce, on a copy), ``pairwise`` is ``host_sum`` forced to recursive doubling. Per call: this rank's
CPU time (``time.thread_time``) and wall time, the median over ranks of each rank's median over three rounds of the
calls. Every call's sum is checked against the exact sum on every rank. The graph walk and the pre-hooks of the
check are unchanged and not timed here (docs/benchmarks.md, "At scale").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tests'))
sys.path.insert(0, str(ROOT / 'benchmarks'))

PAYLOADS = (17, 257)


def timed(calls: int, rounds: int = 3) -> dict:
    """One rank: every way, every payload; ``{(way, payload): (cpu_s, wall_s)}`` per call (medians over rounds)."""
    import torch
    from composer.utils import dist

    from composer_join.core.catalogue import FSDP_UNITS
    from composer_join.core.exchange import TorchExchange

    rank, world = dist.get_global_rank(), dist.get_world_size()
    exchange = TorchExchange()
    said = FSDP_UNITS.said('the benchmark of the FSDP unit check')
    ways = {
        'before': lambda v: exchange.reduce(v.clone(), 'sum', said),
        'ring': lambda v: exchange.host_sum(v, said, pairwise_from=world + 1),
        'pairwise': lambda v: exchange.host_sum(v, said, pairwise_from=1),
    }
    out: dict = {}
    for payload in PAYLOADS:
        gen = torch.Generator().manual_seed(payload)
        every = torch.randint(0, 2, (world, payload), dtype=torch.int32, generator=gen)
        exact = every.sum(0)
        mine = every[rank].clone()
        for way, call in ways.items():
            for _ in range(20):  # warm up; and the ranks meet
                assert torch.equal(call(mine), exact)
            cpu, wall = [], []
            for _ in range(rounds):
                c0, w0 = time.thread_time(), time.perf_counter()
                for _ in range(calls):
                    got = call(mine)
                cpu.append((time.thread_time() - c0) / calls)
                wall.append((time.perf_counter() - w0) / calls)
                assert torch.equal(got, exact), (way, payload)
            out[f'{way} {payload}'] = (statistics.median(cpu), statistics.median(wall))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--calls', type=int, default=500)
    args = parser.parse_args()
    from common import launch

    for world in (2, 3):
        res = launch(world, [('check', 'benchmarks.fsdp_check:timed', {'calls': args.calls})], timeout=300)['check']
        print(f'\nW = {world} ({args.calls} calls per round)')
        print('| way | payload (int32) | CPU per call | wall per call |')
        print('|---|---|---|---|')
        for key in res[0]:
            way, payload = key.split()
            cpu = statistics.median(r[key][0] for r in res)
            wall = statistics.median(r[key][1] for r in res)
            print(f'| {way} | {payload} | {cpu * 1e6:.0f} us | {wall * 1e6:.0f} us |')


if __name__ == '__main__':
    main()
