"""Rebalancing moves batches of every torch dtype between ranks, bit for bit, as raw bytes, on a group of their own.

NCCL has no int16, uint16, uint32 or uint64: the transfer sends every tensor's bytes (``uint8``) and
the receiver views them as the original dtype and shape, allocated on the trainer's device. A batch
that cannot be sent (here a quantized tensor) is refused before the first byte leaves: both ranks
raise ``UnevenInputsError``, neither waits.
"""

from __future__ import annotations

import pytest
import torch

import scenarios_transfer
from harness import launch
from test_join_core import ok


@pytest.fixture(scope='module')
def runs() -> dict:
    return launch(
        2,
        [
            ('group', 'scenarios_transfer:group', {}),  # first: the process's first channel makes the group
            ('every_dtype', 'scenarios_transfer:transfer', {}),
            ('unsendable', 'scenarios_transfer:transfer', {'unsendable': True}),
        ],
        timeout=180,
    )


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def test_every_dtype_arrives_bit_for_bit(runs):
    expected = scenarios_transfer.batch_of_every_dtype(2)
    received = ok(runs, 'every_dtype')[1]
    assert received['error'] is None
    got = received['batch']
    assert got.keys() == expected.keys()
    names = {str(d).split('.')[-1] for d in scenarios_transfer.DTYPES}
    assert names <= got.keys() and len(names) == 15
    for name, value in expected.items():
        if not isinstance(value, torch.Tensor):
            assert got[name] == value
            continue
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(as_bytes(got[name]), as_bytes(value)), name
    assert received['devices'] == (['cuda'] if scenarios_transfer.devices.device() == 'gpu' else ['cpu'])
    # the payload is the tensors' bytes, each padded to 16, plus a header (a pickled placeholder per tensor)
    payload = sum(v.numel() * v.element_size() for v in expected.values() if isinstance(v, torch.Tensor))
    assert payload <= received['bytes_received'] < payload + 416 * len(expected) + 1000
    assert ok(runs, 'every_dtype')[0]['bytes_sent'] == received['bytes_received']


def test_a_batch_that_cannot_be_sent_stops_both_ranks_before_any_byte(runs):
    donor, receiver = (r['error'] for r in ok(runs, 'unsendable'))
    assert 'rank 0 cannot send the batch rank 1 is to train at step 0: TypeError: a quantized tensor' in donor
    assert 'rank 0 could not read or send the batch that rank 1 was to train at step 0' in receiver


def test_transfers_travel_on_a_process_group_of_their_own_made_once(runs):
    """Off the default group: a transfer between some ranks must not advance its sequence number on them alone."""
    for rank, res in enumerate(ok(runs, 'group')):
        assert res['moved'] == 2, rank  # per loader, rank 0 trains one of its two batches and gives rank 1 the other
        assert res['groups_made'] == 1 and res['same_group'] and not res['is_default'], rank
        assert res['ranks'] == [0, 1], rank
        nccl = scenarios_transfer.devices.device() == 'gpu' and not scenarios_transfer.devices.shared_gpu()
        assert res['backend'] == (('nccl', 'nccl') if nccl else ('gloo', 'gloo')), rank  # the default group's backend
        assert res['timeout_s'] == 30  # the default group's (harness.launch's collective_timeout), not torch's 30 min
        assert res['default_sequence_advanced'] == 0, rank  # on the default group: 3 on each rank per transfer
