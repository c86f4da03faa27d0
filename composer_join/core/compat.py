"""Private names of other packages that composer-join reads, in one place, each with the way it does without.

Nothing here is imported when the package loads; each function looks its name up when called.

* :func:`hf_shuffle_buffer`: Hugging Face ``datasets`` (tested 3.3-3.6): whether an ``IterableDataset``
  shuffles through a buffer (``IterableDataset._ex_iterable``, a chain of ``ex_iterable`` attributes, one
  of them a ``BufferShuffledExamplesIterable``). Without the names: assumed to (its position is then
  replayed, which is exact, only slower to resume).
"""

from __future__ import annotations

from typing import Any

__all__ = ['hf_shuffle_buffer']


def hf_shuffle_buffer(dataset: Any) -> bool:
    """Whether a Hugging Face ``IterableDataset`` shuffles with a buffer (its ``state_dict()`` then loses it)."""
    root = getattr(dataset, '_ex_iterable', None)
    if root is None:
        return True
    stack, seen = [root], 0
    while stack and seen < 1000:  # a chain (map, filter, ...) or a tree (interleave, concatenate)
        node, seen = stack.pop(), seen + 1
        if type(node).__name__ == 'BufferShuffledExamplesIterable':
            return True
        stack.extend(child for child in [getattr(node, 'ex_iterable', None)] if child is not None)
        stack.extend(getattr(node, 'ex_iterables', None) or [])
    return False
