"""Making shadow batches: the same structure as a real batch, with fewer samples.

A batch is whatever the train dataloader yields: a tensor, a tuple or list of tensors, a mapping
of name to tensor (Hugging Face style), nested any way. Like Composer's default ``split_batch``,
the first dimension of every tensor is the sample dimension, and a list or tuple made only of
primitives (``int``, ``float``, ``str``, ``bool``), or only of mappings (records), is a list of
samples. Other leaves are kept as they are.

Example:
    >>> import torch
    >>> batch = {'input_ids': torch.ones(8, 5, dtype=torch.long), 'labels': torch.zeros(8)}
    >>> {k: tuple(v.shape) for k, v in first_samples(batch, 0).items()}
    {'input_ids': (0, 5), 'labels': (0,)}
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ['content_crc', 'first_samples', 'map_tensors', 'sample_lists', 'to_cpu']

_PRIMITIVES = (int, float, str, bool)


def _is_sample_list(x: Any) -> bool:
    """A list or tuple of primitives (raw strings, say), or a non-empty one of mappings (one record per sample)."""
    if not isinstance(x, (list, tuple)):
        return False
    return all(isinstance(v, _PRIMITIVES) for v in x) or (bool(x) and all(isinstance(v, Mapping) for v in x))


def _rebuild(container: Any, items: Any) -> Any:
    if isinstance(container, Mapping):
        try:
            return type(container)(items)  # type: ignore[call-arg]  # a Mapping subclass built from items
        except TypeError:  # a mapping type that cannot be built from a dict
            return dict(items)
    if isinstance(container, tuple) and hasattr(container, '_fields'):  # namedtuple
        return type(container)(*items)
    return type(container)(items)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any, lists: Callable[[list], Any] | None = None) -> Any:
    """Apply ``fn`` to every tensor in ``batch`` (and ``lists`` to every list of samples), keeping the structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if lists is not None and _is_sample_list(batch) and not isinstance(batch, str):
        return type(batch)(lists(list(batch)))
    if isinstance(batch, Mapping):
        return _rebuild(batch, {k: map_tensors(fn, v, lists) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [map_tensors(fn, v, lists) for v in batch])
    return batch


def first_samples(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch``, as a new batch that does not share memory with it.

    ``n=0`` gives an empty batch of the same structure: Composer counts it as zero samples and zero
    tokens and splits it into exactly one microbatch. Scalars (0-dim tensors) are kept whole.
    """

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if t.dim() == 0 else t[:n].detach().clone()

    # records (mappings) are rebuilt, their tensors cloned: a model may take apart what it is given
    def record(v: Any) -> Any:  # a sample of its own: copied whole
        return map_tensors(lambda t: t.detach().clone(), v) if isinstance(v, Mapping) else v

    return map_tensors(take, batch, lists=lambda items: [record(v) for v in items[:n]])


def to_cpu(batch: Any) -> Any:
    """``batch`` with every tensor moved to the CPU, e.g. to send it to another rank."""
    return map_tensors(lambda t: t.cpu(), batch)


def sample_lists(batch: Any) -> bool:
    """True if ``batch`` holds a list of samples (e.g. raw strings) beside or instead of tensors.

    Composer's default ``split_batch`` cannot split an empty list, so such a batch has no shadow.
    """
    found = []
    map_tensors(lambda t: t, batch, lists=lambda items: found.append(1) or items)  # type: ignore[func-returns-value]
    return bool(found)


def content_crc(batch: Any) -> int:
    """A non-zero CRC-32 of ``batch``'s values: its tensors' shapes, dtypes and bytes, and its primitives.

    0 where it cannot be taken without a copy from an accelerator (some tensor is not on the CPU, as a
    ``DataLoader`` yields them). Other leaves (objects of the user's) are left out. Cost: one pass over the bytes.

    Example:
        >>> import torch
        >>> content_crc({'x': torch.arange(4)}) == content_crc({'x': torch.arange(4)}) != content_crc({'x': torch.ones(4)})
        True
    """
    crc = [0]

    def add(data: Any) -> None:
        crc[0] = zlib.crc32(data, crc[0])

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != 'cpu':
            raise _NotOnCPU
        add(f'{t.dtype}{tuple(t.shape)}'.encode())
        add(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        return t

    def samples(items: list) -> list:
        for v in items:
            if isinstance(v, Mapping):
                map_tensors(leaf, v)
            add(repr(v if isinstance(v, _PRIMITIVES) else type(v).__name__).encode())
        return items

    try:
        map_tensors(leaf, batch, lists=samples)
    except _NotOnCPU:
        return 0
    return crc[0] or 1


class _NotOnCPU(Exception):
    pass
