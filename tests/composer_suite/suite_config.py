"""What ``make test-composer`` runs of Composer's own tests, and which differences from stock Composer are expected.

Read by the runner (``run_composer_suite.py``) and, for ``DESELECTED``, by the pytest plugin
(``composer_suite_plugin.py``). Paths and node ids are relative to the peers folder
(``../shared/peers/composer-v0.32.1``). Changing ``ONE_PROCESS``, ``TWO_PROCESSES`` or ``DESELECTED`` makes the
committed stock baseline stale: the runner then runs stock Composer too (``--refresh-baseline`` rewrites it).
"""

from __future__ import annotations

COMPOSER_VERSION = '0.32.1'

# Files that build Trainers (trainer, checkpoint, eval, predict, DDP sync strategies, callbacks, events) and the
# one that counts algorithms; run in one process, so their world_size(1) tests run.
ONE_PROCESS: tuple[str, ...] = (
    'tests/trainer/test_trainer.py',
    'tests/trainer/test_predict.py',
    'tests/trainer/test_ddp_sync_strategy.py',
    'tests/trainer/test_ddp.py',
    'tests/trainer/test_dataspec.py',
    'tests/test_events.py',
    'tests/callbacks/test_load_checkpoint.py',
    'tests/callbacks/test_checkpoint_saver.py',
    'tests/callbacks/test_early_stopper.py',
    'tests/callbacks/test_threshold_stopper.py',
    'tests/callbacks/test_optimizer_monitor.py',
    'tests/callbacks/test_speed_monitor.py',
    'tests/callbacks/test_runtime_estimator.py',
)

# Launched as Composer's CI does (``composer -n 2 -m pytest``, gloo on CPU): their world_size(2) tests run.
TWO_PROCESSES: tuple[str, ...] = (
    'tests/trainer/test_trainer.py',
    'tests/trainer/test_trainer_eval.py',
    'tests/trainer/test_ddp.py',
    'tests/trainer/test_ddp_sync_strategy.py',
    'tests/trainer/test_checkpoint.py',
    'tests/trainer/test_fsdp_checkpoint.py',
    'tests/test_events.py',
)

# Modes whose stock outcomes come from the committed baseline (stock_baseline.json) instead of a run: a two-rank
# run takes both cores, while a single-process stock run costs no wall time beside the injected one (one core each).
BASELINE_MODES: tuple[str, ...] = ('two',)

# Tests removed from both runs, each with its reason. (The tokenizer tests need none: the plugin gives them a
# local stand-in.)
_COMPILE = 'torch.compile with inductor on CPU: over two minutes per test, nothing about data; out of the CI budget'
DESELECTED: dict[str, str] = {
    'tests/trainer/test_trainer.py::TestTrainerInitOrFit::test_compile_uncompile_model_weights_trainer_fit[True]': _COMPILE,
    'tests/trainer/test_trainer.py::TestTrainerInitOrFit::test_compile_uncompile_model_weights_trainer_fit[False]': _COMPILE,
}

_ASSERTS_TRUNCATION = (
    "asserts Composer's truncation of uneven data (rank 1 has 8 more samples; the test expects every epoch to stop "
    'at the shortest rank, 16 samples): UnevenJoin trains all 20 by design'
)

# Tests that pass on stock Composer and are expected to fail with UnevenJoin injected, by node id prefix (a
# parametrized test's every case), each with its reason. Nothing else may differ. (Adding
# tests/algorithms/test_required_on_load.py would add its test_autoload here: it counts the Trainer's algorithms
# after loading a checkpoint, so it sees the injected UnevenJoin.)
EXPECTED: dict[str, str] = {
    'tests/trainer/test_trainer.py::TestTrainerInitOrFit::test_rank_dependent_dataloader_lengths': _ASSERTS_TRUNCATION,
}


def expected_reason(nodeid: str) -> str | None:
    """The reason ``nodeid`` may differ from stock, or None: the entry equal to it or to its unparametrized name."""
    return EXPECTED.get(nodeid) or EXPECTED.get(nodeid.split('[', 1)[0])
