"""Example models for a config's ``model:`` section, matched to the datasets of ``examples/data.py``.

==============  ===============================================================================
``digits_mlp``  a one-hidden-layer classifier for ``digits`` (64 features, 10 classes)
``byte_lm``     a byte-level GRU language model for ``pydoc_text`` (next-byte prediction)
==============  ===============================================================================

Example:
    >>> model = MODELS['byte_lm'](dim=32)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerClassifier, ComposerModel
from torch import nn

from composer_join.config.registry import Registry
from data import IGNORE, PAD

__all__ = ['MODELS', 'ByteLM', 'digits_mlp']


def digits_mlp(hidden: int = 64) -> ComposerClassifier:
    """64 -> ``hidden`` -> 10, with Composer's classifier loss and accuracy metrics."""
    module = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return ComposerClassifier(module, num_classes=10)


class ByteLM(ComposerModel):
    """Predicts each next byte of a ``(inputs, labels)`` batch; padding (label ``IGNORE``) is ignored.

    Metrics: cross entropy (train and eval) and perplexity (eval), per real token.
    """

    def __init__(self, dim: int = 64, layers: int = 1):
        super().__init__()
        self.embed = nn.Embedding(PAD + 1, dim, padding_idx=PAD)
        self.rnn = nn.GRU(dim, dim, num_layers=layers, batch_first=True)
        self.head = nn.Linear(dim, 256)
        self.train_metrics = {'LanguageCrossEntropy': LanguageCrossEntropy(ignore_index=IGNORE)}
        self.eval_metrics = {
            'LanguageCrossEntropy': LanguageCrossEntropy(ignore_index=IGNORE),
            'LanguagePerplexity': LanguagePerplexity(ignore_index=IGNORE),
        }

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(batch[0]))
        return self.head(hidden)

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor], *args, **kwargs) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1), batch[1].flatten(), ignore_index=IGNORE)

    def eval_forward(self, batch, outputs=None):
        return outputs if outputs is not None else self.forward(batch)

    def get_metrics(self, is_train: bool = False):
        return self.train_metrics if is_train else self.eval_metrics

    def update_metric(self, batch, outputs, metric) -> None:
        metric.update(outputs, batch[1])


MODELS = Registry('model', {'digits_mlp': digits_mlp, 'byte_lm': ByteLM})
