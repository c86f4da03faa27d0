"""A dataloader that raises on one rank stops every rank under Composer's launcher, without a hang.

The failure falls on a step planned from the lengths (no agreement): the failing rank stops iterating,
Composer's own per-step "exhausted" all-reduce ends the epoch on every rank, and every rank raises. The
launcher would also kill the other ranks once one exits with an error; here each rank raises by itself,
at once: rank 0 names the failing rank and batch, none waits for the 30 s collective timeout.
"""

from __future__ import annotations

import pytest

from test_launcher import BIN, RANKS, ROOT, TIMEOUT, free_port, run

pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def test_a_failing_dataloader_stops_every_rank_under_the_launcher(tmp_path):
    result = run([BIN / 'composer', '-n', RANKS, '--master_port', free_port(),
                  '--stdout', tmp_path / 'rank{rank}.stdout', '--stderr', tmp_path / 'rank{rank}.stderr',
                  ROOT / 'tests' / 'launch_failing_loader.py'], tmp_path)
    rank0, rank1 = result.ranks
    assert result.returncode != 0
    assert 'RuntimeError: disk read error at sample 12' in rank1, rank1[-3000:]
    assert 'UnevenInputsError: rank(s) [1] could not form batch 1 of epoch 0' in rank0, rank0[-3000:]
    for out in result.ranks:
        assert 'finished training' not in out
        assert 'Timed out' not in out and 'DistBackendError' not in out  # nobody waited in a collective
