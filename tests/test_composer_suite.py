"""The parts of ``make test-composer`` that decide its verdict: injection, junit parsing, rank merging, comparison.

The target itself (Composer's tests, minutes of CPU) runs from ``.ci/run``; these check, in a second, that the
plugin appends exactly one UnevenJoin and that a test missing or failing on any rank counts as a regression.
"""

import sys
from pathlib import Path

from composer.algorithms import LabelSmoothing

from composer_join import UnevenJoin

sys.path.insert(0, str(Path(__file__).parent / 'composer_suite'))

import composer_suite_plugin as plugin
import run_composer_suite as runner
import suite_config


def test_injection_appends_one_uneven_join_to_any_algorithms_argument():
    smoothing = LabelSmoothing(0.1)
    for given in (None, smoothing, [smoothing], (smoothing,)):
        algorithms = plugin._with_uneven_join(given)
        assert [type(a) for a in algorithms][-1] is UnevenJoin
        assert len(algorithms) == (0 if given is None else 1) + 1
    already = [UnevenJoin(), smoothing]
    assert plugin._with_uneven_join(already) == already


def _junit(path: Path, cases: str) -> Path:
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    return path


def test_junit_outcomes_by_node_id(tmp_path, monkeypatch):
    (tmp_path / 'tests' / 'trainer').mkdir(parents=True)
    (tmp_path / 'tests' / 'trainer' / 'test_x.py').write_text('')
    monkeypatch.setattr(runner, 'PEERS', tmp_path)
    xml = _junit(
        tmp_path / 'r.xml',
        '<testcase classname="tests.trainer.test_x.TestA" name="test_a[1]"/>'
        '<testcase classname="tests.trainer.test_x" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.trainer.test_x" name="test_c"><skipped message="y"/></testcase>'
        '<testcase classname="tests.trainer.test_x" name="test_d"/>'
        '<testcase classname="tests.trainer.test_x" name="test_d"><error message="teardown"/></testcase>',
    )
    assert runner.read_junit(xml) == {
        'tests/trainer/test_x.py::TestA::test_a[1]': 'passed',
        'tests/trainer/test_x.py::test_b': 'failed',
        'tests/trainer/test_x.py::test_c': 'skipped',
        'tests/trainer/test_x.py::test_d': 'failed',
    }
    assert runner.read_junit(tmp_path / 'missing.xml') == {}


def test_a_test_passes_only_if_it_passes_on_every_rank():
    rank0 = {'a': 'passed', 'b': 'passed', 'c': 'skipped', 'd': 'passed'}
    rank1 = {'a': 'passed', 'b': 'failed', 'c': 'skipped'}
    assert runner.combine_ranks([rank0, rank1]) == {'a': 'passed', 'b': 'failed', 'c': 'skipped', 'd': 'failed'}


def test_regressions_are_stock_passes_that_do_not_pass_injected_unless_expected():
    truncation = 'tests/trainer/test_trainer.py::TestTrainerInitOrFit::test_rank_dependent_dataloader_lengths'
    assert suite_config.expected_reason(truncation)
    stock = {truncation: 'passed', 'ok': 'passed', 'lost': 'passed', 'broke': 'passed', 'bad': 'failed'}
    injected = {truncation: 'failed', 'ok': 'passed', 'broke': 'failed', 'bad': 'failed'}
    comparison = runner.Comparison(stock, injected)
    assert comparison.expected() == [truncation]
    assert comparison.regressions() == ['broke', 'lost']  # 'lost': missing from the injected run (a crash)
    assert (comparison.passed(stock), comparison.passed(injected)) == (4, 1)


def test_a_difference_that_passes_when_run_again_alone_is_flaky_not_a_regression():
    stock = {'timing': 'passed', 'broke': 'passed', 'lost': 'passed'}
    injected = {'timing': 'failed', 'broke': 'failed'}
    comparison = runner.Comparison(stock, injected, rerun={'timing': 'passed', 'broke': 'failed'})
    assert comparison.flaky() == ['timing']
    assert comparison.regressions() == ['broke', 'lost']  # failed again; never ran (its session crashed)
    assert runner.Comparison(stock, injected).regressions() == ['broke', 'lost', 'timing']  # no rerun: all count


def test_a_rerun_runs_only_the_injected_failures(tmp_path):
    run = runner.Run('one', True, tmp_path, only=('tests/x.py::test_a',))
    assert run.name == 'one-injected-rerun'
    assert run.command(60)[-1] == 'tests/x.py::test_a' and 'tests/trainer/test_trainer.py' not in run.command(60)
