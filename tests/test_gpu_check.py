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
    done = subprocess.run(
        [sys.executable, str(SCRIPT), '2', 'make test-gpu'], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        'make test-gpu needs at least 2 CUDA GPUs (NCCL needs one GPU per rank), but this '
        'machine has 0. Run the CPU versions instead (make test, make bench: gloo on CPU).'
    )
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


# -- make test-gpu / make bench-gpu (tests/gpu_suite.py): selection, summary, bench with too few GPUs --------

import gpu_suite  # noqa: E402

ROOT = SCRIPT.parents[1]
PRESENT = gpu_suite.EVERY + ['test_config.py']


def test_two_or_more_gpus_run_every_distributed_test_file_over_nccl():
    p = gpu_suite.plan(4, PRESENT)
    assert p.mode == 'nccl' and p.env == {devices.ENV: 'gpu'} and not p.deselect and not p.left_out
    assert p.files == gpu_suite.EVERY  # rebalancing, resumption, bad input, random, HF, failing ranks included
    two = gpu_suite.plan(2, PRESENT)  # the 4-rank layouts (HSDP, TP) need a GPU per rank
    assert two.files == [f for f in gpu_suite.EVERY if f != 'test_layouts.py'] and list(two.left_out) == [
        'test_layouts.py'
    ]
    for needed in (
        'test_rebalance.py',
        'test_resumption.py',
        'test_bad_input.py',
        'test_random_unevenness.py',
        'test_huggingface.py',
        'test_failing_rank.py',
        'test_auto_microbatching.py',
        'test_fsdp.py',
    ):
        assert needed in p.files
    assert 'test_config.py' not in p.files  # single-process tests gain nothing from a GPU
    assert 'test_inert_shadow.py' in p.files  # SyncBatchNorm with torch's real kernels


def test_one_gpu_is_shared_over_gloo_and_what_needs_nccl_is_named():
    p = gpu_suite.plan(1, PRESENT)
    assert p.mode == 'shared' and p.env == {devices.ENV: 'gpu', devices.SHARED_ENV: '1'}
    assert 'test_fsdp.py' not in p.files and 'test_join_core.py' in p.files and p.deselect == 'not fsdp'
    assert 'gloo lacks' in p.left_out['test_fsdp.py']
    assert gpu_suite.plan(0, PRESENT).mode == 'none'


def test_shared_gpu_mode_uses_gloo_and_takes_any_number_of_ranks(monkeypatch):
    monkeypatch.setenv(devices.ENV, 'gpu')
    assert devices.backend() == 'nccl' and not devices.shared_gpu()
    monkeypatch.setenv(devices.SHARED_ENV, '1')
    assert devices.backend() == 'gloo' and devices.shared_gpu()
    monkeypatch.setenv(devices.ENV, 'cpu')
    assert devices.backend() == 'gloo' and not devices.shared_gpu() and devices.trainer_device() == 'cpu'


def test_summary_is_one_line_with_counts_and_skip_reasons():
    xml = (
        '<testsuites><testsuite>'
        '<testcase name="a"/><testcase name="b"/>'
        '<testcase name="c"><failure message="x"/></testcase>'
        '<testcase name="d"><skipped message="a 3-rank launch needs at least 3 CUDA GPUs"/></testcase>'
        '<testcase name="e"><skipped message="a 3-rank launch needs at least 3 CUDA GPUs"/></testcase>'
        '</testsuite></testsuites>'
    )
    line = gpu_suite.summary(xml, gpu_suite.plan(1, PRESENT))
    assert '\n' not in line
    assert line.startswith(
        'make test-gpu on 1 GPU shared by all ranks, gloo: 2 passed, 1 failed, 2 skipped '
        '(2: a 3-rank launch needs at least 3 CUDA GPUs); not run: test_fsdp.py: FSDP needs'
    )
    assert gpu_suite.summary(xml, gpu_suite.plan(2, PRESENT)).startswith('make test-gpu on 2 GPUs, one per rank, NCCL')


def test_make_test_gpu_without_a_gpu_stops_with_a_clear_message():
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': ''}
    done = subprocess.run(
        [sys.executable, str(SCRIPT.with_name('gpu_suite.py')), 'test'],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert 'make test-gpu needs at least 1 CUDA GPUs' in done.stderr


def test_bench_below_its_world_sizes_still_writes_results(tmp_path):
    """make bench-gpu on fewer GPUs than any world size (here 1): results.md says what was not run and why."""
    done = subprocess.run(
        [sys.executable, 'benchmarks/run.py', '--max-ranks', '1', '--out', str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert 'Not run: every world size (2, 3, 4 ranks) is above --max-ranks 1.' in (tmp_path / 'results.md').read_text()
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    import rebalance

    assert rebalance.run(True, tmp_path, max_ranks=1).startswith('## 3. Rebalancing\n\nNot run: every world size')


def test_fsdp_unused_parameter_check_agrees_on_the_host_over_gloo(monkeypatch):
    """No GPU sync per microbatch: beside NCCL, the check's flags go over a gloo group made once."""
    import torch

    from composer_join.wrappers import fsdp

    made = []
    monkeypatch.setattr(fsdp, '_HOST_GROUP', [])
    monkeypatch.setattr(torch.distributed, 'get_backend', lambda *a: 'nccl')
    monkeypatch.setattr(torch.distributed, 'new_group', lambda backend: made.append(backend) or 'gloo-group')
    assert fsdp.host_group() == fsdp.host_group() == 'gloo-group' and made == ['gloo']
    monkeypatch.setattr(fsdp, '_HOST_GROUP', [])
    monkeypatch.setattr(torch.distributed, 'get_backend', lambda *a: 'gloo')
    assert fsdp.host_group() is None and made == ['gloo']  # under gloo: the default group
