"""``make test-gpu`` and ``make bench-gpu``: what runs on this machine's GPUs, how, and a one-line summary.

Not a test module (its logic is tested on the CPU in ``test_gpu_check.py``). Run as a script::

    python tests/gpu_suite.py test    # make test-gpu
    python tests/gpu_suite.py bench   # make bench-gpu (benchmarks/run.py --max-ranks <GPUs>, shadow_cost.py)

* 2 or more GPUs: one GPU per rank, NCCL (``COMPOSER_JOIN_DEVICE=gpu``); launches with more ranks
  than GPUs are skipped, with the reason.
* 1 GPU: every rank shares GPU 0 over gloo with CUDA tensors (``COMPOSER_JOIN_SHARED_GPU=1``), for
  what gloo supports on CUDA (all-reduce, broadcast: DDP, Composer's own collectives, the
  agreement); FSDP (gloo has no CUDA reduce-scatter) is left out, with the reason.
* no GPU: exit status 2 and a message (run ``make test`` instead).

After pytest it prints one line: how many tests passed, failed, were skipped and why, and which
test files were left out and why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import devices

HERE = Path(__file__).parent
EVERY = [
    'test_join_core.py',
    'test_sync_strategies.py',
    'test_evaluation.py',
    'test_collective_cost.py',
    'test_fsdp.py',
    'test_rebalance.py',
    'test_resumption.py',
    'test_bad_input.py',
    'test_random_unevenness.py',
    'test_huggingface.py',
    'test_failing_rank.py',
    'test_auto_microbatching.py',
    'test_transfer_dtypes.py',
    'test_inert_shadow.py',
    'test_metrics.py',
    'test_rank_differences.py',
    'test_rebalance_unsized.py',
    'test_layouts.py',
    'test_composer_view.py',
    'test_transforms.py',
    'test_identity.py',
    'test_agreed_facts.py',
    'test_shadow_limits.py',
    'test_bucket_views.py',
]
NOT_ON_SHARED = {
    'test_fsdp.py': 'FSDP needs reduce-scatter and all-gather on CUDA tensors, which gloo lacks (needs 2+ GPUs, NCCL)',
    'test_layouts.py': 'hybrid sharding and TP need NCCL (FSDP on CUDA tensors) and 4 GPUs',
    'test_failing_rank.py': "Composer's launcher gives each rank cuda:<local rank> (needs one GPU per rank)",
}
NEEDS_GPUS = {'test_layouts.py': 4}  # test files whose launches have more ranks than 2, one GPU per rank
NOT_ON_SHARED_K = {  # test files that run on a shared GPU without some of their scenarios
    'test_auto_microbatching.py': ('not fsdp', 'its FSDP scenarios need NCCL'),
}


@dataclass
class Plan:
    """What ``make test-gpu`` runs with ``gpus`` GPUs."""

    gpus: int
    mode: str  # 'nccl', 'shared' or 'none'
    env: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    deselect: str = ''  # a pytest -k expression
    left_out: dict[str, str] = field(default_factory=dict)  # file (or part) -> why

    def describe(self) -> str:
        return {
            'nccl': f'{self.gpus} GPUs, one per rank, NCCL',
            'shared': '1 GPU shared by all ranks, gloo',
            'none': 'no GPU',
        }[self.mode]


def plan(gpus: int, present: list[str] | None = None) -> Plan:
    """The test files and environment for ``gpus`` GPUs; ``present``: the test files that exist."""
    present = present if present is not None else sorted(p.name for p in HERE.glob('test_*.py'))
    files = [f for f in EVERY if f in present]
    if gpus == 0:
        return Plan(0, 'none', left_out={'everything': devices.too_few_gpus(1, 'make test-gpu', found=0)})
    if gpus >= 2:
        fewer = {f: devices.too_few_gpus(NEEDS_GPUS[f], f, found=gpus) for f in files if NEEDS_GPUS.get(f, 2) > gpus}
        return Plan(gpus, 'nccl', {devices.ENV: 'gpu'}, [f for f in files if f not in fewer], left_out=fewer)
    keep = [f for f in files if f not in NOT_ON_SHARED]
    left = {f: NOT_ON_SHARED[f] for f in files if f in NOT_ON_SHARED}
    parts = [NOT_ON_SHARED_K[f] for f in keep if f in NOT_ON_SHARED_K]
    left.update({f'{f} ({NOT_ON_SHARED_K[f][0]!r} only)': NOT_ON_SHARED_K[f][1] for f in keep if f in NOT_ON_SHARED_K})
    return Plan(
        1,
        'shared',
        {devices.ENV: 'gpu', devices.SHARED_ENV: '1'},
        keep,
        deselect=' and '.join(k for k, _ in parts),
        left_out=left,
    )


def summary(junit_xml: str, p: Plan, target: str = 'make test-gpu') -> str:
    """One line: passed, failed, skipped (grouped by reason) in ``junit_xml``, and what ``p`` left out."""
    root = ET.fromstring(junit_xml)
    passed = failed = 0
    skipped: Counter = Counter()
    for case in root.iter('testcase'):
        skip = case.find('skipped')
        if skip is not None:
            skipped[(skip.get('message') or 'no reason given').replace('\n', ' ')[:160]] += 1
        elif case.find('failure') is not None or case.find('error') is not None:
            failed += 1
        else:
            passed += 1
    parts = [f'{passed} passed', f'{failed} failed', f'{sum(skipped.values())} skipped']
    if skipped:
        parts[-1] += ' (' + '; '.join(f'{n}: {why}' for why, n in skipped.most_common()) + ')'
    line = f'{target} on {p.describe()}: ' + ', '.join(parts)
    if p.left_out:
        line += '; not run: ' + '; '.join(f'{what}: {why}' for what, why in p.left_out.items())
    return line


def run_tests(p: Plan, extra: list[str]) -> int:
    if p.mode == 'none':
        print(p.left_out['everything'], file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp, 'junit.xml')
        cmd = [sys.executable, '-m', 'pytest', *[str(HERE / f) for f in p.files], f'--junitxml={xml}', '-rs', *extra]
        if p.deselect:
            cmd += ['-k', p.deselect]
        code = subprocess.call(cmd, env={**os.environ, **p.env})
        text = xml.read_text() if xml.exists() else '<testsuites/>'
    print(summary(text, p))
    return code


def run_bench(gpus: int, extra: list[str]) -> int:
    """``benchmarks/run.py`` with one rank per GPU (NCCL), world sizes up to the GPU count; then, on 2 GPUs or more,
    ``benchmarks/shadow_cost.py`` (a shadow step beside its floor, device time and the caching allocator's bytes).

    Below 2 GPUs nothing can run (NCCL needs a GPU per rank), and ``benchmarks/gpu/results.md`` says so.
    """
    cmd = [
        sys.executable,
        str(HERE.parent / 'benchmarks' / 'run.py'),
        '--out',
        str(HERE.parent / 'benchmarks' / 'gpu'),
        '--max-ranks',
        str(gpus),
        *extra,
    ]
    print(f'make bench-gpu: world sizes up to {gpus} ({gpus} GPUs, one per rank, NCCL)', flush=True)
    env = {**os.environ, devices.ENV: 'gpu'}
    code = subprocess.call(cmd, env=env)
    if gpus >= 2:  # a shadow step beside its floor in device time (issue 52), on 2 GPUs
        print('make bench-gpu: benchmarks/shadow_cost.py (2 GPUs, device time)', flush=True)
        shadow = [sys.executable, str(HERE.parent / 'benchmarks' / 'shadow_cost.py')]
        root = str(HERE.parent)
        code = subprocess.call(shadow, cwd=root, env={**env, 'PYTHONPATH': root}) or code
    return code


def main(argv: list[str]) -> int:
    what, extra = (argv[0] if argv else 'test'), argv[1:]
    if what not in ('test', 'bench'):
        print(f'usage: gpu_suite.py test|bench [extra arguments]; got {what!r}', file=sys.stderr)
        return 2
    gpus = devices.gpu_count()
    return run_tests(plan(gpus), extra) if what == 'test' else run_bench(gpus, extra)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
