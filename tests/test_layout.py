"""The package's layout: subpackages by concern, imports one way only, as each subpackage's docstring says.

Every subpackage's ``__init__`` docstring (and the top-level diagnostics module's) ends its contract with a
line ``May import: a, b, c.`` naming the sibling subpackages it may import from (``nothing`` for none).
These tests read every module's imports with ``ast``, function-level ones included, and fail on an import
cycle between modules, on an import that the importing subpackage's docstring does not allow, and on
allowances that would themselves go round in a circle.
"""

from __future__ import annotations

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import composer_join

PACKAGE = Path(composer_join.__file__).parent
TOP = 'composer_join'


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob('*.py'))}


def imports(path: Path) -> set[str]:
    """The composer_join modules ``path`` imports (``from x import y`` counts ``x.y`` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split('.')[0] == TOP}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f'{path}: relative import (the package uses absolute ones)'
            if node.module and node.module.split('.')[0] == TOP:
                found |= {
                    f'{node.module}.{a.name}' if f'{node.module}.{a.name}' in MODULES else node.module
                    for a in node.names
                }
    return found


def layer(module: str) -> str:
    """``composer_join.join.loader`` -> ``join``; top-level modules are their own layer (``collectives``)."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else TOP


SUBPACKAGES = sorted({layer(m) for m in MODULES if m != TOP})


def allowed(name: str) -> set[str]:
    """What the ``May import:`` line of a subpackage's (or top-level module's) docstring allows."""
    doc = ast.get_docstring(ast.parse(MODULES[f'{TOP}.{name}'].read_text())) or ''
    found = re.search(r'^May import: ([^.(]*)', doc, re.MULTILINE)
    assert found, f'composer_join.{name}: its docstring has no "May import: ..." line'
    names = {n.strip() for n in found.group(1).split(',')} - {'nothing', 'nothing of composer_join outside core'}
    unknown = names - set(SUBPACKAGES)
    assert not unknown, f'composer_join.{name}: "May import" names no subpackage {sorted(unknown)}'
    return names


def test_the_package_is_in_subpackages_by_concern():
    assert set(SUBPACKAGES) == {
        'core',
        'interop',
        'shadow',
        'wrappers',
        'rebalance',
        'data',
        'join',
        'config',
        'collectives',
    }
    flat = sorted(m for m in MODULES if m.count('.') == 1 and (PACKAGE / f'{layer(m)}.py').exists())
    assert flat == ['composer_join.collectives'], f'modules left at the top level: {flat}'


def test_no_import_cycle_between_modules():
    graph = {m: imports(p) - {m} for m, p in MODULES.items() if m != TOP}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        pytest.fail(f'import cycle: {" -> ".join(e.args[1])}')


def test_imports_go_only_where_the_docstrings_allow():
    wrong = []
    for module, path in MODULES.items():
        if module == TOP:
            continue  # the public API imports from anywhere
        here = layer(module)
        for target in imports(path):
            there = layer(target)
            if there != here and there not in allowed(here):
                wrong.append(f'{module} imports {target} ({here} may import: {sorted(allowed(here)) or "nothing"})')
    assert not wrong, '\n'.join(wrong)


def test_the_allowed_directions_go_one_way():
    try:
        order = list(TopologicalSorter({name: allowed(name) for name in SUBPACKAGES}).static_order())
    except CycleError as e:
        pytest.fail(f'the "May import" lines go round in a circle: {" -> ".join(e.args[1])}')
    assert order[0] == 'core' and order[-1] in ('config', 'collectives')


def test_the_public_api_is_unchanged():
    assert composer_join.__all__ == [
        'CollectiveCounter',
        'EpochReport',
        'ExactDistributedSampler',
        'Position',
        'Reading',
        'SampleCountPosition',
        'TrailPosition',
        'UnevenInputsError',
        'UnevenJoin',
        'is_shadow_step',
        'register_position',
    ]
    assert all(getattr(composer_join, name) for name in composer_join.__all__)
