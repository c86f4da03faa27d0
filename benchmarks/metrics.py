"""Measure uneven evaluation of every kind of metric state: with UnevenJoin, and with stock Composer.

For each case of ``docs/metrics.md``'s table, one launch (gloo, CPU) per variant runs
``tests/scenarios_metrics.py:metric_kinds_run`` (a ``ComposerClassifier`` with the metrics of
``tests/metric_kinds.py``, one uneven epoch, an evaluation at its end) and compares what rank 0
computed with one process computing the same metrics over all the eval data
(``tests/test_metrics.py:reference``).

    python benchmarks/metrics.py                  # this checkout's UnevenJoin, and stock Composer
    PYTHONPATH=/path/to/other/checkout python benchmarks/metrics.py --join-only   # another version's UnevenJoin

Prints one Markdown table row per case and variant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tests'))

import torch

import metric_kinds
from harness import RankError, launch
from test_metrics import SCENARIOS, reference
from toy import shard

CAT = ('AUROC', 'AP', 'AUROCplusAP', 'CatLoss')  # lists concatenated
UNREDUCED = ('MRR', 'ListSum')  # lists with no reduction
SUMS = ('Accuracy', 'MeanLoss', 'MaxLoss')
NO_TRAIN = dict(train_kinds=())
# (label, scenario of test_metrics.py, overrides): evaluation cases without train metrics, then train metrics
CASES = [
    ('sums', 'eval_20_7_0', dict(NO_TRAIN, eval_kinds=SUMS)),
    ('cat lists', 'eval_20_7', dict(NO_TRAIN, eval_kinds=CAT)),
    ('cat lists', 'eval_20_7_3_microbatched', dict(NO_TRAIN, eval_kinds=CAT)),
    ('cat lists', 'eval_20_7_0', dict(NO_TRAIN, eval_kinds=CAT)),
    ('cat lists', 'eval_0_9', dict(NO_TRAIN, eval_kinds=CAT)),
    ('unreduced lists', 'eval_20_7', dict(NO_TRAIN, eval_kinds=UNREDUCED)),
    ('unreduced lists', 'eval_20_7_0', dict(NO_TRAIN, eval_kinds=UNREDUCED)),
    ('all eval kinds', 'four_ranks_two_empty', NO_TRAIN),
    ('train metrics (all train kinds)', 'eval_20_7_0', dict(eval_kinds=('Accuracy',))),
]


def outcome(cfg: dict, res) -> str:
    if isinstance(res, RankError):
        return f'`{res.type}: {res.message.splitlines()[0][:90]}`'
    kinds = cfg.get('eval_kinds', metric_kinds.EVAL_KINDS)
    if cfg.get('train_kinds', True) != ():  # train metrics: every step against one process over its samples
        b, kinds = cfg['batch_size'], metric_kinds.TRAIN_KINDS
        shards = [shard(r, n) for r, n in enumerate(cfg['shards'])]
        wrong = set()
        for t, got in enumerate(res['train']):
            parts = [(x[t * b : (t + 1) * b], y[t * b : (t + 1) * b]) for x, y in shards]
            want, _, _ = reference(res['step_params'][t], parts, kinds)
            wrong |= {k for k in kinds if not _same(got[k], want[k])}
        steps = max(-(-n // b) for n in cfg['shards'])
        return f'{len(res["train"])} of {steps} steps' + (
            f', wrong: {", ".join(sorted(wrong))}' if wrong else ', exact'
        )
    if not res['eval']:
        return 'no evaluation ran'
    want, _, _ = reference(res['eval_params'][0], [shard(50 + r, n) for r, n in enumerate(cfg['eval_shards'])], kinds)
    got = res['eval'][0]
    wrong = [k for k in kinds if not _same(got[k], want[k])]
    return f'exact ({len(kinds)} metrics)' if not wrong else f'wrong: {", ".join(wrong)}'


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--join-only', action='store_true')
    parser.add_argument('--cases', default='', help='comma-separated indices into CASES (default: all)')
    args = parser.parse_args()
    chosen = [CASES[int(i)] for i in args.cases.split(',')] if args.cases else CASES
    variants = [('UnevenJoin', True)] + ([] if args.join_only else [('stock Composer', False)])
    for kind, name, overrides in chosen:
        for label, join in variants:
            cfg = dict(SCENARIOS[name], join=join, **overrides)
            world = len(cfg['shards'])
            try:
                per_rank = launch(world, [(name, 'scenarios_metrics:metric_kinds_run', {'cfg': cfg})], timeout=300)[
                    name
                ]
                text = '; '.join(sorted({outcome(cfg, r) for r in per_rank}))
            except AssertionError as e:  # a rank died (gloo aborts the process)
                lines = [ln.strip() for ln in str(e).splitlines() if 'Error' in ln or 'error' in ln or 'Abort' in ln]
                cause = [ln for ln in lines if 'Connection' not in ln] or lines  # the dying rank's, not its peers'
                text = 'a rank died: `' + (cause[0][:120] if cause else str(e).splitlines()[0]) + '`'
            shards = cfg['shards'] if kind.startswith('train') else cfg['eval_shards']
            print(f'| {kind} | {world} | {shards} | {label} | {text} |', flush=True)


if __name__ == '__main__':
    main()
