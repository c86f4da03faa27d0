"""Rank-side scenarios: ``Trainer.predict()``, Composer's callbacks and Trainer options with UnevenJoin
on uneven shards. Not a test module: each function runs on every rank of a :func:`harness.launch`.
"""

from __future__ import annotations

from typing import Any

import torch
from composer import Callback
from composer.utils import dist
from torch.utils.data import DataLoader

from composer_join import UnevenJoin, is_shadow_step
from rank_scenarios import ShardWithLen, ToyModel, quiet_trainer
from scenarios_fsdp import cpu_fsdp_workarounds, parallelism
from toy import shard


class PredictRecorder(Callback):
    """At every ``PREDICT_BATCH_END``: output rows, batch rows, shadow or not, ``predict_timestamp`` samples."""

    def __init__(self):
        self.seen: list[tuple[int, int, bool, int]] = []

    def predict_batch_end(self, state, logger):
        self.seen.append(
            (len(state.outputs), len(state.batch[0]), is_shadow_step(state), int(state.predict_timestamp.sample))
        )


def predict(cfg: dict) -> dict[str, Any]:
    """``trainer.predict()`` (no fit) on this rank's shard ``cfg['shards'][rank]``, under ``cfg['wrapper']``."""
    rank = dist.get_global_rank()
    if cfg.get('wrapper') in ('fsdp1', 'fsdp2'):
        cpu_fsdp_workarounds()
    model = ToyModel('mlp')
    recorder = PredictRecorder()
    trainer = quiet_trainer(
        model=model,
        callbacks=[recorder],
        parallelism_config=parallelism(cfg.get('wrapper'), cfg),
        algorithms=[UnevenJoin(mode=cfg.get('mode', 'shadow'))] if cfg.get('join', True) else [],
    )
    x, y = shard(60 + rank, cfg['shards'][rank])
    loader = DataLoader(ShardWithLen(x, y), batch_size=cfg.get('batch_size', 8))
    try:
        outputs = trainer.predict(loader, return_outputs=cfg.get('return_outputs', True))
        ts = trainer.state.predict_timestamp
    finally:
        trainer.close()
    return {
        'outputs': [o.detach().cpu().clone() for o in outputs],
        'seen': recorder.seen,
        'predict_sample': int(ts.sample),
        'predict_batch': int(ts.batch),
    }


def _callback(name: str, folder: str):
    from composer import callbacks as cbs

    return {
        'SpeedMonitor': lambda: cbs.SpeedMonitor(window_size=3),
        'LRMonitor': lambda: cbs.LRMonitor(),
        'OptimizerMonitor': lambda: cbs.OptimizerMonitor(batch_log_interval=1),
        'MemoryMonitor': lambda: cbs.MemoryMonitor(),
        'RuntimeEstimator': lambda: cbs.RuntimeEstimator(skip_batches=1),
        'CheckpointSaver': lambda: cbs.CheckpointSaver(
            folder=folder, filename='ba{batch}-rank{rank}.pt', save_interval='3ba', num_checkpoints_to_keep=-1
        ),
        'EarlyStopper': lambda: cbs.EarlyStopper(
            monitor='MeanLoss', dataloader_label='eval', patience='2ba', min_delta=10.0
        ),
        'ThresholdStopper': lambda: cbs.ThresholdStopper(
            monitor='MulticlassAccuracy', dataloader_label='eval', threshold=0.0, comp=torch.greater_equal
        ),
    }[name]()


class Steps(Callback):
    """Per step: shadow or not; and how many evaluations ran."""

    def __init__(self):
        self.shadow: list[bool] = []
        self.evals = 0
        self.eval_batches: list[int] = []

    def batch_end(self, state, logger):
        self.shadow.append(is_shadow_step(state))

    def eval_start(self, state, logger):
        self.evals += 1
        self.eval_batches.append(int(state.timestamp.batch))


def surface_train(cfg: dict) -> dict[str, Any]:
    """A toy ``fit`` (shards ``cfg['shards']``, batch 8) with Composer callbacks ``cfg['callbacks']`` and
    Trainer options ``cfg['trainer']``; ``cfg['fits']``: the ``fit()`` calls' keyword arguments."""
    import tempfile
    from pathlib import Path

    from composer.loggers import InMemoryLogger

    from rank_scenarios import make_evaluator, make_loader

    rank = dist.get_global_rank()
    folder = tempfile.mkdtemp(prefix='cj-ckpt-') if rank == 0 else ''
    folder = dist.all_gather_object(folder)[0]  # one folder (ranks share the machine)
    model = ToyModel('mlp')
    memory, steps = InMemoryLogger(), Steps()
    callbacks = [_callback(name, folder) for name in cfg.get('callbacks', [])]
    data = dict(shards=cfg['shards'], batch_size=8, fmt=cfg.get('fmt', 'tuple'))
    trainer = quiet_trainer(
        model=model,
        train_dataloader=make_loader(data, rank),
        eval_dataloader=make_evaluator(cfg, rank),
        eval_interval=cfg.get('eval_interval', 1),
        max_duration=cfg.get('max_duration', '2ep'),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[UnevenJoin()],
        callbacks=[steps, *callbacks],
        loggers=[memory],
        **cfg.get('trainer', {}),
    )
    try:
        for kwargs in cfg.get('fits', [{}]):
            trainer.fit(**kwargs)
    finally:
        trainer.close()
    ts = trainer.state.timestamp
    speed = next((c for c in callbacks if type(c).__name__ == 'SpeedMonitor'), None)
    return {
        'batch': int(ts.batch),
        'sample': int(ts.sample),
        'token': int(ts.token),
        'epoch': int(ts.epoch),
        'shadow': steps.shadow,
        'evals': steps.evals,
        'eval_batches': steps.eval_batches,
        'logged': {
            k: [float(v) if not isinstance(v, torch.Tensor) else float(v.float().mean()) for _, v in vals]
            for k, vals in memory.data.items()
            if k.startswith(
                ('lr-', 'l2_norm/grad/global', 'throughput/samples_per_sec', 'time/remaining_estimate', 'metrics/eval/')
            )
        },
        'speed_samples': list(speed.history_samples) if speed is not None else [],
        'checkpoints': sorted(p.name for p in Path(folder).glob('*.pt')) if rank == 0 else [],
        'params': torch.cat([p.detach().flatten() for p in model.parameters()]),
    }


def word_tokenizer():
    """A 32-word whole-word tokenizer made on the spot (no download), the tiny GPT-2's vocabulary."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {'[PAD]': 0, '[UNK]': 1, '[EOS]': 2, **{f'w{i}': i for i in range(3, 32)}}
    tok = Tokenizer(WordLevel(vocab, unk_token='[UNK]'))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token='[PAD]', unk_token='[UNK]', eos_token='[EOS]')


class GenerateRuns(Callback):
    """The steps at whose end Composer's ``Generate`` callback ran (it sets ``last_generate_batch``)."""

    def __init__(self, generate):
        self.generate, self.steps = generate, []

    def batch_end(self, state, logger):  # runs after Generate's (callbacks run in list order)
        last = getattr(self.generate, 'last_generate_batch', None)
        if last is not None and (not self.steps or self.steps[-1] != int(last)):
            self.steps.append(int(last))

    fit_end = batch_end  # Generate's interval also fires at the end of training


def hf_generate(cfg: dict) -> dict[str, Any]:
    """The tiny GPT-2 on shards ``cfg['shards']`` (batch 4, 2 epochs) with ``Generate`` every 3 batches."""
    from composer.callbacks import Generate
    from composer.models import HuggingFaceModel

    from reference_hf import collate, make_gpt2, train_shard
    from scenarios_hf import Sequences

    rank = dist.get_global_rank()
    model = HuggingFaceModel(make_gpt2(), tokenizer=word_tokenizer(), use_logits=True)
    generate = Generate(prompts=['w3 w4 w5', 'w6'], interval='3ba', batch_size=2, max_new_tokens=3, do_sample=False)
    runs, steps = GenerateRuns(generate), Steps()
    trainer = quiet_trainer(
        model=model,
        train_dataloader=DataLoader(
            Sequences(train_shard(rank, cfg['shards'][rank])), batch_size=4, collate_fn=collate
        ),
        max_duration='2ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[UnevenJoin()],
        callbacks=[generate, runs, steps],
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    return {'generated_at': runs.steps, 'shadow': steps.shadow, 'sample': int(trainer.state.timestamp.sample)}


def without_join_pass(cfg: dict) -> str:
    """A Trainer whose Engine lost UnevenJoin's pass: ``fit`` must stop every rank at FIT_START, naming the fix."""
    from composer_join.join.passes import join_pass
    from rank_scenarios import make_loader

    rank = dist.get_global_rank()
    model = ToyModel('mlp')
    trainer = quiet_trainer(
        model=model,
        train_dataloader=make_loader(dict(shards=cfg['shards'], batch_size=8), rank),
        max_duration='1ep',
        algorithms=[UnevenJoin()],
    )
    trainer.engine.algorithm_passes.remove(join_pass)
    try:
        trainer.fit()
    except RuntimeError as e:
        return str(e)
    finally:
        trainer.close()
    return 'no error'
