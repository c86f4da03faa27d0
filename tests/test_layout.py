"""The package's layout: subpackages by concern, imports one way only, as each subpackage's docstring says.

import-linter checks the imports, function-level ones included, against the contracts in ``pyproject.toml``
(``[tool.importlinter]``): the layers (a subpackage imports only those below it), no import cycle between
sibling modules or subpackages at any depth, nothing inside importing the public API, and per subpackage what
its docstring's ``May import: a, b, c.`` line leaves out of the layers below it. ``make lint`` runs it too.
These tests run it, show that a wrong import breaks it, and check what it cannot: that every docstring's
``May import`` line says what the contracts say (so neither drifts), that no module is left at the top level
but ``collectives``, and the public API.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import composer_join

try:
    import tomllib
except ImportError:  # Python 3.10; import-linter itself depends on tomli there
    import tomli as tomllib

PACKAGE = Path(composer_join.__file__).parent
ROOT = PACKAGE.parent
TOP = 'composer_join'
CONFIG = tomllib.loads((ROOT / 'pyproject.toml').read_text())['tool']['importlinter']
CONTRACTS = {c['id']: c for c in CONFIG['contracts']}
LINT_IMPORTS = 'from importlinter.cli import lint_imports_command; lint_imports_command()'  # the lint-imports script


def lint_imports(cwd: Path) -> tuple[int, str]:
    """``lint-imports`` in ``cwd`` (it finds the package and ``pyproject.toml`` there): its exit code and output.

    No cache is left behind; the output's colours are taken out."""
    run = subprocess.run(
        [sys.executable, '-c', LINT_IMPORTS, '--no-cache'],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return run.returncode, re.sub(r'\x1b\[[0-9;]*m', '', run.stdout + run.stderr)


def broken(output: str) -> set[str]:
    """The ids of the contracts an output reports broken."""
    names = {c['name']: id_ for id_, c in CONTRACTS.items()}
    return {names[line.removesuffix('BROKEN').strip()] for line in output.splitlines() if line.endswith(' BROKEN')}


def layers() -> list[set[str]]:
    """The layers contract's layers, top first, each a set of subpackage names (``a | b``: two independent ones)."""
    contract = CONTRACTS['layers']
    assert contract['type'] == 'layers' and contract['containers'] == [TOP] and contract['exhaustive']
    return [{name.strip() for name in layer.split('|')} for layer in contract['layers']]


SUBPACKAGES = sorted(set().union(*layers()))


def allowed(name: str) -> set[str]:
    """What the ``May import:`` line of a subpackage's (or top-level module's) docstring allows."""
    path = PACKAGE / name / '__init__.py' if (PACKAGE / name).is_dir() else PACKAGE / f'{name}.py'
    doc = ast.get_docstring(ast.parse(path.read_text())) or ''
    found = re.search(r'^May import: ([^.(]*)', doc, re.MULTILINE)
    assert found, f'composer_join.{name}: its docstring has no "May import: ..." line'
    names = {n.strip() for n in found.group(1).split(',')} - {'nothing', 'nothing of composer_join outside core'}
    unknown = names - set(SUBPACKAGES)
    assert not unknown, f'composer_join.{name}: "May import" names no subpackage {sorted(unknown)}'
    return names


def test_the_import_contracts_are_kept():
    code, output = lint_imports(ROOT)
    assert code == 0, output
    files = len(list(PACKAGE.rglob('*.py')))
    assert f'Analyzed {files} files' in output, output  # this tree's package, every module of it
    assert f'Contracts: {len(CONTRACTS)} kept, 0 broken.' in output, output


@pytest.mark.parametrize(
    'module, line, contract',
    [
        ('core/errors.py', 'from composer_join.join.algorithm import UnevenJoin', 'layers'),  # upward
        ('data/sampler.py', 'import composer_join.shadow.shadow', 'data'),  # below, but not in its May import line
        ('config/registry.py', 'from composer_join.core.errors import UnevenInputsError', 'config'),
        ('join/loader.py', 'from composer_join.join import algorithm', 'acyclic'),  # algorithm imports loader
        ('collectives.py', 'from composer_join import UnevenJoin', 'no-root'),
    ],
)
def test_a_wrong_import_breaks_a_contract(tmp_path, module, line, contract):
    """On a copy of the package, a function-level import against the layout breaks the contract that forbids it."""
    shutil.copytree(PACKAGE, tmp_path / TOP, ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / 'pyproject.toml', tmp_path)
    with open(tmp_path / TOP / module, 'a') as f:
        f.write(f'\n\ndef _wrong():\n    {line}\n')
    code, output = lint_imports(tmp_path)
    assert code == 1, output
    assert contract in broken(output), output


def test_the_may_import_lines_say_what_the_contracts_say():
    """Each docstring's line names exactly the subpackages below it in the layers, less its forbidden contract's."""
    forbidden: dict[str, set[str]] = {name: set() for name in SUBPACKAGES}
    for contract in CONTRACTS.values():
        if contract['type'] == 'forbidden' and contract.get('allow_indirect_imports'):
            (source,) = [m.removeprefix(f'{TOP}.') for m in contract['source_modules']]
            forbidden[source] |= {m.removeprefix(f'{TOP}.') for m in contract['forbidden_modules']}
    order = layers()
    wrong = []
    for i, layer in enumerate(order):
        below = set().union(*order[i + 1 :])
        for name in sorted(layer):
            if allowed(name) != below - forbidden[name]:
                wrong.append(
                    f'composer_join.{name}: "May import: {", ".join(sorted(allowed(name))) or "nothing"}", '
                    f'the contracts: {", ".join(sorted(below - forbidden[name])) or "nothing"}'
                )
    assert not wrong, '\n'.join(wrong)


def test_no_module_is_left_at_the_top_level_but_collectives():
    on_disk = {p.stem for p in PACKAGE.iterdir() if p.suffix == '.py' or (p / '__init__.py').exists()} - {'__init__'}
    assert on_disk == set(SUBPACKAGES), 'pyproject.toml [tool.importlinter]: the layers name every subpackage'
    flat = sorted(name for name in SUBPACKAGES if (PACKAGE / f'{name}.py').exists())
    assert flat == ['collectives'], f'modules left at the top level: {flat}'


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
        'launcher_compat',
        'register_position',
    ]
    assert all(getattr(composer_join, name) for name in composer_join.__all__)


MAX_CLASS_LINES, MAX_ATTRIBUTES = 300, 15  # issue 41: no room as crowded as JoinLoader's 27 attributes were


def class_sizes(source: str) -> dict[str, tuple[int, int]]:
    """Per class of ``source``: its lines (docstrings included) and instance attributes (``self.x = ...`` anywhere in
    it, dataclass and NamedTuple fields)."""
    sizes = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            names = {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name)
                and n.value.id == 'self'
            }
            names |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            sizes[node.name] = (node.end_lineno - node.lineno + 1, len(names))
    return sizes


def test_class_sizes_are_measured_as_stated():
    lines, attributes = class_sizes('class A:\n    x: int\n    def f(self):\n        self.y = self.z = 1\n')['A']
    assert (lines, attributes) == (4, 3)


def test_no_class_is_over_300_lines_or_15_instance_attributes_and_every_module_says_what_it_owns():
    crowded, silent = [], []
    for path in sorted(PACKAGE.rglob('*.py')):
        source = path.read_text()
        if not ast.get_docstring(ast.parse(source)):
            silent.append(str(path.relative_to(ROOT)))
        for name, (lines, attributes) in class_sizes(source).items():
            if lines > MAX_CLASS_LINES or attributes > MAX_ATTRIBUTES:
                crowded.append(f'{path.relative_to(ROOT)}:{name} ({lines} lines, {attributes} attributes)')
    assert not crowded, f'over {MAX_CLASS_LINES} lines or {MAX_ATTRIBUTES} instance attributes: {crowded}'
    assert not silent, f'modules without a docstring: {silent}'
