"""Rebalancing transfers of every torch dtype, point to point between real ranks. Not a test module.

The donor (rank 0) holds two batches and the receiver (rank 1) none, so the schedule hands rank 1
rank 0's second batch (:class:`composer_join.rebalance.rebalance.RebalancingLoader`, through its
:class:`composer_join.rebalance.transfer.BatchChannel`). Tensors travel on the test device
(``tests/devices.py``: CUDA tensors over NCCL in ``make test-gpu``).
"""

from __future__ import annotations

from typing import Any

import torch
from composer.utils import dist

import devices
from composer_join import UnevenInputsError
from composer_join.core.source import Failed
from composer_join.rebalance.rebalance import RebalancingLoader

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def batch_of_every_dtype(seed: int) -> dict[str, Any]:
    """Odd shapes (a 0-d, a transposed, an empty tensor, 3 bools before a float64), extreme values, a string list."""
    g = torch.Generator().manual_seed(seed)
    batch: dict[str, Any] = {}
    for dtype in DTYPES:
        name = str(dtype).split('.')[-1]
        if dtype == torch.bool:
            batch[name] = torch.rand(3, generator=g) > 0.5
        elif dtype.is_complex:
            batch[name] = torch.randn(2, 3, generator=g, dtype=dtype)
        elif dtype.is_floating_point:
            batch[name] = torch.randn(3, 5, generator=g).to(dtype)
        else:
            info = torch.iinfo(dtype)
            values = torch.randint(0, 1 << 20, (4, 3), generator=g, dtype=torch.int64)
            values[0, 0] = info.max if dtype != torch.uint64 else (1 << 63) - 1
            batch[name] = (
                values.to(dtype)
                if dtype not in (torch.uint16, torch.uint32, torch.uint64)
                else (values % (info.max if dtype != torch.uint64 else (1 << 62))).to(dtype)
            )
    batch['scalar'] = torch.tensor(3.25, dtype=torch.float64)
    batch['transposed'] = torch.randn(4, 3, generator=g).t()
    batch['empty'] = torch.zeros(0, 7, dtype=torch.int16)
    batch['text'] = ['a', 'bc']
    return batch


def to_cpu(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def transfer(unsendable: bool = False) -> dict[str, Any]:
    """Rank 1 receives rank 0's second batch; ``unsendable``: that batch holds a quantized tensor."""
    rank = dist.get_global_rank()
    on = devices.torch_device()
    own = [batch_of_every_dtype(1), batch_of_every_dtype(2)] if rank == 0 else []
    if unsendable and rank == 0:
        own[1]['quantized'] = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    loader = RebalancingLoader(own, counts=[2, 0], own_len=len(own), to_device=lambda t: t.to(on))
    try:
        received = list(loader.epoch(0, lambda resumed: iter(own)))
        failed = [b.error for b in received if isinstance(b, Failed)]
        if failed:  # the loader yields Failed for a step it could not form; the JoinLoader raises it
            raise failed[0]
    except UnevenInputsError as e:
        return {'error': str(e)}
    out = received[0]
    devices_seen = sorted({str(v.device.type) for v in out.values() if isinstance(v, torch.Tensor)})
    return {
        'error': None,
        'batch': to_cpu(out),
        'devices': devices_seen,
        'bytes_received': loader.bytes_received,
        'bytes_sent': loader.bytes_sent,
    }


def group() -> dict[str, Any]:
    """The process group transfers travel on: its own, made once per process, and off the default group's count.

    Must be this launch's first call (the first channel of the process makes the group). Two loaders,
    one after the other, each moving rank 0's second batch to rank 1; the default group's sequence
    number (what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` compares across ranks at every collective) is read
    around the transfers.
    """
    from composer_join.rebalance.transfer import transfer_group

    rank = dist.get_global_rank()
    default = torch.distributed.group.WORLD
    groups_before = torch.distributed.get_pg_count()

    def loader() -> RebalancingLoader:
        own = [batch_of_every_dtype(1), batch_of_every_dtype(2)] if rank == 0 else []
        on = devices.torch_device()
        return RebalancingLoader(own, counts=[2, 0], own_len=len(own), to_device=lambda t: t.to(on))

    def sequence_number() -> int:
        return default._get_backend(default._device_types[0])._get_sequence_number_for_group()

    def moved(rebalancer: RebalancingLoader) -> int:
        return len(list(rebalancer.epoch(0, lambda resumed: iter(rebalancer.dataloader))))

    first = loader()
    before = sequence_number()
    count = moved(first)
    second = loader()
    count += moved(second)
    after = sequence_number()
    own = first.channel.group
    backend = own._get_backend(own._device_types[0])
    return {
        'moved': count,
        'groups_made': torch.distributed.get_pg_count() - groups_before,
        'same_group': own is second.channel.group is transfer_group(),
        'is_default': own is default,
        'ranks': torch.distributed.get_process_group_ranks(own),
        'backend': (torch.distributed.get_backend(own), torch.distributed.get_backend()),
        'timeout_s': getattr(backend, 'wrapped_pg', backend).options._timeout.total_seconds(),
        'default_sequence_advanced': after - before,
    }
