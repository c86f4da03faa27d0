"""CPython 3.11's fork deadlock, mended for the test suite's processes. Not a test module.

A DataLoader with ``num_workers > 0`` started by ``fork`` (Linux's default) forks its workers from a rank whose gloo
threads (``ProcessGroupGloo::runLoop``) destroy finished collectives. When the last reference to a tensor that has a
Python object goes there, torch takes the GIL through pybind11, which creates a Python thread state under the
interpreter's ``HEAD_LOCK`` *without* the GIL. A fork at that moment gives a child that inherits the lock held and
blocks for ever in ``PyOS_AfterFork_Child -> _PyEval_ReInitThreads -> _PyThreadState_DeleteExcept``: the worker
never starts, the rank waits for its first batch, the other ranks in their next collective (python/cpython#112275;
fixed on the 3.11 branch after 3.11.7 by python/cpython#112336, and in 3.12, whose ``PyOS_BeforeFork`` holds
``HEAD_LOCK`` across the fork). Stock Composer hangs the same way: measured with 2 ranks, 2 fork-started workers,
new every epoch, 6 or 7 batches an epoch, on this machine's Python 3.11.7, 9 of 10 runs hung before epoch 300 (at
epochs 25 to 275; stock Composer in 5 of 6, with UnevenJoin in 4 of 4), and 3 of 3 finished with this guard.

:func:`install` (called by ``conftest.py`` and, through its import, by ``rank_worker.py`` in the harness's server,
so every rank and every worker inherits it) does what 3.12 does, as ``pthread_atfork`` handlers
(``fork_guard.c``): the forking thread holds ``HEAD_LOCK`` across ``fork()`` and releases it in the parent and in
the child. It is compiled once per interpreter with the compiler and headers of the machine (``cc``, CPython's own
internal headers) into the temporary folder. It is installed on every CPython 3.11 (on a release with the fix it
changes nothing: the child releases the lock before CPython re-creates it) and on no other Python (3.12 takes the lock
itself, and would wait for it a second time). Users on an affected Python meet the hang with or without UnevenJoin;
docs/limits.md says what they can do.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name('fork_guard.c')

_loaded: ctypes.CDLL | None = None


def needed() -> bool:
    """Whether the guard is installed here: CPython 3.11 (3.11.7, this machine's, has the bug; 3.12 must not have it)."""
    return sys.implementation.name == 'cpython' and sys.version_info[:2] == (3, 11)


def _build() -> Path:
    """The guard's shared library for this interpreter, compiled if it is not there yet (atomically: ranks may race)."""
    include = sysconfig.get_paths()['include']
    key = hashlib.sha256(SOURCE.read_bytes() + sys.version.encode() + include.encode()).hexdigest()[:16]
    library = Path(tempfile.gettempdir()) / f'composer-join-fork-guard-{key}.so'
    if not library.exists():
        partial = library.with_suffix(f'.{os.getpid()}.tmp')
        compiler = sysconfig.get_config_var('CC') or 'cc'
        command = [*compiler.split(), '-shared', '-fPIC', '-O2', f'-I{include}', '-o', str(partial), str(SOURCE)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, library)
    return library


def install() -> None:
    """Register the guard in this process (once; its children inherit it). A no-op where :func:`needed` is false."""
    global _loaded
    if _loaded is not None or not needed():
        return
    try:
        _loaded = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, 'stderr', '') or e
        warnings.warn(
            f'tests/fork_guard.py: not installed, DataLoader workers may hang at fork ({detail})', stacklevel=2
        )


def installed() -> bool:
    """Whether this process holds the guard (a rank answers for itself: ``tests/test_pipelines.py``)."""
    return _loaded is not None
