"""llm-foundry end to end: its own ``train_from_yaml`` on 2 CPU ranks with uneven shards, through Composer's launcher.

``examples/llmfoundry/prepare.py`` trains a byte-level BPE tokenizer and writes per-rank shards of
40 and 21 training sequences and 12 and 5 eval sequences (32 tokens each);
``examples/llmfoundry/uneven_mpt.yaml`` trains a tiny MPT for 2 epochs with
``algorithms: {uneven_join: {}}``, evaluating after each epoch. (The same YAML with
``algorithms.uneven_join.enable=false`` is stock Composer, measured for the README; it is left out
of the suite to keep it fast: tests/test_huggingface.py shows stock Composer's shortfall.) Each rank saves what it trained and
evaluated (``run_record`` in ``examples/llmfoundry/uneven_shards.py``); the test compares that with
one process evaluating all the eval data with the same weights.

``examples/llmfoundry/uneven_mpt_tp.yaml`` trains the same shards on 4 ranks with llm-foundry's tensor parallelism
(``tp_config: {strategy: ffn, tensor_parallel_degree: 2}``) beside FSDP1, one epoch: two data-parallel members of two
ranks each, every rank of a member reading its shard (docs/parallel-layouts.md). Checked: each rank trained its
member's every sequence once, in order; the 4 ranks end with the same weights; the evaluation covers every eval
sequence once per member and equals one process evaluating all of them with the final weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / 'examples' / 'llmfoundry'
COMPOSER = Path(sys.executable).with_name('composer')
TRAIN, EVAL, LENGTH = [40, 21], [12, 5], 32


def run(args: list[str], timeout: float) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f'{" ".join(args)} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}'
    )


@pytest.fixture(scope='module')
def data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp('uneven-mpt')
    run(
        [
            sys.executable,
            str(EXAMPLE / 'prepare.py'),
            str(data),
            '--train',
            *map(str, TRAIN),
            '--eval',
            *map(str, EVAL),
            '--seq-len',
            str(LENGTH),
        ],
        timeout=120,
    )
    return data


def train(data: Path, script: Path, config: str, ranks: int, out: str, *overrides: str) -> list[dict]:
    """Composer's launcher running llm-foundry's ``train_from_yaml`` on ``ranks`` ranks; each rank's record."""
    args = [str(COMPOSER), '-n', str(ranks), '--master_port', str(free_port()), str(script), str(EXAMPLE / config)]
    run([*args, f'variables.data_dir={data}', f'loggers.run_record.out={data / out}', *overrides], timeout=300)
    return [torch.load(data / out / f'rank{r}.pt', weights_only=False) for r in range(ranks)]


@pytest.fixture(scope='module')
def records(data) -> dict:
    out = {'join': train(data, EXAMPLE / 'train.py', 'uneven_mpt.yaml', 2, 'join')}
    out['eval_ids'] = torch.cat([torch.from_numpy(np.load(data / 'data' / 'eval' / f'rank{r}.npy')) for r in range(2)])
    return out


@pytest.fixture(scope='module')
def tp_records(data) -> list[dict]:
    script = ROOT / 'tests' / 'train_llmfoundry_cpu.py'  # FSDP1 on CPU: the test-only workaround
    return train(data, script, 'uneven_mpt_tp.yaml', 4, 'join_tp', 'max_duration=1ep')


def final_model(record: dict) -> torch.nn.Module:
    """The MPT a rank ended with, rebuilt from its config and weights."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    model = MPTForCausalLM(MPTConfig.from_dict(record['config']))
    model.load_state_dict(record['state_dict'])
    return model


def one_process_eval_loss(record: dict, flat_params: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy over every token of every eval sequence, in one process."""
    model = final_model(record)
    torch.nn.utils.vector_to_parameters(flat_params, model.parameters())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def test_every_sample_is_trained_and_replicas_stay_identical(records):
    join = records['join']
    assert [r['samples'] for r in join] == [2 * sum(TRAIN)] * 2 == [122, 122]
    assert [r['batches'] for r in join] == [10, 10]  # 5 steps per epoch: the longer shard's batches of 8
    for key, value in join[0]['state_dict'].items():
        assert torch.equal(value, join[1]['state_dict'][key]), f'{key} differs between the ranks'


def test_every_evaluation_equals_one_process_evaluating_all_eval_data(records):
    ids = records['eval_ids']
    join = records['join']
    assert len(join[0]['evals']) == 2  # after each epoch; the last one with the final weights
    final = torch.cat([p.detach().flatten() for p in final_model(join[0]).parameters()])
    assert torch.equal(join[0]['evals'][-1]['params'], final)
    for i in range(2):
        assert sum(r['evals'][i]['tokens'] for r in join) == sum(EVAL) * (LENGTH - 1) == 527
        for rank, record in enumerate(join):
            logged = record['evals'][i]['metrics']['metrics/eval/LanguageCrossEntropy']
            expected = one_process_eval_loss(record, record['evals'][i]['params'], ids)
            assert logged == pytest.approx(expected, abs=1e-5), f'rank {rank}, evaluation {i}'


def test_tensor_parallel_members_train_their_shards_and_replicas_stay_identical(data, tp_records):
    for rank, record in enumerate(tp_records):  # TP groups (0, 1) and (2, 3): members 0 and 1
        shard = torch.from_numpy(np.load(data / 'data' / 'train' / f'rank{rank // 2}.npy'))
        trained = torch.cat(record['trained'])
        assert torch.equal(trained, shard), f"rank {rank} did not train its member's shard once, in order"
        assert len(record['trained']) == 5  # the longer member's batches of 8; the shorter shadows its last 2
    for rank, record in enumerate(tp_records[1:], start=1):
        for key, value in tp_records[0]['state_dict'].items():
            assert torch.equal(value, record['state_dict'][key]), f'{key} differs between ranks 0 and {rank}'


def test_tensor_parallel_evaluation_equals_one_process_evaluating_all_eval_data(records, tp_records):
    assert [r['evals'][-1]['tokens'] for r in tp_records] == [e * (LENGTH - 1) for e in EVAL for _ in range(2)]
    final = torch.cat([p.detach().flatten() for p in final_model(tp_records[0]).parameters()])
    expected = one_process_eval_loss(tp_records[0], final, records['eval_ids'])
    for rank, record in enumerate(tp_records):  # one evaluation, after the only epoch: with the final weights
        logged = record['evals'][-1]['metrics']['metrics/eval/LanguageCrossEntropy']
        assert logged == pytest.approx(expected, abs=1e-5), f'rank {rank}'
