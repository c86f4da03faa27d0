"""``examples/train.py`` under Composer's launcher (2 ranks, gloo on CPU) and as a single process.

Every run has a hard timeout: on expiry the launcher's whole process group (launcher and ranks) is
killed and the test fails. Each launch gets its own free port. Rank 0's output is the launcher's own
(it passes rank 0 through); the other ranks' are read from the per-rank files ``--stdout``/``--stderr``
name.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from composer_join.config.config import build_one, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / 'configs'
TRAIN = ROOT / 'examples' / 'train.py'
BIN = Path(sys.executable).parent
RANKS = 2
TIMEOUT = 150  # seconds per run; a normal run takes 10-30 s on 2 cores
ENV = {**os.environ, 'OMP_NUM_THREADS': '1'}  # one thread per rank, as torchrun sets it: 2 ranks share 2 cores

sys.path.insert(0, str(ROOT / 'examples'))
from data import DATASETS  # noqa: E402

pytestmark = pytest.mark.timeout(TIMEOUT + 30)

# Each shipped config, shortened to run in seconds, and whether it should train to the end.
SHIPPED = {
    'digits_uneven.yaml': (['trainer.max_duration=1ep'], True),
    'digits_microbatch.yaml': (['trainer.max_duration=1ep'], True),
    'digits_throw.yaml': (['trainer.max_duration=1ep'], False),
    'text_token_budget.yaml': (
        ['trainer.max_duration=1ep', 'data.pydoc_text.fraction=0.1', 'data.pydoc_text.eval_sequences=32'],
        True,
    ),
}
SUMMARY = re.compile(r'rank (\d+): (\d+) real batches, (\d+) shadow steps, (\d+) samples')


@dataclass
class Run:
    returncode: int
    ranks: list[str]  # each rank's output (stdout and stderr)


def run(cmd: list[str], logs: Path | None = None, timeout: float = TIMEOUT) -> Run:
    """Run ``cmd`` in its own process group with a hard timeout; collect rank 0's and the per-rank files' output."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f'no result after {timeout} s (a hang?); killed. Output:\n{out[-6000:]}')
    finally:
        try:  # no rank outlives its test
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    others = (
        []
        if logs is None
        else [
            ''.join(p.read_text() for p in (logs / f'rank{r}.stdout', logs / f'rank{r}.stderr') if p.exists())
            for r in range(1, RANKS)
        ]
    )
    return Run(proc.returncode, [out, *others])


def launch(tmp_path: Path, config: str, *overrides: str) -> Run:
    """``composer -n 2 --master_port <free> examples/train.py configs/<config> <overrides>``."""
    cmd = [
        BIN / 'composer',
        '-n',
        RANKS,
        '--master_port',
        free_port(),
        '--stdout',
        tmp_path / 'rank{rank}.stdout',
        '--stderr',
        tmp_path / 'rank{rank}.stderr',
        TRAIN,
        CONFIGS / config,
        *overrides,
    ]
    return run(cmd, tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def expected_batches(config: str, overrides: list[str], monkeypatch) -> list[int]:
    """Per rank, the train batches per epoch its shard of ``config`` holds in a 2-rank run."""
    data = load_config(CONFIGS / config, overrides).data
    monkeypatch.setenv('WORLD_SIZE', str(RANKS))
    counts = []
    for rank in range(RANKS):
        monkeypatch.setenv('RANK', str(rank))
        counts.append(len(build_one(DATASETS, data, 'data').train))
    return counts


def test_every_shipped_config_is_launched():
    assert sorted(SHIPPED) == sorted(p.name for p in CONFIGS.glob('*.yaml'))


@pytest.mark.parametrize('config', [c for c, (_, ok) in SHIPPED.items() if ok])
def test_shipped_config_trains_on_two_ranks(config, tmp_path, monkeypatch):
    overrides, _ = SHIPPED[config]
    result = launch(tmp_path, config, *overrides)
    rank0 = result.ranks[0]
    assert result.returncode == 0, rank0[-6000:]

    # The resolved config, printed by rank 0 only.
    assert 'trainer:\n' in rank0 and '${' not in rank0.split('UnevenJoin,')[0]
    assert all('trainer:\n' not in out for out in result.ranks[1:])

    # The summary: per rank, every batch of its own shard trained; the shorter ranks shadowed the rest.
    batches = expected_batches(config, overrides, monkeypatch)
    assert len(set(batches)) > 1, f'{config}: shards should be uneven, got {batches}'
    reported = {int(r): (int(b), int(s)) for r, b, s, _ in SUMMARY.findall(rank0)}
    assert reported == {r: (n, max(batches) - n) for r, n in enumerate(batches)}, rank0[-3000:]
    assert re.search(r'final metrics: .*eval/\w+ \d+\.\d+', rank0)


def test_throw_on_early_termination_stops_every_rank(tmp_path):
    overrides, ok = SHIPPED['digits_throw.yaml']
    assert not ok
    result = launch(tmp_path, 'digits_throw.yaml', *overrides)
    assert result.returncode != 0
    for rank, out in enumerate(result.ranks):
        assert f'[rank {rank}] stopped with UnevenInputsError: ' in out, out[-3000:]
    assert not SUMMARY.search(result.ranks[0])


# Three mistakes in one launch: the config is checked whole, so every rank reports all three at once.
BAD_CONFIG = {
    'unknown-key': (
        'trainer.max_duraton=1ep',
        "trainer.max_duraton: unknown argument of Trainer; did you mean 'max_duration'?",
    ),
    'wrong-type': ('trainer.progress_bar=maybe', "trainer.progress_bar: expected bool, got 'maybe' (str)"),
    'unknown-algorithm': (
        'algorithms=[uneven_join,uneven_jion]',
        "algorithms[1]: unknown algorithm 'uneven_jion'; did you mean 'uneven_join'? allowed: alibi, ",
    ),
}


@pytest.fixture(scope='module')
def bad_config_run(tmp_path_factory) -> Run:
    return launch(tmp_path_factory.mktemp('bad-config'), 'digits_uneven.yaml', *(o for o, _ in BAD_CONFIG.values()))


def test_bad_config_stops_every_rank_before_training(bad_config_run):
    result = bad_config_run
    assert result.returncode == 2, result.ranks[0][-3000:]
    for rank, out in enumerate(result.ranks):
        assert f'[rank {rank}] invalid config ({len(BAD_CONFIG)} problems):\n  ' in out, out[-3000:]
        assert 'Traceback' not in out
    assert not SUMMARY.search(result.ranks[0])


@pytest.mark.parametrize('mistake', list(BAD_CONFIG))
def test_every_mistake_in_a_bad_config_is_named_on_every_rank(bad_config_run, mistake):
    _, message = BAD_CONFIG[mistake]
    for rank, out in enumerate(bad_config_run.ranks):
        problems = out.split(f'[rank {rank}] invalid config (')[-1]
        assert f'\n  {message}' in problems, out[-3000:]


def test_same_script_runs_as_a_single_process():
    result = run([sys.executable, TRAIN, CONFIGS / 'digits_uneven.yaml', 'trainer.max_duration=1ep'])
    out = result.ranks[0]
    assert result.returncode == 0, out[-6000:]
    assert 'run_name: digits-uneven-seed17' in out
    assert 'UnevenJoin: not active (a single rank, or not in algorithms:)' in out
    assert re.search(r'final metrics: .*eval/MulticlassAccuracy \d+\.\d+', out)
