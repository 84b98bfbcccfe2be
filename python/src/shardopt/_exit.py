"""At exit, ranks in the control plane say whether they finished or failed:
an uncaught exception fails them (sys.excepthook), a normal exit finishes
them (atexit). `import shardopt` installs both (_install(), the last thing
the package's __init__ does); ShardedOptimizer adds the optimizer that joins
the control plane to _live."""

import atexit
import sys
import weakref

_live = weakref.WeakSet()
# Run after every optimizer has finished (in order): the coordinator rank 0
# serves under srun waits there for the other ranks' end.
_after_finish = []
_previous_excepthook = None  # sys.excepthook as _install() found it


def _excepthook(kind, value, tb):
    for opt in list(_live):
        if not opt._finished:
            opt._finished = True
            opt._core.fail(f"{kind.__name__}: {value}")
    _previous_excepthook(kind, value, tb)


def _at_exit():
    try:
        for opt in list(_live):
            opt.finish()
    finally:
        for fn in _after_finish:
            fn()


def _install():
    global _previous_excepthook
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    atexit.register(_at_exit)
