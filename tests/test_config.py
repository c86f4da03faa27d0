"""Single-process tests of YAML configs: loading, checking, the registries and the entry point."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import composer.algorithms
import pytest
import torch
from composer.algorithms import EMA, GradientClipping
from composer.callbacks import LRMonitor
from composer.core import Algorithm
from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledSGDW

from composer_join import UnevenJoin
from composer_join.config.config import ConfigError, build, build_one, check_kwargs, load_config, trainer_kwargs
from composer_join.config.registry import ALGORITHMS, OPTIMIZERS, Registry, UnknownNameError, snake_case

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / 'configs').glob('*.yaml'))
sys.path.insert(0, str(ROOT / 'examples'))
from data import DATASETS  # noqa: E402
from models import MODELS  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def params():
    return torch.nn.Linear(2, 2).parameters()


def problems(cfg, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        trainer_kwargs(cfg, params(), **kwargs)
    return info.value.problems


# -- registry ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ('name', 'snake'),
    [
        ('GradientClipping', 'gradient_clipping'),
        ('EMA', 'ema'),
        ('LRMonitor', 'lr_monitor'),
        ('DecoupledAdamW', 'decoupled_adamw'),
        ('NaNMonitor', 'nan_monitor'),
        ('WandBLogger', 'wandb_logger'),
        ('CosineAnnealingWithWarmupScheduler', 'cosine_annealing_with_warmup_scheduler'),
        ('uneven_join', 'uneven_join'),
    ],
)
def test_snake_case(name, snake):
    assert snake_case(name) == snake


def test_algorithm_registry_holds_uneven_join_and_every_composer_algorithm():
    assert ALGORITHMS['uneven_join'] is UnevenJoin
    expected = {
        snake_case(n)
        for n in composer.algorithms.__all__
        if isinstance(getattr(composer.algorithms, n), type) and issubclass(getattr(composer.algorithms, n), Algorithm)
    }
    assert expected <= set(ALGORITHMS.names)
    assert ALGORITHMS['gradient_clipping'] is GradientClipping and ALGORITHMS['ema'] is EMA


def test_lookup_ignores_case_and_underscores():
    assert ALGORITHMS['GradientClipping'] is ALGORITHMS['gradientclipping'] is GradientClipping
    assert OPTIMIZERS['RMSprop'] is OPTIMIZERS['rmsprop'] is torch.optim.RMSprop
    assert 'Uneven-Join' in ALGORITHMS and 'nope' not in ALGORITHMS


def test_unknown_name_lists_close_matches_and_all_names():
    with pytest.raises(UnknownNameError) as info:
        ALGORITHMS['uneven_jion']
    message = str(info.value)
    assert "unknown algorithm 'uneven_jion'; did you mean 'uneven_join'?" in message
    assert 'allowed: alibi, ' in message and 'weight_standardization' in message


def test_register_refuses_a_name_twice():
    reg = Registry('thing', {'a_b': int})
    with pytest.raises(ValueError, match='already registered'):
        reg.register('AB', float)


def test_entry_point_loads_and_builds_the_algorithm():
    (entry,) = [e for e in importlib.metadata.entry_points(group='llmfoundry_algorithms') if e.name == 'uneven_join']
    cls = entry.load()
    assert cls is UnevenJoin is ALGORITHMS['uneven_join']
    algo = cls(throw_on_early_termination=True)
    assert isinstance(algo, UnevenJoin) and algo.throw_on_early_termination


# -- loading -------------------------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / 'cfg.yaml'
    path.write_text(text)
    return path


def test_load_config_overrides_and_interpolation(tmp_path):
    path = write(tmp_path, 'variables: {n: 2}\ntrainer:\n  max_duration: ${variables.n}ep\n  seed: 1\n')
    cfg = load_config(path, ['variables.n=5', 'trainer.seed=7', 'algorithms=[uneven_join]'])
    assert cfg.trainer.max_duration == '5ep' and cfg.trainer.seed == 7
    assert list(cfg.algorithms) == ['uneven_join']


@pytest.mark.parametrize(
    ('text', 'overrides', 'expected'),
    [
        (
            'trainer:\n  run_name: ${variables.nope}\n',
            [],
            "trainer.run_name: Interpolation key 'variables.nope' not found",
        ),
        ('trainer: {}\n', ['trainer.seed'], "'trainer.seed': an override is key.path=value"),
        ('- a\n- b\n', [], 'the top level must be a mapping of sections'),
        ('trainer: [\n', [], 'cfg.yaml'),
    ],
)
def test_load_config_errors_name_the_key(tmp_path, text, overrides, expected):
    with pytest.raises(ConfigError, match='invalid config') as info:
        load_config(write(tmp_path, text), overrides)
    assert expected in str(info.value)


def test_load_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r'nope\.yaml'):
        load_config(tmp_path / 'nope.yaml')


# -- checking and building -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    'algorithms',
    [
        ['uneven_join', {'gradient_clipping': {'clipping_type': 'norm', 'clipping_threshold': 1.0}}],
        {'uneven_join': None, 'gradient_clipping': {'clipping_type': 'norm', 'clipping_threshold': 1.0}},
        [{'uneven_join': {}}, {'name': 'gradient_clipping', 'clipping_type': 'norm', 'clipping_threshold': 1.0}],
    ],
)
def test_component_section_forms_build_the_same(algorithms):
    kwargs = trainer_kwargs({'algorithms': algorithms})
    assert [type(a) for a in kwargs['algorithms']] == [UnevenJoin, GradientClipping]
    assert kwargs['algorithms'][1].clipping_threshold == 1.0


def test_trainer_kwargs_builds_every_section():
    cfg = {
        'variables': {'anything': [1, 2]},
        'trainer': {
            'max_duration': '2ep',
            'device_train_microbatch_size': 4,
            'ddp_sync_strategy': 'multi_auto_sync',
            'precision': 'fp32',
            'eval_interval': 1,
            'progress_bar': False,
            'scale_schedule_ratio': 1,
        },
        'algorithms': {'uneven_join': {'divide_by_initial_world_size': False}},
        'callbacks': ['lr_monitor'],
        'loggers': {'in_memory_logger': {}},
        'optimizer': {'name': 'decoupled_sgdw', 'lr': 0.1, 'momentum': 0.9},
        'schedulers': [{'cosine_annealing_with_warmup_scheduler': {'t_warmup': '0.1dur'}}],
        'data': {'whatever': 1},
    }
    kwargs = trainer_kwargs(cfg, params(), sections=['data'])
    assert kwargs['max_duration'] == '2ep' and kwargs['ddp_sync_strategy'] == 'multi_auto_sync'
    assert kwargs['algorithms'][0].divide_by_initial_world_size is False
    assert isinstance(kwargs['callbacks'][0], LRMonitor)
    assert type(kwargs['loggers'][0]).__name__ == 'InMemoryLogger'
    assert isinstance(kwargs['optimizers'], DecoupledSGDW) and kwargs['optimizers'].defaults['momentum'] == 0.9
    assert isinstance(kwargs['schedulers'][0], CosineAnnealingWithWarmupScheduler)


def test_yaml_list_stands_for_a_tuple():
    kwargs = trainer_kwargs({'optimizers': {'adamw': {'lr': 1e-3, 'betas': [0.8, 0.9]}}}, params())
    assert kwargs['optimizers'].defaults['betas'] == (0.8, 0.9)


@pytest.mark.parametrize(
    ('cfg', 'expected'),
    [
        (
            {'trainer': {'max_duraton': '1ep'}},
            "trainer.max_duraton: unknown argument of Trainer; did you mean 'max_duration'?",
        ),
        ({'trainer': {'zzzz': 1}}, 'trainer.zzzz: unknown argument of Trainer; allowed: train_dataloader_label, '),
        ({'trainer': {'progress_bar': 'maybe'}}, "trainer.progress_bar: expected bool, got 'maybe' (str)"),
        ({'trainer': {'max_duration': 2.5}}, 'trainer.max_duration: expected int | str | Time | None, got 2.5 (float)'),
        ({'trainer': {'max_duration': '3 epochs'}}, "trainer.max_duration: expected a time string such as '3ep'"),
        (
            {'trainer': {'ddp_sync_strategy': 'sometimes'}},
            "trainer.ddp_sync_strategy: expected one of single_auto_sync, multi_auto_sync, forced_sync, got 'sometimes'",
        ),
        (
            {'trainer': {'load_ignore_keys': ['a', 1]}},
            "trainer.load_ignore_keys: expected list[str] | Callable[[dict], None] | None, got ['a', 1]",
        ),
        ({'trainer': {'algorithms': ['uneven_join']}}, 'trainer.algorithms: goes in the top-level algorithms: section'),
        ({'trainer': {'model': 'x'}}, 'trainer.model: is built by the script'),
        ({'trainer': ['max_duration']}, 'trainer: expected a mapping of Trainer arguments'),
        ({'algorithm': ['uneven_join']}, "algorithm: unknown top-level section; did you mean 'algorithms'?"),
        (
            {'algorithms': ['uneven_jion']},
            "algorithms[0]: unknown algorithm 'uneven_jion'; did you mean 'uneven_join'?",
        ),
        (
            {'algorithms': {'uneven_join': {'throw_on_early_terminaton': True}}},
            'algorithms.uneven_join.throw_on_early_terminaton: unknown argument of UnevenJoin; '
            "did you mean 'throw_on_early_termination'?",
        ),
        ({'algorithms': {'uneven_join': {'enable': 'yes'}}}, "algorithms.uneven_join.enable: expected bool, got 'yes'"),
        (
            {'algorithms': ['gradient_clipping']},
            'algorithms[0]: missing required argument(s) of GradientClipping: clipping_type',
        ),
        (
            {'algorithms': {'ema': {'half_life': 'soon'}}},
            'algorithms.ema: ema refused its arguments: ValueError: Invalid time string: soon',
        ),
        ({'algorithms': [['uneven_join']]}, 'algorithms[0]: expected a name or {name: {kwargs}}'),
        ({'algorithms': {'uneven_join': 3}}, 'algorithms.uneven_join: expected a mapping of keyword arguments'),
        ({'callbacks': ['lr_monitr']}, "callbacks[0]: unknown callback 'lr_monitr'; did you mean 'lr_monitor', "),
        ({'loggers': ['file_loger']}, "loggers[0]: unknown logger 'file_loger'; did you mean 'file_logger'"),
        (
            {'schedulers': ['cosine_annealing_with_warmup_scheduler']},
            'schedulers[0]: missing required argument(s) of CosineAnnealingWithWarmupScheduler: t_warmup',
        ),
        ({'optimizer': ['sgd', 'adam']}, 'optimizer: expected exactly one optimizer, got 2'),
        ({'optimizer': {'sgd': {'params': [], 'lr': 0.1}}}, 'optimizer.sgd.params: is supplied by the script'),
        ({'optimizer': {'sgd': {'lr': 'fast'}}}, "optimizer.sgd.lr: expected float | Tensor, got 'fast' (str)"),
        ({'optimizer': 'sgd', 'optimizers': 'adam'}, 'give one optimizer, under optimizer: or optimizers:'),
    ],
)
def test_problems_name_the_key_and_what_is_allowed(cfg, expected):
    found = problems(cfg)
    assert any(expected in p for p in found), found


def test_every_problem_is_reported_at_once():
    found = problems({'trainer': {'max_duraton': '1ep', 'seed': 'x'}, 'algorithms': ['nope'], 'extra': {}})
    assert len(found) == 4, found
    with pytest.raises(ConfigError, match=r'invalid config \(4 problems\):\n  '):
        trainer_kwargs({'trainer': {'max_duraton': '1ep', 'seed': 'x'}, 'algorithms': ['nope'], 'extra': {}})


def test_check_kwargs_and_build_helpers():
    assert check_kwargs(torch.optim.Adam, {'betas': [0.5, 0.6]}, 'opt', n_args=1) == {'betas': (0.5, 0.6)}
    assert [type(a) for a in build(ALGORITHMS, ['uneven_join', 'ema'], 'algorithms')] == [UnevenJoin, EMA]
    with pytest.raises(ConfigError, match='model: expected exactly one model, got 0'):
        build_one(MODELS, None, 'model')


# -- the shipped configs -------------------------------------------------------------------------------


def test_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {'digits_uneven.yaml', 'digits_microbatch.yaml', 'digits_throw.yaml', 'text_token_budget.yaml'} <= names


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    cfg = load_config(path)
    model = build_one(MODELS, cfg.get('model'), 'model')
    kwargs = trainer_kwargs(cfg, model.parameters(), sections=('data', 'model'))
    assert any(isinstance(a, UnevenJoin) for a in kwargs['algorithms'])
    assert kwargs['optimizers'] is not None


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: p.name)
def test_shipped_config_shards_are_uneven_on_two_ranks(path, monkeypatch):
    cfg = load_config(path)
    batches = []
    monkeypatch.setenv('WORLD_SIZE', '2')
    for rank in (0, 1):
        monkeypatch.setenv('RANK', str(rank))
        batches.append(len(build_one(DATASETS, cfg.data, 'data').train))
    assert batches[0] != batches[1], batches


def test_token_budget_batches_respect_the_budget():
    loaders = DATASETS['pydoc_text'](tokens_per_batch=512, max_length=64, fraction=0.2)
    sizes = [inputs.numel() for inputs, labels in loaders.train]
    assert len(sizes) == len(loaders.train) and max(sizes) <= 512
    assert len({inputs.shape for inputs, _ in loaders.train}) > 1  # batch shapes vary with the lengths
