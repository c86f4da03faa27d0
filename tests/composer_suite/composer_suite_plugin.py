"""Pytest plugin for running Composer's own test suite (``../shared/peers/composer-v0.32.1``), loaded with ``-p``.

Loaded by ``tests/composer_suite/run_composer_suite.py`` (``make test-composer``) with
``-p composer_suite_plugin``, with this folder on ``PYTHONPATH``. It never changes Composer's test files; what it does:

- ``COMPOSER_SUITE_INJECT=1``: wraps ``composer.Trainer.__init__`` so that every Trainer gets ``UnevenJoin()``
  appended to its algorithms (unless one is there already) and counts the Trainers it touched. Unset or ``0``:
  stock Composer, with everything else below the same, so the two runs differ only in the injection.
- Offline tokenizers: Composer's root conftest fetches tokenizer files from the network at configure time and
  writes them under its ``tests/assets``. Here ``download_tokenizers_files`` does nothing and
  ``assets_tokenizer_helper`` returns a small local stand-in (a word-level tokenizer with BERT's and GPT-2's
  special tokens), which is all the chosen files need (``vocab_size``, masking, padding).
- Deselects by name the tests in ``suite_config.DESELECTED`` (each with its reason).
- Caps the distributed timeout (``COMPOSER_SUITE_DIST_TIMEOUT`` seconds, default 60) of every
  ``composer.utils.dist.initialize_dist`` call (Composer's test fixtures ask for 300 s), so that a rank left
  waiting in a collective fails well inside the per-test timeout instead of holding the run for five minutes.
- Multi-rank runs: gives each rank its own junit XML file (``<path>.rank<N>.xml``), and stops the session after
  a test that broke the process group (a gloo timeout or a lost peer), so that the tests after it do not each wait
  for a timeout; they then count as not passed.
- ``COMPOSER_SUITE_ZERO_EXIT=1``: exits 0 when tests failed (the runner judges the junit XML), so that Composer's
  launcher does not take rank 0's ordinary failure exit for a crash and kill rank 1 before it writes its results.
- ``COMPOSER_SUITE_STATS=<path>``: writes ``{"trainers": N, "injected": M}`` of this process there at the end.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

import pytest
from suite_config import DESELECTED

INJECT_ENV = 'COMPOSER_SUITE_INJECT'
STATS_ENV = 'COMPOSER_SUITE_STATS'
DIST_TIMEOUT_ENV = 'COMPOSER_SUITE_DIST_TIMEOUT'
ZERO_EXIT_ENV = 'COMPOSER_SUITE_ZERO_EXIT'


_COUNTS = {'trainers': 0, 'injected': 0}


def _injecting() -> bool:
    return os.environ.get(INJECT_ENV, '0') not in ('', '0')


def _with_uneven_join(algorithms: Any) -> list[Any]:
    """``algorithms`` as Composer accepts it (None, one Algorithm or a sequence), with ``UnevenJoin()`` appended."""
    from composer_join import UnevenJoin

    if algorithms is None:
        found: list[Any] = []
    elif isinstance(algorithms, (list, tuple)):
        found = list(algorithms)
    else:
        found = [algorithms]
    if any(isinstance(algorithm, UnevenJoin) for algorithm in found):
        return found
    _COUNTS['injected'] += 1
    return found + [UnevenJoin()]


def _install_injection() -> None:
    """Wraps ``composer.Trainer.__init__``: counts every Trainer and, when injecting, appends ``UnevenJoin()``."""
    from composer import Trainer

    original = Trainer.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _COUNTS['trainers'] += 1
        if _injecting():
            kwargs['algorithms'] = _with_uneven_join(kwargs.get('algorithms'))
        original(self, *args, **kwargs)

    Trainer.__init__ = __init__  # type: ignore[method-assign]


def _cap_dist_timeout() -> None:
    from composer.utils import dist

    cap = float(os.environ.get(DIST_TIMEOUT_ENV, '60'))
    original = dist.initialize_dist

    @functools.wraps(original)
    def initialize_dist(device: Any = None, timeout: float = 300.0) -> None:
        original(device, min(timeout, cap))

    dist.initialize_dist = initialize_dist


_SPECIAL_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', '<|endoftext|>')
_STAND_IN_WORDS = 1000


def _stand_in_tokenizer(name: str) -> Any:
    """An offline stand-in for the tokenizer Composer's tests load from ``tests/assets/tokenizers/<name>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f'w{i}' for i in range(_STAND_IN_WORDS)]
    vocab = {token: i for i, token in enumerate([*_SPECIAL_TOKENS, *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token='[UNK]'))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        name_or_path=f'stand-in-{name}',
        unk_token='[UNK]',
        pad_token='[PAD]',
        cls_token='[CLS]',
        sep_token='[SEP]',
        mask_token='[MASK]',
        eos_token='<|endoftext|>',
        bos_token='<|endoftext|>',
    )


def _offline_tokenizers() -> None:
    fixtures = sys.modules.get('tests.fixtures.fixtures')
    if fixtures is None:  # Composer's conftest registers it as a plugin before any configure hook runs
        raise RuntimeError('composer_suite_plugin: run pytest with rootdir at the Composer tests folder')
    fixtures.download_tokenizers_files = lambda: None
    fixtures.assets_tokenizer_helper = _stand_in_tokenizer


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _offline_tokenizers()
    _install_injection()
    _cap_dist_timeout()
    xmlpath = getattr(config.option, 'xmlpath', None)
    if xmlpath and int(os.environ.get('WORLD_SIZE', '1')) > 1:
        config.option.xmlpath = f'{xmlpath}.rank{os.environ.get("RANK", "0")}.xml'


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept = [item for item in items if item.nodeid not in DESELECTED]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in DESELECTED])
        items[:] = kept


def pytest_terminal_summary(terminalreporter: Any) -> None:
    mode = 'UnevenJoin injected' if _injecting() else 'stock'
    terminalreporter.write_line(
        f'composer_suite_plugin ({mode}): {_COUNTS["trainers"]} Trainers built, {_COUNTS["injected"]} injected'
    )


_BROKEN_GROUP = ('DistBackendError', 'gloo', 'Timed out', 'Connection reset', 'Connection closed')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """On several ranks, stops the session after a test whose failure broke the process group.

    Later tests would only wait for the collectives of a rank that moved on, each until its timeout.
    """
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and int(os.environ.get('WORLD_SIZE', '1')) > 1:
        failure = f'{call.excinfo.typename}: {call.excinfo.value}'
        if any(sign in failure for sign in _BROKEN_GROUP):
            item.session.shouldstop = f'{item.nodeid} broke the process group ({failure[:200]})'


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(ZERO_EXIT_ENV) == '1' and exitstatus == pytest.ExitCode.TESTS_FAILED:
        session.exitstatus = pytest.ExitCode.OK


def pytest_unconfigure(config: pytest.Config) -> None:
    path = os.environ.get(STATS_ENV)
    if path:
        rank = os.environ.get('RANK', '0')
        with open(f'{path}.rank{rank}.json', 'w') as f:
            json.dump(_COUNTS, f)
