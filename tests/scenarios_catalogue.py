"""Rank side of tests/test_catalogue.py: any rank-side scenario, with every collective issued through UnevenJoin's
exchange heard (``composer_join.core.exchange.listening``). Not a test module."""

from __future__ import annotations

import importlib
from typing import Any

from composer_join.core.catalogue import Said
from composer_join.core.exchange import listening


def heard(target: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run ``target`` (``'module:function'`` of tests/, or a function of tests/rank_scenarios.py) with ``kwargs`` on
    this rank; return the catalogue entries of the collectives it issued through the exchange, in order (``None``
    for a call whose words name no entry), and what the scenario returned or raised."""
    module, _, name = target.rpartition(':')
    function = getattr(importlib.import_module(module or 'rank_scenarios'), name)
    entries: list[Any] = []
    with listening(lambda what: entries.append(what.collective.name if isinstance(what, Said) else None)):
        try:
            result: Any = function(**kwargs)
        except Exception as e:  # the test reports it
            result = e
    return {'entries': entries, 'raised': repr(result) if isinstance(result, Exception) else None}
