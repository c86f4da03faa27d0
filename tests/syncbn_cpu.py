"""Test-only: run torch's real ``SyncBatchNorm`` (module and autograd function) on CPU tensors over gloo.

torch refuses CPU here in three places and has CUDA kernels only (see /work/shared/NOTES.md):
``SyncBatchNorm.forward`` checks the input's device, ``DistributedDataParallel`` refuses a CPU module
holding a ``SyncBatchNorm``, and the autograd function ``torch.nn.modules._functions.SyncBatchNorm``
calls ``torch.batch_norm_stats``, ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``,
``batch_norm_backward_reduce`` and ``batch_norm_backward_elemt``. :func:`install` gives those five
CPU stand-ins (the CUDA kernels' maths, written out; CUDA tensors still go to the real kernels) and
lifts the two checks for CPU only. Everything else, in particular the autograd function with its
all-gather of statistics, its zero-count masking and its backward all-reduce, is torch's own.
On GPUs (``make test-gpu``) :func:`install` does nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

_REAL: dict[str, object] = {}


def _shape(t: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against ``input`` (channels on dim 1)."""
    return t.view(1, -1, *([1] * (input.dim() - 2)))


def _dims(input: torch.Tensor) -> list[int]:
    return [d for d in range(input.dim()) if d != 1]


def batch_norm_stats(input, eps):
    if input.is_cuda:
        return _REAL['batch_norm_stats'](input, eps)
    mean = input.mean(_dims(input))
    var = input.var(_dims(input), unbiased=False)
    return mean, torch.rsqrt(var + eps)


def batch_norm_gather_stats_with_counts(input, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    if input.is_cuda:
        return _REAL['batch_norm_gather_stats_with_counts'](
            input, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts
        )
    counts = counts.to(mean_all.dtype).view(-1, 1)
    total = counts.sum()
    mean = (counts * mean_all).sum(0) / total
    var_all = invstd_all.pow(-2) - eps
    var = (counts * (var_all + (mean_all - mean).pow(2))).sum(0) / total
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(mean * momentum)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_(var * (total / (total - 1)) * momentum)
    return mean, torch.rsqrt(var + eps)


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    if input.is_cuda:
        return _REAL['batch_norm_elemt'](input, weight, bias, mean, invstd, eps)
    out = (input - _shape(mean, input)) * _shape(invstd, input)
    if weight is not None:
        out = out * _shape(weight, input)
    if bias is not None:
        out = out + _shape(bias, input)
    return out


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    if input.is_cuda:
        return _REAL['batch_norm_backward_reduce'](grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g)
    dims = _dims(input)
    sum_dy = grad_out.sum(dims)
    sum_dy_xmu = (grad_out * (input - _shape(mean, input))).sum(dims)
    grad_weight = sum_dy_xmu * invstd if weight_g else None
    grad_bias = sum_dy if bias_g else None
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    if input.is_cuda:
        return _REAL['batch_norm_backward_elemt'](grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
    total = count.sum().to(input.dtype)
    mean_dy = _shape(sum_dy / total, input)
    mean_dy_xmu = _shape(sum_dy_xmu / total, input)
    inv = _shape(invstd, input)
    scale = inv if weight is None else inv * _shape(weight, input)
    return (grad_out - mean_dy - (input - _shape(mean, input)) * inv.pow(2) * mean_dy_xmu) * scale


_KERNELS = (
    batch_norm_stats,
    batch_norm_gather_stats_with_counts,
    batch_norm_elemt,
    batch_norm_backward_reduce,
    batch_norm_backward_elemt,
)


@contextlib.contextmanager
def _cpu_counts_as_accelerator():
    real = torch._C._get_privateuse1_backend_name
    torch._C._get_privateuse1_backend_name = lambda: 'cpu'
    try:
        yield
    finally:
        torch._C._get_privateuse1_backend_name = real


def install() -> None:
    """Let torch's SyncBatchNorm run on CPU tensors in this process (idempotent; a no-op on GPUs)."""
    import devices

    if devices.device() == 'gpu' or _REAL:
        return
    for kernel in _KERNELS:
        _REAL[kernel.__name__] = getattr(torch, kernel.__name__)
        setattr(torch, kernel.__name__, kernel)
    forward = torch.nn.SyncBatchNorm.forward

    def cpu_forward(self, input):
        if input.device.type != 'cpu':
            return forward(self, input)
        with _cpu_counts_as_accelerator():  # only for the device check at the top of the forward
            return forward(self, input)

    torch.nn.SyncBatchNorm.forward = cpu_forward
    check = DistributedDataParallel._passing_sync_batchnorm_handle

    def no_cpu_check(self, module):
        if self.device_type != 'cpu':
            check(self, module)

    DistributedDataParallel._passing_sync_batchnorm_handle = no_cpu_check
