"""``make test-composer``: Composer's own tests with UnevenJoin injected into every Trainer, compared with stock.

Runs the files of ``suite_config`` from the peers folder (``../shared/peers/composer-v0.32.1``, read-only; its
``pyproject.toml`` is the pytest configuration) in one process and in two (``composer -n 2 -m pytest``, as Composer's
CI does), with ``composer_suite_plugin`` loaded: once with ``COMPOSER_SUITE_INJECT=1``, and once on stock Composer
except for the modes of ``suite_config.BASELINE_MODES`` (two processes), whose stock outcomes come from the
committed ``stock_baseline.json`` while it was made from the same files, deselections and Composer version. Each
run writes junit XML into a temporary folder; a test that passes on stock and does not pass injected is a regression unless ``suite_config.EXPECTED`` names it. Prints, per launch mode and in all: stock passed,
injected passed, expected differences, regressions; exits 1 on any regression or on a run that gave no results.

Hard limits: ``--timeout`` per test (pytest-timeout), the plugin's cap on the gloo timeout, and a subprocess timeout
around each whole run (``--run-timeout``), after which the run's process group is killed.

Usage: ``python tests/composer_suite/run_composer_suite.py [--stock auto|run|baseline] [--write-baseline]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import suite_config  # noqa: E402  (this folder, which is on the path only once the line above ran)

ROOT = HERE.parents[1]
PEERS = Path(os.environ.get('COMPOSER_SUITE_PEERS', ROOT.parent / 'shared' / 'peers' / 'composer-v0.32.1'))
BASELINE = HERE / 'stock_baseline.json'
# Composer's own addopts less --codeblocks (a plugin for its docs' code blocks, not needed for these files).
ADDOPTS = "--strict-markers -m 'not gpu and not doctest and not daily and not remote'"
MODES = {'one': suite_config.ONE_PROCESS, 'two': suite_config.TWO_PROCESSES}
MODE_NAMES = {'one': 'one process', 'two': 'two processes'}


@dataclasses.dataclass
class Run:
    """One pytest session (one launch mode, stock or injected) and where its output goes."""

    mode: str
    inject: bool
    out: Path
    only: tuple[str, ...] = ()  # these node ids instead of the mode's files (a rerun)

    @property
    def name(self) -> str:
        return f'{self.mode}-{"injected" if self.inject else "stock"}' + ('-rerun' if self.only else '')

    @property
    def junit(self) -> Path:
        return self.out / f'{self.name}.xml'

    @property
    def log(self) -> Path:
        return self.out / f'{self.name}.log'

    def command(self, test_timeout: int) -> list[str]:
        pytest_args = [
            '-p', 'composer_suite_plugin', '-p', 'no:cacheprovider', '-o', f'addopts={ADDOPTS}',
            '--timeout', str(test_timeout), '-q', '-rfE', '--junitxml', str(self.junit),
            *(self.only or MODES[self.mode]),
        ]  # fmt: skip
        if self.mode == 'one':
            return [sys.executable, '-m', 'pytest', *pytest_args]
        launcher = str(Path(sys.executable).parent / 'composer')
        ranks = str(self.out / f'{self.name}.rank{{rank}}')
        launch = [launcher, '-n', '2', '--stdout', ranks + '.stdout', '--stderr', ranks + '.stderr', '-m', 'pytest']
        return [*launch, *pytest_args]

    def env(self, dist_timeout: int) -> dict[str, str]:
        tmp = self.out / f'{self.name}.tmp'
        tmp.mkdir()
        path = os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get('PYTHONPATH', '')) if p)
        return dict(
            os.environ,
            PYTHONPATH=path,
            PYTHONDONTWRITEBYTECODE='1',  # nothing is written into the peers folder
            PYTHONUNBUFFERED='1',  # the log shows how far a run got, also when it is killed
            TMPDIR=str(tmp),
            COMPOSER_SUITE_INJECT='1' if self.inject else '0',
            COMPOSER_SUITE_ZERO_EXIT='1',
            COMPOSER_SUITE_DIST_TIMEOUT=str(dist_timeout),
            COMPOSER_SUITE_STATS=str(self.out / f'{self.name}.stats'),
        )

    def start(self, test_timeout: int, dist_timeout: int) -> subprocess.Popen[bytes]:
        what = f'{len(self.only)} tests' if self.only else f'{len(MODES[self.mode])} files'
        print(f'test-composer: {self.name}: {what} ...', flush=True)
        with open(self.log, 'wb') as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                self.command(test_timeout),
                cwd=PEERS,
                env=self.env(dist_timeout),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so that a timeout kills every rank
            )

    def rank_files(self) -> list[Path]:
        if self.mode == 'one':
            return [self.junit]
        return [Path(f'{self.junit}.rank{rank}.xml') for rank in range(2)]

    def trainers(self) -> str:
        """What the plugin counted, e.g. '731 Trainers, 731 injected' (rank 0's)."""
        try:
            stats = json.loads(Path(f'{self.out / self.name}.stats.rank0.json').read_text())
        except (OSError, ValueError):
            return 'no Trainer count'
        return f'{stats["trainers"]} Trainers, {stats["injected"]} injected'


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_all(groups: Sequence[Sequence[Run]], test_timeout: int, dist_timeout: int, run_timeout: int) -> list[str]:
    """Runs each group's runs side by side, group after group; returns the names of runs that did not finish."""
    unfinished = []
    for group in groups:
        started = time.monotonic()
        cpu = _children_cpu()
        procs = [(run, run.start(test_timeout, dist_timeout)) for run in group]
        for run, proc in procs:
            left = max(1.0, run_timeout - (time.monotonic() - started))
            try:
                code = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
            took = time.monotonic() - started
            status = f'exit {code}' if code is not None else f'KILLED after the {run_timeout} s run timeout'
            print(f'test-composer: {run.name}: {status}, {took:.0f} s, {run.trainers()}', flush=True)
            if code != 0:
                unfinished.append(run.name)
                print(f'--- last lines of {run.log} ---')
                print('\n'.join(run.log.read_text(errors='replace').splitlines()[-40:]), flush=True)
        names = ' and '.join(run.name for run in group)
        print(f'test-composer: {names}: {time.monotonic() - started:.0f} s wall, {_children_cpu() - cpu:.0f} s CPU')
    return unfinished


def _nodeid(classname: str, name: str) -> str:
    """pytest's node id from junit's dotted classname ('tests.trainer.test_x.TestY') and test name."""
    parts = classname.split('.')
    for cut in range(len(parts), 0, -1):
        path = '/'.join(parts[:cut]) + '.py'
        if (PEERS / path).is_file():
            return '::'.join([path, *parts[cut:], name])
    return f'{classname}::{name}'


def read_junit(path: Path) -> dict[str, str]:
    """Outcome per node id ('passed', 'failed' or 'skipped') in one junit XML file; {} if it is missing."""
    if not path.is_file():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter('testcase'):
        nodeid = _nodeid(case.get('classname', ''), case.get('name', ''))
        tags = {child.tag for child in case}
        if tags & {'failure', 'error'}:
            outcomes[nodeid] = 'failed'
        elif 'skipped' in tags:
            outcomes[nodeid] = outcomes.get(nodeid, 'skipped')
        else:
            outcomes.setdefault(nodeid, 'passed')
    return outcomes


def combine_ranks(per_rank: Sequence[dict[str, str]]) -> dict[str, str]:
    """A test passed only if it passed on every rank; failed if it failed (or is missing) on any."""
    combined = {}
    for nodeid in set().union(*per_rank):
        seen = [outcomes.get(nodeid, 'missing') for outcomes in per_rank]
        if any(outcome in ('failed', 'missing') for outcome in seen):
            combined[nodeid] = 'failed'
        elif all(outcome == 'passed' for outcome in seen):
            combined[nodeid] = 'passed'
        else:
            combined[nodeid] = 'skipped'
    return combined


def outcomes_of(run: Run) -> dict[str, str]:
    return combine_ranks([read_junit(path) for path in run.rank_files()])


@dataclasses.dataclass
class Comparison:
    """Stock and injected outcomes of one launch mode, compared."""

    stock: dict[str, str]
    injected: dict[str, str]
    rerun: dict[str, str] = dataclasses.field(default_factory=dict)  # the injected outcomes of :func:`rerun_failed`

    def passed(self, outcomes: dict[str, str]) -> int:
        return sum(outcome == 'passed' for outcome in outcomes.values())

    def differing(self) -> list[str]:
        return sorted(t for t, o in self.stock.items() if o == 'passed' and self.injected.get(t) != 'passed')

    def expected(self) -> list[str]:
        return [t for t in self.differing() if suite_config.expected_reason(t)]

    def unexpected(self) -> list[str]:
        return [t for t in self.differing() if not suite_config.expected_reason(t)]

    def flaky(self) -> list[str]:
        """Unexpected differences that passed when run again alone: wall-clock assertions that a loaded machine broke."""
        return [t for t in self.unexpected() if self.rerun.get(t) == 'passed']

    def regressions(self) -> list[str]:
        return [t for t in self.unexpected() if self.rerun.get(t) != 'passed']


def fingerprint(mode: str) -> dict[str, object]:
    """What a mode's stock baseline depends on: the Composer version, the mode's files and the deselections."""
    import composer

    return dict(composer=composer.__version__, files=list(MODES[mode]), deselected=sorted(suite_config.DESELECTED))


def _saved() -> dict[str, dict[str, object]]:
    return json.loads(BASELINE.read_text()) if BASELINE.is_file() else {}


def load_baseline(mode: str) -> dict[str, str] | None:
    """The committed stock outcomes of ``mode``, or None if missing or made from other files or another Composer."""
    saved = _saved().get(mode)
    if saved is None or saved.get('fingerprint') != fingerprint(mode):
        return None
    return saved['outcomes']  # type: ignore[return-value]


def write_baseline(mode: str, stock: dict[str, str]) -> None:
    """Saves ``mode``'s stock outcomes in the baseline file (the other modes' entries are kept)."""
    saved = _saved()
    saved[mode] = {'fingerprint': fingerprint(mode), 'outcomes': dict(sorted(stock.items()))}
    BASELINE.write_text(json.dumps(dict(sorted(saved.items())), indent=1) + '\n')
    print(f'test-composer: wrote the {MODE_NAMES[mode]} stock outcomes to {BASELINE.relative_to(ROOT)} (commit it)')


def report(mode: str, comparison: Comparison, stock_source: str) -> None:
    name = MODE_NAMES[mode]
    print(
        f'test-composer, {name}: stock passed {comparison.passed(comparison.stock)} of {len(comparison.stock)} '
        f'({stock_source}), injected passed {comparison.passed(comparison.injected)} of {len(comparison.injected)}, '
        f'expected differences {len(comparison.expected())}, regressions {len(comparison.regressions())}'
    )
    for nodeid in comparison.expected():
        print(f'  expected: {nodeid}: {suite_config.expected_reason(nodeid)}')
    for nodeid in comparison.flaky():
        print(f'  flaky: {nodeid}: failed with UnevenJoin in the full run, passed when run again alone')
    for nodeid in comparison.regressions():
        outcome = comparison.injected.get(nodeid, 'not run (its session stopped or crashed before it)')
        print(f'  REGRESSION: {nodeid}: passes on stock, {outcome} with UnevenJoin')


def rerun_failed(comparison: Comparison, mode: str, out: Path, args: argparse.Namespace) -> None:
    """Runs the unexpected differences once more, injected and alone (no stock run beside it), into ``rerun``.

    Composer's own tests hold a few wall-clock assertions (e.g. ``test_eval_is_excluded_from_wct_tracking``: four
    training batches in under 0.1 s), which fail on a loaded machine with or without UnevenJoin. A test that
    fails again is a regression; one that passes is reported as flaky.
    """
    failed = tuple(t for t in comparison.unexpected() if t in comparison.injected)
    if failed:
        run = Run(mode, True, out, only=failed)
        run_all([[run]], args.timeout, args.dist_timeout, args.run_timeout)
        comparison.rerun = outcomes_of(run)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
    parser.add_argument(
        '--stock',
        choices=('auto', 'run', 'baseline'),
        default='auto',
        help='auto: for BASELINE_MODES the committed baseline if current, else run stock; run: always run stock',
    )
    parser.add_argument('--write-baseline', action='store_true', help='save the stock outcomes as the baseline')
    parser.add_argument('--timeout', type=int, default=120, help='seconds per test (pytest-timeout)')
    parser.add_argument('--dist-timeout', type=int, default=45, help='seconds: cap on the gloo timeout')
    parser.add_argument('--run-timeout', type=int, default=900, help='seconds per whole run (all ranks killed then)')
    parser.add_argument('--modes', default='one,two', help="'one', 'two' or 'one,two' (processes per run)")
    parser.add_argument('--keep', action='store_true', help='keep the output folder (junit XML, logs)')
    return parser.parse_args(argv)


def plan(modes: Sequence[str], baselines: dict[str, dict[str, str] | None], out: Path) -> list[list[Run]]:
    """Groups of runs to run side by side: the single-process runs together (one core each), each 2-rank run alone."""
    runs = [Run(mode, inject, out) for mode in modes for inject in (False, True) if inject or baselines[mode] is None]
    single = [run for run in runs if run.mode == 'one']
    return ([single] if single else []) + [[run] for run in runs if run.mode == 'two']


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not (PEERS / 'tests' / 'conftest.py').is_file():
        print(f'test-composer: no Composer tests at {PEERS} (set COMPOSER_SUITE_PEERS)', file=sys.stderr)
        return 2
    modes = args.modes.split(',')
    use_baseline = {mode: args.stock != 'run' and mode in suite_config.BASELINE_MODES for mode in modes}
    baselines = {mode: load_baseline(mode) if use_baseline[mode] else None for mode in modes}
    stale = [mode for mode in modes if use_baseline[mode] and baselines[mode] is None]
    if stale and args.stock == 'baseline':
        print(f'test-composer: {BASELINE.name} is missing or stale for {stale}; run with --stock run --write-baseline')
        return 2
    out = Path(tempfile.mkdtemp(prefix='test-composer-'))
    try:
        unfinished = run_all(plan(modes, baselines, out), args.timeout, args.dist_timeout, args.run_timeout)
        comparisons = {}
        for mode in modes:
            stock = baselines[mode]
            if stock is None:
                stock = outcomes_of(Run(mode, False, out))
                if args.write_baseline and f'{mode}-stock' not in unfinished:
                    write_baseline(mode, stock)
            comparisons[mode] = Comparison(stock, outcomes_of(Run(mode, True, out)))
            rerun_failed(comparisons[mode], mode, out, args)
            report(mode, comparisons[mode], 'this run' if baselines[mode] is None else 'baseline')
        differing = [t for c in comparisons.values() for t in c.expected()]
        unused = [
            e for e in suite_config.EXPECTED if e not in differing and e not in {t.split('[', 1)[0] for t in differing}
        ]
        if unused:
            print(f'test-composer: note: expected differences that did not differ: {unused}')
        totals = [
            sum(len(getattr(c, what)()) for c in comparisons.values()) for what in ('expected', 'regressions', 'flaky')
        ]
        stock_passed = sum(c.passed(c.stock) for c in comparisons.values())
        injected_passed = sum(c.passed(c.injected) for c in comparisons.values())
        print(
            f'test-composer: stock passed {stock_passed}, injected passed {injected_passed}, '
            f'expected differences {totals[0]}, regressions {totals[1]}'
            + (f', flaky {totals[2]}' if totals[2] else '')
            + (f'; runs that did not finish: {", ".join(unfinished)}' if unfinished else '')
        )
        if args.keep:
            print(f'test-composer: output kept in {out}')
        empty = [mode for mode, c in comparisons.items() if not c.passed(c.stock)]
        if empty:  # every test skipped (a missing dependency of Composer's fixtures) compares nothing: fail
            print(f'test-composer: no test passed on stock Composer in {empty}: nothing was compared', file=sys.stderr)
        return 1 if totals[1] or unfinished or empty else 0
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main())
