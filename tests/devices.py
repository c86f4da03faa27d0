"""Where the distributed tests and benchmarks run: CPU ranks with gloo (default), or one GPU per rank with NCCL.

``COMPOSER_JOIN_DEVICE=gpu`` (what ``make test-gpu`` and ``make bench-gpu`` set) makes every rank of
``tests/harness.py`` and ``benchmarks/common.py`` initialise NCCL on its own GPU and train with
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
SHARED_ENV = 'COMPOSER_JOIN_SHARED_GPU'  # '1': every rank on GPU 0, over gloo (a machine with one GPU)


def device() -> str:
    """``'cpu'`` or ``'gpu'``, from ``COMPOSER_JOIN_DEVICE`` (default ``'cpu'``)."""
    value = os.environ.get(ENV, 'cpu')
    if value not in DEVICES:
        raise ValueError(f'{ENV}={value!r}: allowed values are {", ".join(DEVICES)}')
    return value


def shared_gpu() -> bool:
    """True when every rank shares GPU 0 over gloo with CUDA tensors (``make test-gpu`` on one GPU)."""
    return device() == 'gpu' and os.environ.get(SHARED_ENV) == '1'


def backend() -> str:
    """The process group backend of a rank: gloo on the CPU and on a shared GPU, NCCL on one GPU per rank."""
    return 'nccl' if device() == 'gpu' and not shared_gpu() else 'gloo'


def trainer_device():
    """What every test ``Trainer`` gets as ``device``: ``'cpu'``, or Composer's ``DeviceGPU`` with TF32 off.

    Composer enables TF32 matmuls on GPUs by default (``DeviceGPU(allow_tf32=True)``), about 1e-3
    off float32, and the tests compare with a float32 CPU reference to 1e-5. On a shared GPU every
    rank uses device 0 (Composer would pick ``cuda:<local rank>``).
    """
    if device() == 'cpu':
        return 'cpu'
    from composer.devices import DeviceGPU

    return DeviceGPU(device_id=0 if shared_gpu() else None, allow_tf32=False)


def torch_device():
    """The ``torch.device`` a rank's tensors live on (after :func:`init_rank`)."""
    import torch

    return torch.device('cuda', torch.cuda.current_device()) if device() == 'gpu' else torch.device('cpu')


def init_rank(timeout: float) -> None:
    """Initialise this rank's process group (Composer's, or gloo on a shared GPU) and its CUDA device."""
    import datetime

    import torch
    from composer.utils import dist

    if shared_gpu():
        torch.cuda.set_device(0)
        torch.distributed.init_process_group('gloo', timeout=datetime.timedelta(seconds=timeout))
    else:
        dist.initialize_dist(device(), timeout=timeout)
    if device() == 'gpu':
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def too_few_gpus(needed: int, what: str, found: int | None = None) -> str | None:
    """The message to stop with if fewer than ``needed`` GPUs are present, else None."""
    found = gpu_count() if found is None else found
    if found >= needed:
        return None
    return (
        f'{what} needs at least {needed} CUDA GPUs (NCCL needs one GPU per rank), but this machine has {found}. '
        f'Run the CPU versions instead (make test, make bench: gloo on CPU).'
    )


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
