"""A batch's structure, as a shadow batch must copy it: container types, keys, tensor dtypes and dimensions.

A shadow step feeds the model a batch shaped after a real batch taken at another step, or sent by
another rank. If real batches change structure between steps or differ between ranks (a key
appears, a dtype changes), the shadowing rank's forward pass may use different parameters than
the ranks with data, and their collectives no longer match. So every rank puts a
:func:`fingerprint` of its batch (or of the template it shadows with) in the per-step agreement,
and on a step where some rank shadows they must all be equal; :func:`describe` says, in the
error, what each rank had. Sizes (number of samples, sequence lengths) are not part of the structure.

Example:
    >>> import torch
    >>> describe({'input_ids': torch.zeros(8, 5, dtype=torch.long), 'labels': torch.zeros(8)})
    'dict{input_ids: int64[2d], labels: float32[1d]}'
    >>> fingerprint((torch.zeros(3, 2),)) == fingerprint((torch.ones(7, 2),))
    True
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ['describe', 'fingerprint']

_PRIMITIVES = (int, float, str, bool)


def describe(batch: Any) -> str:
    """A short text of ``batch``'s structure, the same in every process for the same structure."""
    if isinstance(batch, torch.Tensor):
        return f'{str(batch.dtype).removeprefix("torch.")}[{batch.dim()}d]'
    if isinstance(batch, Mapping):
        items = ', '.join(f'{k}: {describe(v)}' for k, v in sorted(batch.items(), key=lambda kv: str(kv[0])))
        return f'{type(batch).__name__}{{{items}}}'
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(v, _PRIMITIVES) for v in batch):
            return f'{type(batch).__name__}[{type(batch[0]).__name__} samples]'
        if batch and all(isinstance(v, Mapping) for v in batch):  # records: one per sample, shaped like the first
            return f'{type(batch).__name__}[{describe(batch[0])} samples]'
        return f'{type(batch).__name__}({", ".join(describe(v) for v in batch)})'
    return type(batch).__name__


def fingerprint(batch: Any) -> int:
    """A non-zero 32-bit number for ``describe(batch)``, stable across processes (unlike ``hash``)."""
    return zlib.crc32(describe(batch).encode()) or 1
