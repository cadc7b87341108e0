"""Started in every Python process below a DDPJob launcher (the launcher puts this folder first
on PYTHONPATH), so that users' own training scripts, unchanged, do not abort after their work
is done.

Why: a DDP model usually sits in a reference cycle (module hooks), so the gloo process group it
holds is freed only by the garbage collection inside interpreter finalization. Freeing it joins
gloo's worker threads, and a worker still dropping its last `Work` needs the GIL for that; a
thread that asks for the GIL while the interpreter is finalizing is made to exit in the middle of
a C++ destructor, which is std::terminate: "terminate called without an active exception",
SIGABRT, and torchrun fails the node (9 in 50 two-node runs of examples/scripts/train.py on a
2-core machine, none in 48 with this). Collecting garbage in an atexit handler frees the group while the
interpreter is still whole. Registered at start-up, the handler runs after every handler the
script registers (atexit runs them last-in, first-out).

It also registers a torchrun worker's stack dump (ddpjob_trainer.stacks.install: faulthandler on
a signal the pod's agent sends before it kills a stalled worker), so that a user's own script
gives its stack as the built-in trainer does; a process that cannot import ddpjob_trainer (another
environment's Python) runs without it.
"""
import atexit
import gc
import os
import sys


def _collect_while_alive() -> None:
    if "torch.distributed" in sys.modules:  # nothing to free in processes that never used it
        gc.collect()


atexit.register(_collect_while_alive)


def _register_stacks() -> None:
    if "RANK" in os.environ:  # a torchrun worker (install checks it runs below a launcher)
        try:
            from ddpjob_trainer import stacks
        except ImportError:
            return
        stacks.install()


_register_stacks()


def _chain() -> None:
    """Import the sitecustomize this one shadows (a distribution's or the image's own), as if
    this folder were not on the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
        if me is not None:
            sys.modules["sitecustomize"] = me
    finally:
        sys.path[:] = saved


_chain()
