"""The benchmark runs end to end (its --quick smoke mode); its figures live in the README, not in asserts."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_benchmark_quick_run_writes_tables_and_chart(tmp_path):
    subprocess.run(
        [sys.executable, 'benchmarks/run.py', '--quick', '--out', str(tmp_path)],
        cwd=ROOT,
        check=True,
        timeout=240,
        capture_output=True,
    )
    results = (tmp_path / 'results.md').read_text()
    assert '## 1. Overhead on even inputs' in results and '## 2. Uneven inputs' in results
    assert (tmp_path / 'results.png').stat().st_size > 10_000
