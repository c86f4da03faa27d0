"""Train from a YAML config, with Composer's launcher or as a single process.

    composer -n 2 examples/train.py configs/digits_uneven.yaml
    composer -n 4 examples/train.py configs/digits_uneven.yaml trainer.max_duration=3ep
    torchrun --standalone --nproc-per-node 2 examples/train.py configs/digits_uneven.yaml
    python examples/train.py configs/text_token_budget.yaml

Arguments after the config are omegaconf dotlist overrides (``key.path=value``). The config's
``data:`` and ``model:`` sections name a dataset of ``examples/data.py`` and a model of
``examples/models.py``; every other section is ``composer_join.config.config``'s.

Rank 0 prints the resolved config first and a summary last (per rank: real batches, shadow steps
and samples; then the final metrics). Exit status: 0 done; 2 bad config, reported by every rank
(prefixed ``[rank N]``) before any rank sets up distributed training; 3 ``UnevenInputsError``
(what ``throw_on_early_termination: true`` does on uneven shards), also on every rank.
"""

from __future__ import annotations

import argparse
import signal
import sys
import warnings

# Composer's launcher SIGTERMs every rank once one exits non-zero. Keep SIGTERM pending (blocked)
# until this rank has checked the config, so that with a bad config every rank reports it.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

from composer import Trainer  # noqa: E402
from composer.utils import dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from composer_join import UnevenInputsError, UnevenJoin, launcher_compat  # noqa: E402
from composer_join.config.config import ConfigError, build_one, load_config, trainer_kwargs  # noqa: E402
from data import DATASETS  # noqa: E402
from models import MODELS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('config', help='YAML config, e.g. configs/digits_uneven.yaml')
    parser.add_argument('overrides', nargs='*', help='key.path=value, e.g. trainer.max_duration=3ep')
    args = parser.parse_args(argv)
    rank = dist.get_global_rank()
    # Composer warns about every batch smaller than the microbatch size: with token budgets, every batch.
    warnings.filterwarnings('ignore', message='Cannot split (tensor|list) of length')

    try:
        cfg = load_config(args.config, args.overrides)
        if rank == 0:
            print(OmegaConf.to_yaml(cfg), flush=True)
        cfg = OmegaConf.to_container(cfg)
        model = build_one(MODELS, cfg.get('model'), 'model')
        kwargs = trainer_kwargs(cfg, model.parameters(), sections=('data', 'model'))
        loaders = build_one(DATASETS, cfg.get('data'), 'data')
    except ConfigError as e:
        print(f'[rank {rank}] {e}', file=sys.stderr, flush=True)
        return 2
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    with launcher_compat():  # torchrun: NODE_RANK for autoresume; nodes sharing a save folder: a signal file each
        trainer = Trainer(model=model, train_dataloader=loaders.train, eval_dataloader=loaders.eval, **kwargs)
    try:
        trainer.fit()
    except UnevenInputsError as e:
        print(f'[rank {rank}] stopped with UnevenInputsError: {e}', file=sys.stderr, flush=True)
        return 3
    finally:
        trainer.close()
    if rank == 0:
        join = next((a for a in kwargs.get('algorithms', []) if isinstance(a, UnevenJoin)), None)
        print(summary(trainer, join), flush=True)
    return 0


def summary(trainer: Trainer, join: UnevenJoin | None) -> str:
    """Per rank, the run's real batches, shadow steps and samples (from ``join.reports``); then the final metrics."""
    reports = join.reports if join is not None else []
    active = f'UnevenJoin, {len(reports)} epochs:'
    lines = [active if reports else 'UnevenJoin: not active (a single rank, or not in algorithms:)']
    for r in range(reports[0].world_size if reports else 0):
        samples = [e.real_samples[r] for e in reports]
        lines.append(
            f'  rank {r}: {sum(e.real_batches[r] for e in reports)} real batches, '
            f'{sum(e.shadow_steps[r] for e in reports)} shadow steps, '
            f'{sum(samples) if min(samples) >= 0 else "?"} samples'
        )
    metrics = {
        **{f'train/{k}': v for k, v in trainer.state.train_metric_values.items()},
        **{f'eval/{k}': v for k, v in trainer.state.eval_metric_values.items()},
    }
    lines.append('final metrics: ' + (', '.join(f'{k} {float(v):.4f}' for k, v in metrics.items()) or 'none'))
    return '\n'.join(lines)


if __name__ == '__main__':
    sys.exit(main())
