"""The launcher's process tree: children that die with it, orphans re-parented to it, and a
bounded stop of everything below it (psutil reads the tree; prctl is the one ctypes call)."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from contextlib import suppress
from typing import Callable, Sequence

import psutil

from ddpjob_api import contract

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


# Resolved once, on import in the parent: a preexec_fn runs between fork and exec, where dlopen
# (taking locks another thread of the parent may have held at fork time) could deadlock the child.
try:
    _libc_prctl: Callable[..., int] | None = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux (glibc)
    _libc_prctl = None


def prctl(option: int, value: int) -> bool:
    """prctl(2); False where it is missing (not Linux/glibc) or fails. PR_SET_PDEATHSIG and
    PR_SET_CHILD_SUBREAPER have no well-kept Python binding (psutil has neither)."""
    return _libc_prctl is not None and _libc_prctl(option, value) == 0


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> None:
    """preexec_fn: the child gets `sig` when its parent dies, even by SIGKILL (Linux).

    With `parent` (the caller's pid, e.g. `functools.partial(die_with_parent, os.getpid())`), a
    parent that died before the prctl took effect kills the child at once instead of leaving it.
    Elsewhere Ctrl-C and SIGTERM still stop the group; a SIGKILLed parent may not.
    """
    if prctl(_PR_SET_PDEATHSIG, sig) and parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def become_subreaper() -> bool:
    """Orphans below this process (torchrun's workers once their agent is gone) are re-parented
    to it instead of init, so `stop_tree` still finds them. False where unsupported."""
    return prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _below(root: int) -> list[psutil.Process]:
    try:
        return psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal_all(pids, groups, sig: int) -> None:
    """`sig` once to each process: the groups, then the pids outside them. Twice would be a second
    Ctrl-C to a launcher (StopSignals.hurry: SIGKILL at once, no grace for a rank to end its run)."""
    done: set[int] = set()
    for pgid in groups:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
            done.add(pgid)
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) not in done:
                os.kill(pid, sig)


def _live_below(me: int, keep: set[int], owned: Callable[[int], bool] | None) -> list[int]:
    """Live (non-zombie) processes below `me` — with `owned`, only those below one of `keep` or
    for which owned(pid) holds. Reaps zombie children that no Popen object owns (orphans
    re-parented to this subreaper), never those in `keep` (Popen reaps its own)."""
    below = _below(me)
    if owned is not None:
        mine = keep.union(*({p.pid for p in _below(r)} for r in keep))
        below = [p for p in below if p.pid in mine or owned(p.pid)]
    live = []
    for p in below:
        try:
            zombie, ppid = p.status() == psutil.STATUS_ZOMBIE, p.ppid()
        except psutil.NoSuchProcess:  # exited and reaped meanwhile
            continue
        if not zombie:
            live.append(p.pid)
        elif ppid == me and p.pid not in keep:
            with suppress(ChildProcessError):
                os.waitpid(p.pid, os.WNOHANG)
    return live


def stop_tree(children: Sequence[subprocess.Popen], *, grace: float, hurry: Callable[[], bool] = lambda: False,
              owned: Callable[[int], bool] | None = None, kill_wait: float = contract.LAUNCHER_KILL_WAIT) -> list[int]:
    """Stop every process below this one: SIGTERM, up to `grace` seconds to exit, then SIGKILL.

    `children` are this process's Popen children, each the leader of its own session: their
    groups are signalled too (all that works without /proc), and they are polled, never reaped
    behind Popen's back. With `owned`, other processes below this one are only touched when they
    descend from `children` or owned(pid) is true (e.g. they carry the run's environment: orphans
    re-parented here). Processes forked while stopping are signalled as they appear. Bounded:
    returns within about grace + kill_wait seconds whatever the processes do, with the pids
    still there then (stuck in uninterruptible kernel sleep), normally [].
    """
    me = os.getpid()
    keep = {c.pid for c in children}
    groups = [c.pid for c in children if c.poll() is None]

    def alive() -> list[int]:
        running = {c.pid for c in children if c.poll() is None}
        return sorted(running.union(_live_below(me, keep, owned)))

    pids = alive()
    _signal_all(pids, groups, signal.SIGTERM)
    signalled = set(pids)
    until = time.monotonic() + grace
    while pids and time.monotonic() < until and not hurry():
        time.sleep(0.05)
        pids = alive()
        fresh = [p for p in pids if p not in signalled]
        _signal_all(fresh, (), signal.SIGTERM)
        signalled.update(fresh)
    until = time.monotonic() + kill_wait
    while pids:
        _signal_all(pids, groups, signal.SIGKILL)
        if time.monotonic() >= until:
            return pids
        time.sleep(0.05)
        pids = alive()
    return []


def end_child(child: subprocess.Popen, *, seconds: float) -> None:
    """SIGTERM to a side process of the launcher's, SIGKILL to its session after `seconds`; bounded
    even when it is stuck in the kernel (an NVML call on a lost GPU): then stop_tree reports it."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            with suppress(subprocess.TimeoutExpired):
                child.wait(timeout=contract.LAUNCHER_KILL_WAIT)
