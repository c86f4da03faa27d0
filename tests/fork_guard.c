/* Test-only: CPython 3.12's mend of python/cpython#112275 (on the 3.11 branch after 3.11.7: #112336), as
 * pthread_atfork handlers, for CPython 3.11. See fork_guard.py. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <pthread.h>
#include "internal/pycore_runtime.h"

/* Inside fork(), in the forking thread (which holds the GIL): wait until no thread is in one of HEAD_LOCK's critical
 * sections, and hold it across the fork, as CPython 3.12's PyOS_BeforeFork does. */
static void hold(void) { PyThread_acquire_lock(_PyRuntime.interpreters.mutex, WAIT_LOCK); }

/* In the parent and in the child, before PyOS_AfterFork_Child takes it again. */
static void release(void) { PyThread_release_lock(_PyRuntime.interpreters.mutex); }

__attribute__((constructor)) static void install(void) { pthread_atfork(hold, release, release); }
