"""The rank side of tests/test_detail.py: whether torch's collective check is in force. Not a test module."""

from __future__ import annotations

import torch


def debug_level() -> str:
    """This rank's ``torch.distributed.get_debug_level()``, e.g. ``'DETAIL'``."""
    return torch.distributed.get_debug_level().name


def mismatched_all_reduce() -> float:
    """An all-reduce of shape 2x3 on rank 0 and 3x2 on the others; the sum of the result.

    The same number of elements on every rank, so gloo reduces them without noticing; under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch compares the shapes first and raises on every rank.
    """
    t = torch.ones((2, 3) if torch.distributed.get_rank() == 0 else (3, 2))
    torch.distributed.all_reduce(t)
    return float(t.sum())
