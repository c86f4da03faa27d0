"""Where the distributed tests and benchmarks run: CPU ranks with gloo (default), or one GPU per rank with NCCL.

``COMPOSER_JOIN_DEVICE=gpu`` (what ``make test-gpu`` and ``make bench-gpu`` set) makes every rank of
``tests/harness.py`` and ``benchmarks/ranks.py`` initialise NCCL on its own GPU and train with
Composer's ``device='gpu'``; results come back on the CPU, so the tests compare them with the same CPU
reference. The code paths that differ on a GPU (the agreement tensors moved to the device, template
batches moved to it) are the ones CPU runs already take through ``state.device``. Not a test module.

Run as a script, it stops with a clear message where there are too few GPUs::

    python tests/devices.py 2 'make test-gpu'   # exit status 2 and a message if fewer than 2 GPUs
    python tests/devices.py --count             # the number of GPUs
"""

from __future__ import annotations

import os
import sys

ENV = 'COMPOSER_JOIN_DEVICE'
DEVICES = ('cpu', 'gpu')


def device() -> str:
    """``'cpu'`` or ``'gpu'``, from ``COMPOSER_JOIN_DEVICE`` (default ``'cpu'``)."""
    value = os.environ.get(ENV, 'cpu')
    if value not in DEVICES:
        raise ValueError(f'{ENV}={value!r}: allowed values are {", ".join(DEVICES)}')
    return value


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def too_few_gpus(needed: int, what: str, found: int | None = None) -> str | None:
    """The message to stop with if fewer than ``needed`` GPUs are present, else None."""
    found = gpu_count() if found is None else found
    if found >= needed:
        return None
    return (f'{what} needs at least {needed} CUDA GPUs (NCCL needs one GPU per rank), but this machine has {found}. '
            f'Run the CPU versions instead (make test, make bench: gloo on CPU).')


def main(argv: list[str]) -> int:
    if argv == ['--count']:  # for make bench-gpu: how many ranks it can run
        print(gpu_count())
        return 0
    needed, what = int(argv[0]) if argv else 2, argv[1] if len(argv) > 1 else 'this run'
    message = too_few_gpus(needed, what)
    if message is not None:
        print(message, file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
