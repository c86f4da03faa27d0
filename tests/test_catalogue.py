"""Every collective UnevenJoin issues is in its catalogue (composer_join/core/catalogue.py), with the fact that gates it.

* docs/how-it-works.md's table "The collectives, and what decides them" is the catalogue, row for row;
* no module of ``composer_join`` calls a ``torch.distributed`` collective except the exchange (``core/exchange.py``)
  and the modules the catalogue names as issuing torch's or DDP's own (``Collective.direct``); every other entry is
  issued through the exchange somewhere in the package;
* on real ranks (uneven shards, the short rank first and last), every collective issued through the exchange names
  its entry, and every rank issues the same entries in the same order: the central claim, listed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import composer_join
from composer_join.core.catalogue import CATALOGUE
from harness import RankError, launch

PACKAGE = Path(composer_join.__file__).parent
DOCS = PACKAGE.parent / 'docs' / 'how-it-works.md'
COLLECTIVE_CALLS = {
    'all_reduce', 'all_gather', 'all_gather_object', 'all_gather_into_tensor', 'broadcast', 'broadcast_object_list',
    'reduce', 'reduce_scatter', 'reduce_scatter_tensor', 'all_to_all', 'barrier', 'gather', 'gather_object', 'scatter',
    'send', 'recv', 'isend', 'irecv', 'new_group', 'allreduce', 'allgather',
}  # fmt: skip


def docs_rows() -> list[tuple[str, str, str]]:
    text = DOCS.read_text()
    start = text.index('| collective | where | runs when')
    lines = text[start : text.index('\n\n', start)].splitlines()[2:]
    return [tuple(cell.strip() for cell in line.strip().strip('|').split(' | ')) for line in lines]  # type: ignore[misc]


def test_the_docs_table_is_the_catalogue():
    assert docs_rows() == [(c.what, c.where, c.when) for c in CATALOGUE]


def _collective_calls(tree: ast.AST) -> list[str]:
    """The collectives a module calls: ``X`` of ``dist.X(...)``, ``torch.distributed.X(...)``,
    ``*.process_group.X(...)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVE_CALLS:
            owner = ast.unparse(node.func.value)
            if owner in ('dist', 'torch.distributed') or owner.endswith('process_group'):
                found.append(node.func.attr)
    return found


def test_only_the_exchange_and_the_catalogued_calls_issue_a_collective():
    allowed = {pair for c in CATALOGUE for pair in c.direct}
    calls = set()
    for path in sorted(PACKAGE.rglob('*.py')):
        module = path.relative_to(PACKAGE).as_posix()
        if module not in ('core/exchange.py', 'collectives.py'):  # the exchange; CollectiveCounter, which counts them
            calls |= {(module, call) for call in _collective_calls(ast.parse(path.read_text()))}
    assert calls <= allowed, sorted(calls - allowed)
    assert _collective_calls(ast.parse((PACKAGE / 'core' / 'exchange.py').read_text()))  # (the scan sees calls)


def test_every_entry_issued_through_the_exchange_is_named_where_it_is_issued():
    used = set()
    for path in PACKAGE.rglob('*.py'):
        if path.name != 'catalogue.py':
            used |= set(re.findall(r'\b([A-Z][A-Z_]+)\.said\(', path.read_text()))
    assert {c.name.upper() for c in CATALOGUE if not c.direct} == used


# -- on real ranks -----------------------------------------------------------------------------------------------

SHARDS = [13, 3]  # the short rank last; reversed below: first
SCENARIOS = {
    # DDP forced_sync with unused parameters and microbatches, evaluated on uneven eval shards after fit()
    'ddp': (
        'train',
        dict(
            batch_size=4, microbatch=2, sync='forced_sync', dataset='iterable', epochs=2, optimizer='sgd',
            join={}, wrapper='ddp', find_unused=True, model='branch',
            eval_shards=[5, 1], eval_batch_size=2, eval_after=True,
        ),
    ),
    'rebalance': ('train', dict(batch_size=4, dataset='iterable', epochs=1, optimizer='sgd', join={'mode': 'rebalance'})),
    'fsdp': ('scenarios_fsdp:train', dict(batch_size=4, microbatch=2, dataset='iterable', epochs=1, optimizer='sgd',
                                          join={}, wrapper='fsdp1')),
}  # fmt: skip


@pytest.mark.timeout(300)
def test_every_rank_issues_the_same_catalogued_collectives_in_the_same_order():
    calls = []
    for name, (target, cfg) in SCENARIOS.items():
        for order, shards in (('short last', SHARDS), ('short first', SHARDS[::-1])):
            eval_shards = cfg.get('eval_shards')
            full = dict(
                cfg,
                shards=shards,
                **({'eval_shards': eval_shards[::-1]} if order == 'short first' and eval_shards else {}),
            )
            calls.append((f'{name}, {order}', 'scenarios_catalogue:heard', {'target': target, 'kwargs': {'cfg': full}}))
    results = launch(2, calls, timeout=240)
    seen = set()
    for name, per_rank in results.items():
        for rank, res in enumerate(per_rank):
            assert not isinstance(res, RankError), f'{name}: rank {rank} raised {res}'
            assert res['raised'] is None, f'{name}: rank {rank}: {res["raised"]}'
            assert None not in res['entries'], f'{name}: rank {rank} issued a collective the catalogue does not name'
        assert all(r['entries'] == per_rank[0]['entries'] for r in per_rank), (name, [r['entries'] for r in per_rank])
        seen |= set(per_rank[0]['entries'])
    print('entries heard:', sorted(seen))
    assert {'first_agreement', 'step_agreement', 'recount', 'gradient_presence', 'bytes_sent', 'fsdp_units'} <= seen, (
        seen
    )
