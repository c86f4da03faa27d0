"""Failover under real launchers (issue 42), ``make test-failover``: not in ``make test`` (about a minute per run).

* **Two torchrun agents as two nodes**, without a person: agent A (2 workers) and agent B (1 worker) on this machine,
  ``--nnodes=1:2``, c10d rendezvous on 127.0.0.1, ``--max-restarts=2``; at epoch 0 batch 2 node B's worker kills
  its agent and itself with SIGKILL (a node lost). A's workers fail on the lost peer, A's agent re-forms the group
  alone and restarts them, and ``autoresume`` resumes the latest checkpoint on 2 ranks. Run ``TRIES`` times (10,
  ``COMPOSER_JOIN_FAILOVER_TRIES``): every try must finish with every sample trained once per epoch and the final
  weights equal to a single-process replay of the steps that reached a checkpoint. The launch settings that make
  this work every time (docs/reliability.md, *Failover*): ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents'
  environment (with torch's default, the restarted workers reuse the first round's store and its stale keys),
  the rendezvous store hosted by the agent that survives (``is_host``), and shorter rendezvous timeouts
  (:data:`RDZV_CONF`).
* **One node, torchrun**: ``--standalone --nproc-per-node=2 --max-restarts=1``, rank 1 killed; the agent restarts both
  workers and ``autoresume`` goes on from the latest checkpoint (same world size, exact). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  here too; without ``--standalone`` (torchrun's static rendezvous) the store is always shared and the restarted
  workers fail (``Gloo connectFullMesh failed``).
* **Composer's launcher**: ``composer -n 3``, rank 2 killed; ``composer -n 2`` relaunched by hand (the command a
  person or a scheduler runs).
* ``examples/train.py`` under torchrun with ``autoresume=True``: ``launcher_compat`` supplies ``NODE_RANK``
  (without it, every rank raises ``MissingEnvironmentError`` in ``Trainer()``).

Every launch runs in its own session with a hard timeout; whatever is left of it (torchrun's workers run in
sessions of their own) is killed at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from harness import free_port
from pipeline_data import replay
from reference import max_abs_diff
from scenarios_failover import merged, read_records

pytestmark = pytest.mark.agents  # deselected by default (pyproject's addopts); make test-failover selects them

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'tests' / 'failover_train.py'
BIN = Path(sys.executable).parent
TRIES = int(os.environ.get('COMPOSER_JOIN_FAILOVER_TRIES', '10'))
TIMEOUT = 420  # seconds per try; 60-90 s on the loaded 2 cores
SIZE = 41  # failover_train.py's CFG: 41 ids, ExactDistributedSampler, batches of 4
# B's heartbeat expires after keep_alive_interval * keep_alive_max_attempt = 6 s (default 15 s); a round with one node
# closes last_call_timeout = 5 s after it joined (default 30 s)
RDZV_CONF = 'keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=5'
AGENT_ENV = {'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1'}
KILL_NODE_B = {'kill': {'node': 'B', 'at': [0, 2]}}


def start(cmd: list, out: Path, log: str, env: Optional[dict] = None) -> subprocess.Popen:
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(ROOT), **(env or {})},
        stdout=open(out / log, 'w'),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(main: subprocess.Popen, out: Path, others: tuple = ()) -> Any:
    """Wait for ``main`` (hard timeout), then kill every process of the run: the launchers' sessions, and any
    process whose command line names ``out`` (torchrun's workers run in sessions of their own)."""
    try:
        return main.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return 'timeout'
    finally:
        for proc in (main, *others):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in (int(p) for p in os.listdir('/proc') if p.isdigit()):
            try:
                args = Path(f'/proc/{pid}/cmdline').read_bytes().split(b'\0')
            except OSError:
                continue
            if str(out).encode() in args and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def torchrun(options: list, nproc: int) -> list:
    return [sys.executable, '-m', 'torch.distributed.run', f'--nproc-per-node={nproc}', *options]


def check_every_sample_once(out: Path, finals: int) -> list[dict]:
    """Every id once per epoch across the attempts; the final ranks identical and equal to the replay. The attempts."""
    attempts = read_records(str(out))
    steps = merged(attempts)
    for epoch in (0, 1):
        trained = Counter(i for e, parts in steps if e == epoch for part in parts for i in part)
        assert trained == Counter(range(SIZE)), (
            f'epoch {epoch}: twice {sorted((trained - Counter(range(SIZE))).elements())}, '
            f'never {sorted(set(range(SIZE)) - set(trained))}'
        )
    reference = replay([parts for _, parts in steps])
    for rank in range(finals):
        diff = max_abs_diff(torch.load(out / f'final-rank{rank}.pt'), reference)
        assert diff < 1e-5, f'rank {rank} is {diff:.2e} from the single-process replay'
    return attempts


def killed_at(out: Path) -> float:
    assert (out / 'killed').exists(), 'nothing was killed'
    return float((out / 'killed').read_text().split()[0])


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize('attempt', range(TRIES))
def test_two_agents_node_b_killed_node_a_goes_on_with_fewer(tmp_path, attempt, capsys):
    port = free_port()
    common = [
        '--rdzv-backend=c10d',
        f'--rdzv-endpoint=127.0.0.1:{port}',
        '--rdzv-id=failover',
        '--max-restarts=2',
        '--monitor-interval=0.5',
    ]
    args = [SCRIPT, tmp_path, json.dumps(KILL_NODE_B)]
    began = time.time()
    a = start(
        [*torchrun(['--nnodes=1:2', *common, f'--rdzv-conf={RDZV_CONF},is_host=1'], 2), *args],
        tmp_path,
        'agentA.log',
        {**AGENT_ENV, 'FAILOVER_NODE': 'A', 'LOGLEVEL': 'INFO'},  # INFO: the rendezvous rounds in its log
    )
    b = start(
        [*torchrun(['--nnodes=1:2', *common, f'--rdzv-conf={RDZV_CONF},is_host=0'], 1), *args],
        tmp_path,
        'agentB.log',
        {**AGENT_ENV, 'FAILOVER_NODE': 'B'},
    )
    returncode = finish(a, tmp_path, (b,))
    ended = time.time()
    log = (tmp_path / 'agentA.log').read_text(errors='replace')
    assert returncode == 0, f'agent A: {returncode}\n{log[-6000:]}'
    kill = killed_at(tmp_path)
    attempts = check_every_sample_once(tmp_path, finals=2)
    assert [a['world'] for a in attempts][-1] == 2, attempts  # A's two workers finished it
    with capsys.disabled():
        print(
            f'\n[failover try {attempt}] {ended - began:.0f} s in all, {ended - kill:.0f} s after the kill '
            f"({regrouped(log)} from A's workers failing to its new round); attempts (world, resumed at batch): "
            f'{[(a["world"], a["start"]) for a in attempts]}; load {os.getloadavg()[0]:.1f}'
        )


def regrouped(log: str) -> str:
    """Seconds from the agent's "Worker group FAILED" to the rendezvous of its first restart, from its log."""
    stamps = {}
    for line in log.splitlines():
        for key, mark in (('failed', 'Worker group FAILED'), ('round', 'restart_count=1')):
            if mark in line and key not in stamps:
                stamps[key] = datetime.datetime.strptime(line.split()[1], '%H:%M:%S.%f')
    return f'{(stamps["round"] - stamps["failed"]).total_seconds():.1f} s' if len(stamps) == 2 else '?'


@pytest.mark.timeout(TIMEOUT + 60)
def test_torchrun_one_node_restarts_its_workers_after_a_kill(tmp_path):
    kill = json.dumps({'kill': {'rank': 1, 'at': [0, 2]}})
    cmd = [*torchrun(['--standalone', '--max-restarts=1'], 2), SCRIPT, tmp_path, kill]
    returncode = finish(start(cmd, tmp_path, 'torchrun.log', AGENT_ENV), tmp_path)
    assert returncode == 0, (tmp_path / 'torchrun.log').read_text(errors='replace')[-6000:]
    killed_at(tmp_path)
    attempts = check_every_sample_once(tmp_path, finals=2)
    assert [a['world'] for a in attempts] == [2, 2], attempts


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_composer_launcher_relaunched_on_fewer_ranks(tmp_path):
    kill = json.dumps({'kill': {'rank': 2, 'at': [0, 2]}})
    first = start([BIN / 'composer', '-n', 3, '--master_port', free_port(), SCRIPT, tmp_path, kill], tmp_path, 'n3.log')
    assert finish(first, tmp_path) != 0  # its ranks stopped on the lost peer
    killed_at(tmp_path)
    second = start([BIN / 'composer', '-n', 2, '--master_port', free_port(), SCRIPT, tmp_path], tmp_path, 'n2.log')
    assert finish(second, tmp_path) == 0, (tmp_path / 'n2.log').read_text(errors='replace')[-6000:]
    attempts = check_every_sample_once(tmp_path, finals=2)
    assert [a['world'] for a in attempts] == [3, 2], attempts


@pytest.mark.timeout(TIMEOUT + 60)
def test_examples_train_runs_under_torchrun_with_autoresume(tmp_path):
    overrides = [
        'trainer.max_duration=1ep',
        'trainer.autoresume=true',
        'trainer.run_name=torchrun-autoresume',
        f'trainer.save_folder={tmp_path / "ckpt"}',
    ]
    cmd = [
        *torchrun(['--standalone'], 2),
        ROOT / 'examples' / 'train.py',
        ROOT / 'configs' / 'digits_uneven.yaml',
        *overrides,
    ]
    returncode = finish(start(cmd, tmp_path, 'torchrun.log'), tmp_path)
    output = (tmp_path / 'torchrun.log').read_text(errors='replace')
    assert returncode == 0, output[-6000:]
    assert 'final metrics: ' in output and 'MissingEnvironmentError' not in output
