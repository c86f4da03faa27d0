"""Two launcher invocations on this machine ("nodes" of 2 ranks each) train an uneven run exactly like one 4-rank launch.

``composer --world_size 4 --nproc 2 --node_rank 0|1 --master_addr 127.0.0.1`` starts two nodes
that meet through the same master port. They must end with the single-process reference's weights,
and with the same weights, optimizer state, timestamps and epoch reports as one 4-rank run on one
node (``tests/harness.launch``: the same ``rank_scenarios.train``, ranks forked from its server,
which spares a third launcher start; ``tests/test_launcher.py`` covers ``composer -n``). Every launch
has a hard timeout and is killed with its process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reference
from harness import free_port, launch
from multinode_train import CONFIG

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'tests' / 'multinode_train.py'
COMPOSER = Path(sys.executable).parent / 'composer'
HARD_TIMEOUT = 240  # seconds per launch; ~15 s on 2 idle cores

pytestmark = pytest.mark.timeout(2 * HARD_TIMEOUT + 30)


def start(args: list, out: Path) -> subprocess.Popen:
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    return subprocess.Popen(
        [str(a) for a in [COMPOSER, *args, SCRIPT, out]],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(procs: list[subprocess.Popen]) -> None:
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=HARD_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f'a launch did not finish within {HARD_TIMEOUT} s (a hang?)')
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]


def load(out: Path) -> list[dict]:
    return [torch.load(out / f'rank{r}.pt', weights_only=False) for r in range(4)]


def test_two_nodes_train_like_one(tmp_path):
    two = tmp_path / 'two'
    two.mkdir()
    single = launch(4, [('one_node', 'train', {'cfg': CONFIG})], timeout=HARD_TIMEOUT)['one_node']
    assert all(isinstance(r, dict) for r in single), single
    port = free_port()
    node = ['--world_size', 4, '--nproc', 2, '--master_addr', '127.0.0.1', '--master_port', port]
    finish([start([*node, '--node_rank', 0], two), start([*node, '--node_rank', 1], two)])

    multi = load(two)
    assert [r['node_rank'] for r in multi] == [0, 0, 1, 1]
    ref = reference.train(CONFIG)
    for rank in range(4):
        assert reference.max_abs_diff(multi[rank]['params'], ref['params']) < 1e-5, rank
        assert reference.max_abs_diff(multi[rank]['params'], single[rank]['params']) < 1e-6, rank
        assert torch.allclose(multi[rank]['optimizer'], single[rank]['optimizer'], atol=1e-6, rtol=0), rank
        assert multi[rank]['timestamp'] == single[rank]['timestamp'], rank
        assert multi[rank]['reports'] == single[rank]['reports'], rank
    assert multi[0]['timestamp']['sample'] == sum(CONFIG['shards']) * CONFIG['epochs']
