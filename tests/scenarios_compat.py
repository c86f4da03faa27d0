"""Rank-side scenarios: Composer's own algorithms next to UnevenJoin (after Composer's
``tests/algorithms/algorithm_settings.py``: a small conv net on random 3x16x16 images, and a tiny
Hugging Face BERT for the NLP ones). Not a test module.

Each function runs on every rank of a :func:`harness.launch` and returns plain data.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from composer import Callback
from composer import algorithms as algos
from composer.core import DataSpec
from composer.loss import soft_cross_entropy
from composer.models import ComposerModel, HuggingFaceModel
from composer.utils import dist
from torch.utils.data import DataLoader, IterableDataset

from composer_join import UnevenInputsError, UnevenJoin
from rank_scenarios import quiet_trainer
from scenarios_fsdp import cpu_fsdp_workarounds, parallelism

CLASSES, SIDE, BATCH = 2, 16, 4


class ConvNet(ComposerModel):
    """Two strided convolutions, a BatchNorm, pooling and two linear layers; soft-target cross-entropy."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, CLASSES),
        )

    def forward(self, batch):
        return self.module(batch[0])

    def loss(self, outputs, batch, *args, **kwargs):  # SelectiveBackprop passes reduction='none'
        return soft_cross_entropy(outputs, batch[1], *args, **kwargs)


class UnsizedImages(IterableDataset):
    """This rank's random images and labels, streamed in order, without ``__len__``; records what was read."""

    def __init__(self, seed: int, n: int, read: list[int]):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 3, SIDE, SIDE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
        self.read = read

    def __iter__(self):
        for i in range(len(self.y)):
            self.read.append(i)
            yield self.x[i], self.y[i]


class Images(UnsizedImages):
    """:class:`UnsizedImages` with ``__len__``."""

    def __len__(self) -> int:
        return len(self.y)


def shard_images(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s images and labels when its shard has ``n`` samples (any rank can make any rank's)."""
    images = Images(700 + rank, n, [])
    return images.x, images.y


class Laid(IterableDataset):
    """Given batches of given ranks' shards, in order, already batched (``DataLoader(batch_size=None)``).

    ``cells``: ``(owner, index)`` per step: batch ``index`` (of ``BATCH``) of rank ``owner``'s shard of
    ``shards[owner]`` samples. Stock Composer trains on it what a rebalanced rank trains.
    """

    def __init__(self, cells: list[tuple[int, int]], shards: list[int]):
        self.cells, self.shards = cells, shards

    def __len__(self) -> int:
        return len(self.cells)

    def __iter__(self):
        for owner, i in self.cells:
            x, y = shard_images(owner, self.shards[owner])
            yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]


class Trained(Callback):
    """Per epoch, per step: the ids (``owner * 1000 + index``) of the samples this rank trains; None if none.

    Used as the train ``DataSpec``'s ``batch_transforms`` (an identity), which Composer applies to
    each batch before ``AFTER_DATALOADER``, so before any algorithm mixes or selects its samples.
    """

    def __init__(self, shards: list[int]):
        self.ids = {
            _key(x): owner * 1000 + i for owner, n in enumerate(shards) for i, x in enumerate(shard_images(owner, n)[0])
        }
        self.epochs: list[list[Optional[list[int]]]] = []

    def epoch_start(self, state, logger):
        self.epochs.append([])

    def __call__(self, batch):
        x = batch[0]
        self.epochs[-1].append([self.ids[_key(v)] for v in x.cpu()] if len(x) else None)
        return batch


def _key(image: torch.Tensor) -> tuple[float, ...]:
    return tuple(image.flatten()[:4].tolist())


VISION = {  # Composer's settings where they fit a 16x16 conv net (Factorize and SqueezeExcite need small thresholds)
    'MixUp': lambda: algos.MixUp(alpha=0.2),
    'MixUp_interpolate_loss': lambda: algos.MixUp(alpha=0.2, interpolate_loss=True),
    'CutMix': lambda: algos.CutMix(alpha=1.0),
    'CutMix_interpolate_loss': lambda: algos.CutMix(alpha=1.0, interpolate_loss=True),
    'SelectiveBackprop': lambda: algos.SelectiveBackprop(start=0.0, end=1.0, keep=0.5, interrupt=0),
    'SAM': lambda: algos.SAM(rho=0.05, interval=1),
    'EMA': lambda: algos.EMA(half_life='1ba'),
    'SWA': lambda: algos.SWA(swa_start='0.2dur', swa_end='0.97dur', update_interval='1ep', schedule_swa_lr=True),
    'LayerFreezing': lambda: algos.LayerFreezing(freeze_start=0.0, freeze_level=0.5),
    'GradientClipping': lambda: algos.GradientClipping(clipping_type='norm', clipping_threshold=0.1),
    'LabelSmoothing': lambda: algos.LabelSmoothing(smoothing=0.1),
    'ProgressiveResizing': lambda: algos.ProgressiveResizing(initial_scale=0.5, finetune_fraction=0.2),
    'ChannelsLast': lambda: algos.ChannelsLast(),
    'BlurPool': lambda: algos.BlurPool(min_channels=0),
    'SqueezeExcite': lambda: algos.SqueezeExcite(latent_channels=4, min_channels=4),
    'ColOut': lambda: algos.ColOut(p_row=0.15, p_col=0.15, batch=True),
    'CutOut': lambda: algos.CutOut(num_holes=1, length=0.5),
    'Factorize': lambda: algos.Factorize(min_channels=8, latent_channels=4, min_features=8, latent_features=4),
    'GhostBatchNorm': lambda: algos.GhostBatchNorm(ghost_batch_size=2),
    'GhostBatchNorm_4': lambda: algos.GhostBatchNorm(ghost_batch_size=4),  # refused: the stand-in has 2 samples
    'WeightStandardization': lambda: algos.WeightStandardization(),
}

NLP = {
    'SeqLengthWarmup': lambda: algos.SeqLengthWarmup(
        duration=1.0, min_seq_length=4, max_seq_length=16, step_size=12, truncate=True
    ),
    'Alibi': lambda: algos.Alibi(max_sequence_length=32),
    'GatedLinearUnits': lambda: algos.GatedLinearUnits(),
    'LowPrecisionLayerNorm': lambda: algos.LowPrecisionLayerNorm(),
}
VOCAB, LENGTH = 32, 16


def tiny_bert() -> HuggingFaceModel:
    """A two-layer BERT for masked LM, 16 wide, no dropout, always the same initial weights (built offline)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return HuggingFaceModel(BertForMaskedLM(config), use_logits=True)


class Sentences(IterableDataset):
    """This rank's token sequences (``LENGTH`` long, every third token masked for the loss), with ``__len__``."""

    def __init__(self, seed: int, n: int, read: list[int]):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.read = read

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        for i, ids in enumerate(self.ids):
            self.read.append(i)
            labels = torch.full_like(ids, -100)
            labels[::3] = ids[::3]
            yield {
                'input_ids': ids.masked_fill(labels != -100, 0),
                'attention_mask': torch.ones_like(ids),
                'labels': labels,
            }


def algorithm_train(cfg: dict) -> dict[str, Any]:
    """One ``fit`` with ``cfg['algorithm']`` and UnevenJoin listed before it (``join='first'``), after it
    (``'after'``) or not at all (``None``); shards ``cfg['shards']``, batch 4; optionally microbatches
    (``microbatch``, ``sync``), FSDP (``wrapper``: ``'fsdp2'``), UnevenJoin's ``mode``, shards without
    ``len()`` (``unsized``), or (stock Composer) each rank's batches given as ``(owner, index)`` cells
    (``layout``, see :class:`Laid`). With ``mode='rebalance'`` or a ``layout``, ``trained`` holds the
    ids of the samples each step trains (:class:`Trained`)."""
    rank = dist.get_global_rank()
    if cfg.get('wrapper'):
        cpu_fsdp_workarounds()
    name = cfg['algorithm']
    nlp = name in NLP
    read: list[int] = []
    model = tiny_bert() if nlp else ConvNet()
    shards, epochs = cfg['shards'], cfg['epochs']
    if cfg.get('layout'):
        loader: Any = DataLoader(Laid(cfg['layout'][rank], shards), batch_size=None)
    else:
        images = UnsizedImages if cfg.get('unsized') else Images
        loader = DataLoader((Sentences if nlp else images)(700 + rank, shards[rank], read), batch_size=BATCH)
    trained = Trained(shards) if cfg.get('mode') == 'rebalance' or cfg.get('layout') else None
    algorithm = (NLP if nlp else VISION)[name]()
    join = UnevenJoin(mode=cfg.get('mode', 'shadow'))
    listed = {'first': [join, algorithm], 'after': [algorithm, join], None: [algorithm]}[cfg['join']]
    trainer = quiet_trainer(
        model=model,
        train_dataloader=loader if trained is None else DataSpec(loader, batch_transforms=trained),
        # without len(), Composer takes no duration in epochs
        max_duration=f'{sum(shards) * epochs}sp' if cfg.get('unsized') else f'{epochs}ep',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        algorithms=listed,
        callbacks=[trained] if trained is not None else [],
        # Composer takes the default (the whole batch) from the DataLoader's batch_size, which Laid's has not
        device_train_microbatch_size=cfg.get('microbatch', BATCH if cfg.get('layout') else None),
        ddp_sync_strategy=cfg.get('sync'),
        parallelism_config=parallelism(cfg.get('wrapper'), cfg),
    )
    try:
        trainer.fit()
    except UnevenInputsError as e:
        if not cfg.get('expect_error'):
            raise
        return {'error': str(e)}
    finally:
        trainer.close()
    ts = trainer.state.timestamp
    return {
        'params': torch.cat([_full(p).detach().flatten().cpu() for p in trainer.state.model.parameters()]),
        'sample': int(ts.sample),
        'batch': int(ts.batch),
        'read': read,
        'real_samples': [list(r.real_samples) for r in join.reports] if cfg['join'] else [],
        'trained': trained.epochs if trained is not None else [],
        'sharded': any(hasattr(p, 'full_tensor') for p in trainer.state.model.parameters()),  # FSDP2's DTensors
    }


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (FSDP2 shards it as a DTensor: an all-gather, on every rank in the same order)."""
    return p.full_tensor() if hasattr(p, 'full_tensor') else p
