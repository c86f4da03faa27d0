"""One rank of a :func:`harness.launch`: run the calls in order, save the results. Not a test module.

``harness`` forks each rank from its server and calls :func:`main` then :func:`leave`; run as a script
(``python rank_worker.py SPEC OUT_PREFIX``, with the rank's environment), it does the same.
"""

import importlib
import logging
import os
import pickle
import sys
import traceback
import warnings
from pathlib import Path

import torch
from composer.utils import collect_env

sys.path.insert(0, str(Path(__file__).parent))

import devices
import fork_guard
import rank_scenarios
from harness import RankError

# Every Trainer() logs the CPU's model, which py-cpuinfo reads by starting a Python subprocess (about 1 s of CPU);
# Composer caches the answer per process. Asked here, at import, it is asked once in the harness's server and every
# rank forked from it inherits the cached answer.
collect_env.get_cpu_model()
# Installed in the server, so every rank and its DataLoader workers inherit it (tests/fork_guard.py).
fork_guard.install()


def _resolve(function: str):
    """``'name'`` in ``rank_scenarios``, or ``'module:name'`` in another module of ``tests/``."""
    module, _, name = function.rpartition(':')
    return getattr(importlib.import_module(module) if module else rank_scenarios, name)


def main(spec_path: str, out_prefix: str) -> None:
    warnings.filterwarnings('ignore')
    logging.basicConfig(level=logging.WARNING)
    spec = pickle.loads(Path(spec_path).read_bytes())
    # torch reads TORCH_DISTRIBUTED_DEBUG once, at import: in the harness's server, before this launch's environment
    # was set. Read it again, so that this launch's value (e.g. DETAIL, tests/test_detail.py) is the one in force.
    torch.distributed.set_debug_level_from_env()
    devices.init_rank(spec['collective_timeout'])
    torch.set_num_threads(1)
    results = {}
    for name, function, kwargs in spec['calls']:
        Path(out_prefix + '.running').write_text(name)
        try:
            results[name] = _resolve(function)(**kwargs)
        except Exception as e:  # recorded: the test decides whether it was expected
            traceback.print_exc()
            results[name] = RankError(type(e).__name__, str(e))
    torch.save(results, out_prefix + '.pt')


def leave() -> None:
    """Exit at once, the results saved.

    Without the interpreter's finalization, which torch 2.7's gloo worker threads can abort (SIGABRT,
    "terminate called without an active exception") when they still hold work objects with tensors in
    them (pytorch/pytorch#179291). A rank that raised or died before this still exits non-zero, and the
    harness reports it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2])
    leave()
