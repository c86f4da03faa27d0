"""A rank that fails never leaves the others hanging, under Composer's launcher and under torchrun.

``tests/failing_rank.py`` trains 2 uneven ranks with ``dist_timeout=10`` s and makes one rank
fail: an exception in its dataloader, its forward or a callback, or SIGKILL, at a step where both
ranks have data or in the tail, where one rank shadows. The other rank must stop with an error
(or be stopped by the launcher) and the launch must exit non-zero, within the distributed timeout
plus a margin for tearing processes down; it must never finish training as if nothing happened.
Every launch has a hard timeout and is killed with its process group.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from harness import free_port
from test_launcher import run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'tests' / 'failing_rank.py'
BIN = Path(sys.executable).parent
DIST_TIMEOUT = 10.0  # as in failing_rank.py
RAISE_MARGIN = 5.0  # the other rank raises within DIST_TIMEOUT + this after the failure
EXIT_MARGIN = 40.0  # the launch has exited within DIST_TIMEOUT + this (process teardown on a loaded machine)
HARD_TIMEOUT = 240  # seconds per launch; a normal one takes 10-20 s on 2 idle cores

pytestmark = pytest.mark.timeout(HARD_TIMEOUT + 30)


def launch(launcher: str, where: str, when: str, out: Path) -> tuple[int, float, str]:
    """Run the script under ``launcher``; return its exit status, its exit time and its output."""
    port = str(free_port())
    args = [SCRIPT, where, when, out]
    if launcher == 'composer':
        cmd = [BIN / 'composer', '-n', '2', '--master_port', port, *args]
    else:
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', port, *args]
    result = run(cmd, timeout=HARD_TIMEOUT)  # kills the launch's process group on a hang, and fails
    return result.returncode, time.time(), result.ranks[0]


@pytest.mark.parametrize(
    ('launcher', 'where', 'when'),
    [
        ('composer', 'dataloader', 'step'),  # a step planned from the lengths: Composer's exhausted flag stops both
        ('composer', 'sigkill', 'tail'),
        ('torchrun', 'callback', 'tail'),
        ('torchrun', 'dataloader', 'tail'),
    ],
)
def test_a_failing_rank_stops_every_rank(launcher, where, when, tmp_path):
    returncode, ended, output = launch(launcher, where, when, tmp_path)
    assert (tmp_path / 'failed.txt').exists(), f'the failure was not injected; output:\n{output[-4000:]}'
    failed_at = float((tmp_path / 'failed.txt').read_text().split()[0])
    assert returncode != 0, output[-4000:]
    reports = {r: (tmp_path / f'rank{r}.txt').read_text() for r in range(2) if (tmp_path / f'rank{r}.txt').exists()}
    assert not any(text.split(' ', 1)[1] == 'ok' for text in reports.values()), reports
    for rank, text in reports.items():  # a rank that was not killed by the launcher first stopped with an error
        at, message = text.split(' ', 1)
        assert float(at) - failed_at < DIST_TIMEOUT + RAISE_MARGIN, (rank, float(at) - failed_at, message)
    assert ended - failed_at < DIST_TIMEOUT + EXIT_MARGIN, (
        f'{launcher} exited {ended - failed_at:.1f} s after the failure'
    )
    if where == 'dataloader':  # every rank raises at the same step, with a reason
        batch = 2 if when == 'step' else 4  # the loader fetches a step ahead
        assert 'UnevenInputsError' in reports[0] and f'rank(s) [1] could not form batch {batch}' in reports[0], reports
        assert 'injected failure in the dataloader' in reports[1]
