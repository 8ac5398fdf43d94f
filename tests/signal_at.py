"""`python signal_at.py [--signal NAME] POINT ARGS...`: `olmax ARGS...` in this process, which sends itself a signal
(SIGKILL by default) when it reaches POINT, as a host that dies, or is told to stop, at that moment
(tests/storage/test_async_checkpoints.py names the moments of a save this way).

POINT is `module:function[@text][#n]`: the n-th call (the first by default) of that function, counting only the
calls with `text` in one of their arguments; the signal is sent as it is called, before it does anything. For
example `olmax.storage:commit` (a checkpoint's files are in the bucket, its commit marker not yet) or
`olmax.storage:_write@/checkpoints/#12` (the twelfth file of a checkpoint upload). The function is looked
up on its module or class when it is called, as olmax calls it."""

import functools
import importlib
import os
import signal
import sys


def signal_at(point: str, sig: signal.Signals) -> None:
    where, _, nth = point.partition("#")
    where, _, text = where.partition("@")
    module, _, name = where.partition(":")
    owner = importlib.import_module(module)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls = getattr(owner, attr), []

    @functools.wraps(original)
    def signalled(*args, **kwargs):
        if not text or any(text in str(a) for a in (*args, *kwargs.values())):
            calls.append(1)
            if len(calls) == int(nth or 1):
                os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    setattr(owner, attr, signalled)


if __name__ == "__main__":
    argv, sig = sys.argv[1:], signal.SIGKILL
    if argv[0] == "--signal":
        sig, argv = signal.Signals[f"SIG{argv[1]}"], argv[2:]
    signal_at(argv[0], sig)
    from olmax.cli import main

    sys.exit(main(argv[1:]))
