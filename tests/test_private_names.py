"""Private names of other packages live in one module (``composer_join.core.compat``), and fail clearly (issue 34).

* every private name the package reads is there on the installed torch, Composer and torchmetrics
  (``compat.missing()``);
* no other module of the package names one of them in code (attribute, import or string), and none imports a
  private name of another package at all;
* a name missing from an installed version raises an error naming it, the package's installed version and the
  versions tested, instead of an ``AttributeError`` deep inside a run;
* importing the package imports no private name of another package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import composer_join
from composer_join.core import compat

PACKAGE = Path(composer_join.__file__).parent
COMPAT = PACKAGE / 'core' / 'compat.py'


def _code_names(path: Path) -> tuple[set[str], set[str], list[str]]:
    """``(attribute names, string constants outside docstrings, private names imported from other packages)``."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    strings = {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    }
    imported = [
        f'{node.module}.{a.name}'
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith('composer_join')
        for a in node.names
        if a.name.startswith('_') and not a.name.startswith('__')
    ]
    return attributes, strings, imported


def _private(name: str) -> bool:
    return name.startswith('_') and not name.startswith('__')


def test_the_installed_versions_have_every_private_name():
    assert compat.missing() == []


def _defined_here(paths: list[Path]) -> set[str]:
    """Private names the package defines itself: attributes it assigns, functions, classes, module globals."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if _private(n)}


def test_no_other_module_names_a_private_name_of_another_package():
    # a private attribute read anywhere but core/compat.py must be one the package defines itself
    paths = [p for p in sorted(PACKAGE.rglob('*.py')) if p != COMPAT]
    ours = _defined_here(paths)
    attributes, strings, _ = _code_names(COMPAT)
    theirs = {n for n in attributes | strings if _private(n)} - ours
    assert {'_rebuild_buckets', '_BufferCommHookLocation', '_dataloader_len', '_update_count'} <= theirs
    found = []
    for path in paths:
        attrs, texts, imported = _code_names(path)
        named = sorted(n for n in attrs if _private(n) and n not in ours) + sorted(theirs & texts)
        if named or imported:
            found.append(f'{path.relative_to(PACKAGE)}: {named + imported}')
    assert not found, 'private names of other packages outside composer_join.core.compat:\n' + '\n'.join(found)


def test_a_missing_name_says_which_the_installed_version_and_the_tested_ones():
    with pytest.raises(compat.CompatError) as raised:
        compat.private(object(), '_register_buffer_comm_hook', 'torch')
    message = str(raised.value)
    import torch

    assert 'object._register_buffer_comm_hook' in message and torch.__version__.split('+')[0] in message
    assert compat.TESTED in message
    with pytest.raises(compat.CompatError, match=r'composer\.core\.data_spec\._no_such_split'):
        compat.private('composer.core.data_spec', '_no_such_split', 'composer')


def test_importing_the_package_imports_no_private_name():
    # no module of the package holds another package's private function, class or value as a global
    import importlib

    found = []
    for path in sorted(PACKAGE.rglob('*.py')):
        name = '.'.join(path.relative_to(PACKAGE.parent).with_suffix('').parts).removesuffix('.__init__')
        module = importlib.import_module(name)
        for key, value in vars(module).items():
            origin = getattr(value, '__module__', None)
            if _private(key) and isinstance(origin, str) and not origin.startswith('composer_join'):
                found.append(f'{name}.{key} (from {origin})')
    assert not found, found
