"""Registries: names from a config file mapped to the classes (or functions) that build them.

A :class:`Registry` maps names to factories for one kind of component. Names are snake case
(``GradientClipping`` is ``gradient_clipping``, ``EMA`` is ``ema``); a lookup ignores case,
``_`` and ``-``, so ``mixup`` finds ``mix_up`` and ``MLFlowLogger`` finds ``ml_flow_logger``.
An unknown name raises :class:`UnknownNameError`, whose message gives the close matches and
every allowed name.

The default registries, derived from the libraries' ``__all__`` (nothing is hand-listed):

==============  =========================================================================
``ALGORITHMS``  ``uneven_join`` and every algorithm of :mod:`composer.algorithms`
``CALLBACKS``   every callback of :mod:`composer.callbacks`
``LOGGERS``     every logger destination of :mod:`composer.loggers`
``OPTIMIZERS``  :mod:`composer.optim`'s (``decoupled_sgdw``, ``decoupled_adamw``) and
                :mod:`torch.optim`'s, lower-cased as torch spells them (``sgd``, ``adamw``)
``SCHEDULERS``  every scheduler of :mod:`composer.optim`
==============  =========================================================================

Add your own with :meth:`Registry.register`.

Example:
    >>> from composer_join.config.registry import ALGORITHMS
    >>> ALGORITHMS['uneven_join'](throw_on_early_termination=True)
    UnevenJoin(divide_by_initial_world_size=True, enable=True, throw_on_early_termination=True)
    >>> ALGORITHMS['gradient_clipping'].__name__
    'GradientClipping'
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any, Optional

import composer.algorithms
import composer.callbacks
import composer.loggers
import composer.optim
import torch.optim
from composer.core import Algorithm, Callback
from composer.loggers import LoggerDestination
from composer.optim import ComposerScheduler

from composer_join.join.algorithm import UnevenJoin

__all__ = [
    'ALGORITHMS',
    'CALLBACKS',
    'LOGGERS',
    'OPTIMIZERS',
    'SCHEDULERS',
    'Registry',
    'UnknownNameError',
    'did_you_mean',
    'snake_case',
    'subclasses_in',
]


def snake_case(name: str) -> str:
    """The snake case of a class name, acronyms kept whole.

    ``GradientClipping`` -> ``gradient_clipping``, ``LRMonitor`` -> ``lr_monitor``, ``EMA`` -> ``ema``,
    ``DecoupledAdamW`` -> ``decoupled_adamw``.
    """
    name = re.sub(r'([A-Z]+)([A-Z][a-z])', r'\1_\2', name)
    return re.sub(r'([a-z\d])([A-Z])(?=[A-Za-z])', r'\1_\2', name).lower()


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"did you mean 'a', 'b' or 'c'?"`` for up to three of ``choices`` that look like ``name``; ``''`` if none do."""
    keys = {_key(c): c for c in choices}
    guesses = [repr(keys[k]) for k in difflib.get_close_matches(_key(name), keys, n=3, cutoff=0.6)]
    if len(guesses) > 1:
        guesses = [', '.join(guesses[:-1]), guesses[-1]]
    return f'did you mean {" or ".join(guesses)}?' if guesses else ''


class UnknownNameError(LookupError):
    """A name that is not in a registry. The message lists close matches and all allowed names.

    Attributes:
        kind: what the registry holds (``'algorithm'``, ``'callback'``, ...).
        name: the name asked for.
        allowed: every registered name, sorted.
    """

    def __init__(self, kind: str, name: Any, allowed: list[str]):
        self.kind, self.name, self.allowed = kind, name, allowed
        hint = did_you_mean(str(name), allowed)
        super().__init__(f'unknown {kind} {name!r}; {hint + " " if hint else ""}allowed: {", ".join(allowed)}')


class Registry:
    """Names of one kind of component, each mapped to the callable that builds it.

    Args:
        kind: what it holds, singular, used in error messages (``'algorithm'``).
        factories: initial ``{name: factory}``.

    Example:
        >>> reg = Registry('model', {'mlp': dict})
        >>> reg.register('Tiny-LM', list)
        >>> reg.names
        ['mlp', 'tiny_lm']
        >>> reg['TinyLM'] is list
        True
    """

    def __init__(self, kind: str, factories: Optional[Mapping[str, Callable[..., Any]]] = None):
        self.kind = kind
        self._factories: dict[str, Callable[..., Any]] = {}
        self._keys: dict[str, str] = {}  # lookup key -> registered name
        for name, factory in (factories or {}).items():
            self.register(name, factory)

    def register(self, name: str, factory: Callable[..., Any]) -> None:
        """Add ``factory`` under ``snake_case(name)``; a name that differs only in case or ``_``/``-`` is refused."""
        name = snake_case(name.replace('-', '_'))
        if _key(name) in self._keys:
            raise ValueError(f'{self.kind} {name!r} is already registered (as {self._keys[_key(name)]!r})')
        self._factories[name] = factory
        self._keys[_key(name)] = name

    @property
    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._factories)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        registered = self._keys.get(_key(name)) if isinstance(name, str) else None
        if registered is None:
            raise UnknownNameError(self.kind, name, self.names)
        return self._factories[registered]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _key(name) in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self._factories)

    def __repr__(self) -> str:
        return f'Registry({self.kind!r}, {len(self)} names)'


def subclasses_in(module: ModuleType, base: type, naming: Callable[[str], str] = snake_case) -> dict[str, type]:
    """``{naming(name): class}`` for every concrete subclass of ``base`` (not ``base`` itself) in ``module.__all__``."""
    found = {}
    for attr in module.__all__:
        obj = getattr(module, attr)
        if inspect.isclass(obj) and issubclass(obj, base) and obj is not base and not inspect.isabstract(obj):
            found[naming(attr)] = obj
    return found


def _key(name: str) -> str:
    return name.replace('_', '').replace('-', '').lower()


ALGORITHMS = Registry('algorithm', {**subclasses_in(composer.algorithms, Algorithm), 'uneven_join': UnevenJoin})
CALLBACKS = Registry('callback', subclasses_in(composer.callbacks, Callback))
LOGGERS = Registry('logger', subclasses_in(composer.loggers, LoggerDestination))
OPTIMIZERS = Registry(
    'optimizer',
    {
        **subclasses_in(composer.optim, torch.optim.Optimizer),
        **subclasses_in(torch.optim, torch.optim.Optimizer, naming=str.lower),
    },
)
SCHEDULERS = Registry('scheduler', subclasses_in(composer.optim, ComposerScheduler))
