"""``make test-gpu`` and ``make bench-gpu`` stop with a clear message where there are fewer than two GPUs.

Both first run ``tests/devices.py 2 '<target>'``; here it runs with no GPU visible. The harness, asked for
GPU ranks it does not have, starts no process and reports why (the tests then skip those scenarios).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import devices
import harness

SCRIPT = Path(devices.__file__)


def test_fewer_than_two_gpus_stops_with_a_clear_message():
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': ''}
    done = subprocess.run([sys.executable, str(SCRIPT), '2', 'make test-gpu'], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ('make test-gpu needs at least 2 CUDA GPUs (NCCL needs one GPU per rank), but this '
                                   'machine has 0. Run the CPU versions instead (make test, make bench: gloo on CPU).')
    assert done.stdout == ''


def test_enough_gpus_passes_silently_and_one_is_not_enough():
    assert devices.too_few_gpus(2, 'make bench-gpu', found=2) is None
    assert 'make bench-gpu needs at least 2 CUDA GPUs' in devices.too_few_gpus(2, 'make bench-gpu', found=1)


def test_the_device_variable_is_checked(monkeypatch):
    monkeypatch.setenv(devices.ENV, 'tpu')
    with pytest.raises(ValueError, match="COMPOSER_JOIN_DEVICE='tpu': allowed values are cpu, gpu"):
        devices.device()


def test_gpu_launch_without_enough_gpus_runs_nothing(monkeypatch):
    monkeypatch.setenv(devices.ENV, 'gpu')
    monkeypatch.setattr(devices, 'gpu_count', lambda: 1)
    results = harness.launch(2, [('a', 'train', {}), ('b', 'train', {})], timeout=30)
    assert set(results) == {'a', 'b'}
    for per_rank in results.values():
        assert [e.type for e in per_rank] == ['NotEnoughGPUs'] * 2
        assert 'a 2-rank launch needs at least 2 CUDA GPUs' in per_rank[0].message and 'has 1' in per_rank[0].message
