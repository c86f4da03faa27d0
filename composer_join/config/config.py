"""Trainer configs in YAML: load them with omegaconf, check them against ``composer.Trainer``, build its arguments.

A config has these top-level sections, all optional:

================  ===========================================================================
``trainer``       keyword arguments of :class:`composer.Trainer` (what YAML can say: scalars,
                  lists, mappings), each checked against Trainer's signature and annotations
``algorithms``    components from :data:`~composer_join.config.registry.ALGORITHMS`
``callbacks``     ... from :data:`~composer_join.config.registry.CALLBACKS`
``loggers``       ... from :data:`~composer_join.config.registry.LOGGERS`
``schedulers``    ... from :data:`~composer_join.config.registry.SCHEDULERS`
``optimizer``     exactly one from :data:`~composer_join.config.registry.OPTIMIZERS`, built on the
                  model's parameters (may also be spelled ``optimizers``)
``variables``     free-form values, to interpolate elsewhere as ``${variables.name}``
================  ===========================================================================

plus any sections the script declares and handles itself (``sections=('data', 'model')``).

A component section is any of::

    algorithms: [uneven_join, ema]                         # names
    algorithms: [uneven_join, {ema: {half_life: 50ba}}]    # names and {name: {kwargs}}
    algorithms: {uneven_join: {}, ema: {half_life: 50ba}}  # mapping (llm-foundry's form)
    optimizer: {name: decoupled_adamw, lr: 1.0e-3}         # one component, name and kwargs

Every problem (an unknown section, Trainer argument or component name, a wrong type, an argument
a component does not take, a time string or enum value Composer would refuse) is collected and
raised as one :class:`ConfigError`, whose lines each name the key and what is allowed. Nothing
here communicates between ranks: every rank checks the same config and fails the same way, before
``Trainer`` sets up distributed training.

Example::

    cfg = load_config('configs/digits_uneven.yaml', ['trainer.max_duration=1ep'])
    kwargs = trainer_kwargs(cfg, model.parameters(), sections=('data', 'model'))
    trainer = Trainer(model=model, train_dataloader=train, **kwargs)
"""

from __future__ import annotations

import enum
import inspect
import re
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from composer import Trainer
from composer.core import Time
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from typeguard import CollectionCheckStrategy, TypeCheckError, check_type

from composer_join.config.registry import (
    ALGORITHMS,
    CALLBACKS,
    LOGGERS,
    OPTIMIZERS,
    SCHEDULERS,
    Registry,
    UnknownNameError,
    did_you_mean,
)

__all__ = ['ConfigError', 'build', 'build_one', 'check_kwargs', 'load_config', 'trainer_kwargs']

COMPONENT_SECTIONS: dict[str, Registry] = {
    'algorithms': ALGORITHMS,
    'callbacks': CALLBACKS,
    'loggers': LOGGERS,
    'schedulers': SCHEDULERS,
}
"""Top-level sections that become lists of components, and where their names resolve."""

SECTIONS = ('trainer', *COMPONENT_SECTIONS, 'optimizer', 'optimizers', 'variables')
"""Every top-level section this module handles."""


class ConfigError(ValueError):
    """A config that cannot be used. ``problems`` holds one ``'key.path: what is wrong'`` line per problem."""

    def __init__(self, problems: Iterable[str]):
        self.problems = list(problems)
        count = f'{len(self.problems)} problems' if len(self.problems) != 1 else '1 problem'
        lines = [p.replace('\n', '\n    ') for p in self.problems]
        super().__init__('\n  '.join([f'invalid config ({count}):', *lines]))


def load_config(path: Union[str, Path], overrides: Sequence[str] = ()) -> DictConfig:
    """Read a YAML config, apply ``key.path=value`` overrides (omegaconf dotlist) and resolve ``${...}``.

    Raises:
        ConfigError: the file is missing or not YAML, an override is not ``key=value``, or an
            interpolation cannot be resolved (the message names its key).

    Example::

        cfg = load_config('configs/digits_uneven.yaml', ['trainer.max_duration=3ep'])
        assert cfg.trainer.max_duration == '3ep'
    """
    bad = [o for o in overrides if '=' not in o]
    if bad:
        raise ConfigError(f'{o!r}: an override is key.path=value, e.g. trainer.max_duration=3ep' for o in bad)
    try:
        cfg = OmegaConf.load(path)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError([f'{path}: {e}']) from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError([f'{path}: the top level must be a mapping of sections, got a {type(cfg).__name__}'])
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError([f'{getattr(e, "full_key", None) or path}: {str(e).splitlines()[0]}']) from None
    except (TypeError, ValueError) as e:  # e.g. an override that puts a mapping where a list is
        raise ConfigError([f'overrides {" ".join(overrides)}: {e}']) from None
    return cfg


def trainer_kwargs(
    cfg: Union[DictConfig, Mapping[str, Any]],
    params: Optional[Iterable[Any]] = None,
    *,
    sections: Collection[str] = (),
) -> dict[str, Any]:
    """Check the whole config and build the keyword arguments for ``composer.Trainer``.

    Args:
        cfg: the config, as from :func:`load_config`.
        params: the model's parameters, for the optimizer (needed if the config has one).
        sections: the top-level sections the script handles itself (e.g. ``('data', 'model')``);
            they are allowed but not read.

    Returns:
        ``trainer:``'s entries, plus ``algorithms``, ``callbacks``, ``loggers``, ``schedulers``
        (lists of built components) and ``optimizers`` for the sections present. ``model`` and
        the dataloaders are the script's to add.

    Raises:
        ConfigError: listing every problem found.
    """
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    problems: list[str] = []
    allowed = [*SECTIONS, *sections]
    for key in cfg:
        if key not in allowed:
            problems.append(_unknown(str(key), 'top-level section', allowed))
    if 'optimizer' in cfg and 'optimizers' in cfg:
        problems.append('optimizers: give one optimizer, under optimizer: or optimizers:, not both')

    trainer = cfg.get('trainer') or {}
    if not isinstance(trainer, Mapping):
        problems.append(f'trainer: expected a mapping of Trainer arguments, got {trainer!r}')
        trainer = {}
    reserved = _not_under_trainer(sections)
    kwargs = _check_call(Trainer, trainer, 'trainer', problems, supplied=('model',), reserved=reserved)

    for section, registry in COMPONENT_SECTIONS.items():
        if cfg.get(section) is not None:
            kwargs[section] = _build(registry, cfg[section], section, problems)
    for section in ('optimizer', 'optimizers'):
        if cfg.get(section) is not None:
            if params is None:
                raise TypeError(f'the config has an {section}: section; pass the model parameters as params')
            optimizers = _build(OPTIMIZERS, cfg[section], section, problems, params, one=True)
            kwargs['optimizers'] = optimizers[0] if optimizers else None
    if problems:
        raise ConfigError(problems)
    return kwargs


def build(registry: Registry, spec: Any, where: str, *args: Any) -> list[Any]:
    """Build the components ``spec`` names (any form of the module docstring), each as ``factory(*args, **kwargs)``.

    ``where`` is the key path used in messages. Raises :class:`ConfigError` listing every problem.

    Example:
        >>> build(ALGORITHMS, ['uneven_join'], 'algorithms')
        [UnevenJoin(divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False)]
    """
    problems: list[str] = []
    built = _build(registry, spec, where, problems, *args)
    if problems:
        raise ConfigError(problems)
    return built


def build_one(registry: Registry, spec: Any, where: str, *args: Any) -> Any:
    """Like :func:`build`, for a section that must name exactly one component (e.g. ``model:``)."""
    problems: list[str] = []
    built = _build(registry, spec, where, problems, *args, one=True)
    if problems:
        raise ConfigError(problems)
    return built[0]


def check_kwargs(func: Callable[..., Any], kwargs: Mapping[str, Any], where: str, n_args: int = 0) -> dict[str, Any]:
    """Check ``func(<n_args positional>, **kwargs)`` against ``func``'s signature and annotations, without calling it.

    Returns the kwargs, with YAML lists turned into tuples where the annotation asks for a tuple.
    Raises :class:`ConfigError` for unknown or missing arguments and wrong types, and for strings
    that Composer would parse and refuse (time strings such as ``'3ep'``, enum values).

    Example:
        >>> check_kwargs(Trainer, {'max_duration': '2ep', 'progress_bar': 'no'}, 'trainer', n_args=1)
        Traceback (most recent call last):
        ...
        composer_join.config.config.ConfigError: invalid config (1 problem):
          trainer.progress_bar: expected bool, got 'no' (str)
    """
    problems: list[str] = []
    supplied = list(inspect.signature(func).parameters)[:n_args]
    kwargs = _check_call(func, kwargs, where, problems, supplied=supplied)
    if problems:
        raise ConfigError(problems)
    return kwargs


# -- internals ---------------------------------------------------------------------------------------


def _not_under_trainer(sections: Collection[str]) -> dict[str, str]:
    """Trainer arguments a config does not set under ``trainer:``, and why."""
    script = f"the script's {', '.join(sections)} sections" if sections else 'the script'
    built = dict.fromkeys(
        ('model', 'train_dataloader', 'eval_dataloader'), f'is built by {script}, not set under trainer:'
    )
    moved = {
        key: f'goes in the top-level {key}: section, not under trainer:' for key in (*COMPONENT_SECTIONS, 'optimizers')
    }
    return {**built, **moved}


def _build(registry: Registry, spec: Any, where: str, problems: list[str], *args: Any, one: bool = False) -> list[Any]:
    """Append to ``problems`` and build nothing that has one; ``args`` go first to every factory."""
    before = len(problems)
    entries = _entries(spec, where, problems)
    if one and len(entries) != 1:
        if len(problems) == before:
            problems.append(f'{where}: expected exactly one {registry.kind}, got {len(entries)}')
        return []
    built = []
    for at, name, kwargs in entries:
        try:
            factory = registry[name]
        except UnknownNameError as e:
            problems.append(f'{at}: {e}')
            continue
        if not isinstance(kwargs, Mapping):
            problems.append(f'{at}: expected a mapping of keyword arguments for {name}, got {kwargs!r}')
            continue
        before = len(problems)
        sig = _signature(factory)
        supplied = list(sig.parameters)[: len(args)] if sig is not None else []
        reserved = dict.fromkeys(supplied, 'is supplied by the script, not by the config')
        kwargs = _check_call(factory, kwargs, at, problems, supplied=supplied, reserved=reserved)
        if len(problems) == before:
            try:
                built.append(factory(*args, **kwargs))
            except (TypeError, ValueError, ImportError) as e:
                problems.append(f'{at}: {name} refused its arguments: {type(e).__name__}: {e}')
    return built


def _entries(spec: Any, where: str, problems: list[str]) -> list[tuple[str, Any, Any]]:
    """``(key path, name, kwargs)`` for each component of a section, in order."""
    if spec is None:
        return []
    if isinstance(spec, str):
        return [(where, spec, {})]
    if isinstance(spec, Mapping):
        if 'name' in spec:  # llm-foundry's {name: x, kwarg: ...}
            return [(where, spec['name'], {k: v for k, v in spec.items() if k != 'name'})]
        return [(f'{where}.{name}', name, {} if kwargs is None else kwargs) for name, kwargs in spec.items()]
    if isinstance(spec, list):
        entries = []
        for i, item in enumerate(spec):
            at = f'{where}[{i}]'
            if isinstance(item, str) or (isinstance(item, Mapping) and ('name' in item or len(item) == 1)):
                entries.extend(_entries(item, at, problems))
            else:
                problems.append(f'{at}: expected a name or {{name: {{kwargs}}}}, got {item!r}')
        return entries
    problems.append(
        f'{where}: expected a name, a list of names and {{name: {{kwargs}}}}, or a mapping '
        f'{{name: {{kwargs}}}}; got {spec!r}'
    )
    return []


def _check_call(
    func: Callable[..., Any],
    kwargs: Mapping[Any, Any],
    where: str,
    problems: list[str],
    supplied: Collection[str] = (),
    reserved: Optional[Mapping[str, str]] = None,
) -> dict[str, Any]:
    """Append to ``problems`` what is wrong with ``func(<supplied>, **kwargs)``; return the kwargs, conformed."""
    sig = _signature(func)
    if sig is None:  # a builtin without a signature: let the call decide
        return dict(kwargs)
    reserved = reserved or {}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    names = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    settable = [n for n in names if n not in reserved and n not in supplied]
    hints = _hints(func)
    out = {}
    for key, value in kwargs.items():
        at = f'{where}.{key}'
        if key in reserved:
            problems.append(f'{at}: {reserved[key]}')
        elif key not in names and not takes_any:
            problems.append(_unknown(str(key), f'argument of {_name(func)}', settable, at=at))
        else:
            try:
                out[key] = _conform(value, hints[key]) if key in hints else value
            except TypeError as e:
                problems.append(f'{at}: {e}')
    missing = [
        n
        for n in names
        if sig.parameters[n].default is inspect.Parameter.empty and n not in kwargs and n not in supplied
    ]
    if missing:
        problems.append(f'{where}: missing required argument(s) of {_name(func)}: {", ".join(missing)}')
    return out


def _conform(value: Any, hint: Any) -> Any:
    """``value`` if it fits the annotation ``hint`` (a list may stand for a tuple); else TypeError."""
    candidates = [value, tuple(value)] if isinstance(value, list) else [value]
    for candidate in candidates:
        try:
            check_type(candidate, hint, collection_check_strategy=CollectionCheckStrategy.ALL_ITEMS)
        except TypeCheckError:
            continue
        if isinstance(candidate, str):
            _check_parsed_string(candidate, hint)
        return candidate
    raise TypeError(f'expected {_type_name(hint)}, got {value!r} ({type(value).__name__})')


def _check_parsed_string(value: str, hint: Any) -> None:
    """Strings Composer turns into a ``Time`` or an enum member must parse."""
    members = _union_members(hint)
    if str not in members:
        return
    if Time in members:
        try:
            Time.from_timestring(value)
        except ValueError:
            example = "'3ep', '100ba', '2048sp' or '0.5dur'"
            raise TypeError(f'expected a time string such as {example}, got {value!r}') from None
    for member in members:
        if inspect.isclass(member) and issubclass(member, enum.Enum):
            try:
                member(value)
            except ValueError:
                allowed = ', '.join(str(m.value) for m in member)
                raise TypeError(f'expected one of {allowed}, got {value!r}') from None


def _union_members(hint: Any) -> list[Any]:
    if typing.get_origin(hint) is Union:
        return [m for arg in typing.get_args(hint) for m in _union_members(arg)]
    return [hint]


def _unknown(name: str, what: str, allowed: Sequence[str], at: Optional[str] = None) -> str:
    return f'{at or name}: unknown {what}; {did_you_mean(name, allowed) or "allowed: " + ", ".join(allowed)}'


def _signature(func: Callable[..., Any]) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    """Resolved annotations of ``func`` (of ``__init__`` for a class); ``{}`` if they cannot be resolved."""
    try:
        return typing.get_type_hints(func.__init__ if inspect.isclass(func) else func)
    except Exception:  # unresolvable forward references: check names, not types
        return {}


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, '__qualname__', repr(func))


def _type_name(hint: Any) -> str:
    """``Optional[Union[int, composer.core.time.Time]]`` -> ``int | Time | None``."""
    if typing.get_origin(hint) is Union:
        return ' | '.join(_type_name(m) for m in typing.get_args(hint))
    if hint is type(None):
        return 'None'
    name = re.sub(r'\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])', '', inspect.formatannotation(hint))
    return name.replace('NoneType', 'None')
