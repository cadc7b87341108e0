"""Every worker's Python stack, on request: registered in each worker, captured by its pod's agent.

Why faulthandler on a signal, not py-spy: py-spy reads another process's memory (ptrace,
process_vm_readv), which a pod may not be allowed: Yama's ptrace_scope 1 (Ubuntu's default)
lets a process trace only its own descendants, and py-spy started by the agent is its workers'
sibling, not their ancestor; ptrace_scope 2 needs CAP_SYS_PTRACE, which a pod with its
capabilities dropped does not have; a seccomp profile or a sandboxed runtime (gVisor) may refuse
the calls outright. faulthandler needs nothing: `install` (run in every worker by the exit
guard's sitecustomize, which the launcher puts on every child's PYTHONPATH, so a user's own
torchrun script gets it unchanged) registers a C signal handler that writes every thread's
Python frames to a file the moment the signal arrives, even while the main thread is blocked in
a C call (a collective), without the GIL and without changing what the worker does: a syscall it
interrupts is restarted. It costs nothing until the signal comes, and the dump takes
milliseconds. What it cannot give: native (C/C++) frames, and a stack from a process that
replaced the handler with its own (`capture` then says so instead of signalling it).

`capture` (the agent, `python -m ddpjob_trainer.stacks`) signals the workers, waits up to a
bound for their dumps and returns them; `summary` says which collective a dump's main thread
waits in and its innermost frames, what the operator compares across ranks.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Iterable, Mapping

from ddpjob_api import contract

SIGNAL = getattr(signal, contract.STACK_SIGNAL)
# The first line of a worker's dump file: which thread is the main one (faulthandler names each
# thread by its id only). install writes it; `main_frames` reads it.
HEADER = "ddpjob stacks: rank {rank} pid {pid} main thread 0x{ident:016x}\n"
_HEADER = re.compile(r"^ddpjob stacks: rank (\S+) pid (\d+) main thread 0x([0-9a-f]+)$")
_THREAD = re.compile(r"^(Current thread|Thread) 0x([0-9a-f]+) ")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
# How long a capture waits for the dumps, in all: a handler that runs at all writes within
# milliseconds, later only when the worker waits for a CPU (a loaded node); the kill or restart the
# capture precedes waits no longer than this (a pod's capture is to take 5 s at most).
CAPTURE_SECONDS = 4.0
_POLL = 0.01
CAPTURES_KEPT = 64  # the newest capture records a pod keeps (and serves)

_installed: object = None  # the open dump file (faulthandler holds it too)


def install(env: Mapping[str, str] = os.environ) -> bool:
    """Register the dump in this process when it is a torchrun worker (RANK set) below a launcher
    (contract.ENV_STACKS_DIR set); True when registered. Never raises: a worker must start
    whatever happens here."""
    global _installed
    folder, rank = env.get(contract.ENV_STACKS_DIR), env.get(contract.TORCHRUN_RANK)
    if not folder or rank is None or _installed is not None:
        return False
    try:
        import faulthandler
        import threading

        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, f"{os.getpid()}.txt"), "w")  # noqa: SIM115 - open for the process's life
        f.write(HEADER.format(rank=rank, pid=os.getpid(), ident=threading.main_thread().ident or 0))
        f.flush()
        faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
        _installed = f
        return True
    except (OSError, ValueError, RuntimeError):
        return False


def handles(pid: int, signum: int = SIGNAL) -> bool:
    """True when `pid` catches `signum` (its SigCgt mask): only then is it signalled, since the
    signal's default action would end the process."""
    with suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        """'ddpjob_trainer/debug.py:95 _freeze': the file's last two path parts."""
        return f"{'/'.join(self.file.split('/')[-2:])}:{self.line} {self.func}"


def threads(text: str) -> list[tuple[int, bool, list[Frame]]]:
    """(thread id, is the signalled thread, frames innermost first) of each thread in a dump."""
    out: list[tuple[int, bool, list[Frame]]] = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            out.append((int(m.group(2), 16), m.group(1) == "Current thread", []))
            continue
        f = _FRAME.match(line)
        if f and out:
            out[-1][2].append(Frame(f.group(1), int(f.group(2)), f.group(3)))
    return out


def main_frames(text: str) -> list[Frame]:
    """The main thread's frames in a dump (innermost first); [] when it is not in it."""
    head = _HEADER.match(text.split("\n", 1)[0])
    found = threads(text)
    if head:
        ident = int(head.group(3), 16)
        for tid, _, frames in found:
            if tid == ident:
                return frames
    return next((frames for _, current, frames in found if current), [])


# A frame in one of these is inside a collective: torch.distributed's calls (all_reduce, barrier,
# a Work's wait, ...) and autograd's backward, in which DDP's reducer all-reduces the gradients
# and waits for every rank's.
_COLLECTIVE_FILES = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/distributed.py")
_NOT_COLLECTIVE = {"wrapper", "_time_logger", "_exception_logger", "inner", "__call__", "_wrapped_call_impl",
                   "_call_impl"}


def waiting_in(frames: Iterable[Frame]) -> str:
    """The collective the frames (innermost first) wait in: the outermost of the torch.distributed
    or autograd frames they begin with (other torch frames before those skipped), e.g. `all_reduce`,
    `backward`; "" when they begin in code of the rank's own."""
    found = ""
    for f in frames:  # innermost first: the outermost torch frame is the call the trainer made
        path = f.file.replace("\\", "/")
        if not found and "torch/" not in path:
            return ""  # the innermost frames are the rank's own: it waits in no collective
        if any(part in path for part in _COLLECTIVE_FILES):
            if f.func not in _NOT_COLLECTIVE:
                # DDP's forward and backward hooks collect too (buffers, the bucket order), in C++.
                found = f"DistributedDataParallel.{f.func}" if path.endswith(_COLLECTIVE_FILES[-1]) else f.func
        elif found:
            break
    return found


def summary(text: str) -> tuple[str, str]:
    """(waiting, frames) of a dump: the collective its main thread waits in ("" when none) and its
    innermost contract.STACK_FRAMES frames, bounded (a STACK_CAPTURE series' labels)."""
    frames = main_frames(text)
    shown = contract.STACK_FRAME_SEPARATOR.join(f.short() for f in frames[:contract.STACK_FRAMES])
    return waiting_in(frames), shown[:contract.STACK_FRAMES_CHARS]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def capture(pids: Mapping[int, int], folder: str, *, seconds: float = CAPTURE_SECONDS,
            clock=time.monotonic) -> dict[int, str]:
    """{rank: its worker's dump} of the workers `pids` ({rank: pid}): each is signalled (if it
    handles the signal) and its dump read once written, all within about `seconds`. A worker
    that gives none gets a line saying why instead."""
    out: dict[int, str] = {}
    pending: dict[int, tuple[str, int, str]] = {}
    for rank, pid in pids.items():
        path = os.path.join(folder, f"{pid}.txt")
        before = _size(path)
        if before < 0 or not handles(pid):
            out[rank] = f"(no stack: pid {pid} has no dump registered on {contract.STACK_SIGNAL})\n"
            continue
        try:
            with open(path) as f:
                head = f.readline()
            os.kill(pid, SIGNAL)
        except OSError as exc:
            out[rank] = f"(no stack: pid {pid}: {exc})\n"
            continue
        pending[rank] = (path, before, head)
    deadline = clock() + seconds
    last: dict[int, int] = {}
    while pending:
        time.sleep(_POLL)
        for rank, (path, before, head) in list(pending.items()):
            size = _size(path)
            # Done when the dump grew and stayed the same for one poll (the handler writes it at once).
            if size > before and last.get(rank) == size:
                with open(path, "rb") as f:
                    f.seek(before)
                    body = f.read(contract.STACK_TEXT_BYTES).decode(errors="replace")
                out[rank] = head + body
                del pending[rank]
            last[rank] = size
        if clock() >= deadline:
            for rank, (_, _, _) in pending.items():
                out[rank] = f"(no stack: pid {pids[rank]} wrote none within {seconds:g}s)\n"
            break
    return out


def keep(folder: str, record: dict) -> None:
    """Keep one capture record (contract.STACKS_PATH serves them), the newest CAPTURES_KEPT only."""
    where = os.path.join(folder, "captures")
    os.makedirs(where, exist_ok=True)
    name = f"{time.time_ns():020d}-rank-{record['rank']}.json"
    tmp = os.path.join(where, "." + name)
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(where, name))
    for old in sorted(n for n in os.listdir(where) if n.endswith(".json"))[:-CAPTURES_KEPT]:
        with suppress(OSError):
            os.unlink(os.path.join(where, old))


def kept(folder: str) -> list[dict]:
    """The capture records kept in `folder`, oldest first (what contract.STACKS_PATH serves)."""
    where = os.path.join(folder, "captures")
    try:
        names = sorted(n for n in os.listdir(where) if n.endswith(".json"))
    except OSError:
        return []
    out = []
    for name in names[-CAPTURES_KEPT:]:
        try:
            with open(os.path.join(where, name)) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # removed meanwhile, or torn: the next look has it
    return out


def _workers() -> dict[int, tuple[int, str]]:
    """{rank: (pid, stacks folder)} of this machine's workers that registered a dump (their env)."""
    import psutil

    out: dict[int, tuple[int, str]] = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        folder, rank = env.get(contract.ENV_STACKS_DIR), env.get(contract.TORCHRUN_RANK, "")
        # A worker's own Python subprocesses inherit its RANK: the worker is the one started first.
        if (folder and rank.isdigit() and proc.pid != os.getpid()
                and os.path.exists(os.path.join(folder, f"{proc.pid}.txt"))
                and (int(rank) not in out or proc.pid < out[int(rank)][0])):
            out[int(rank)] = (proc.pid, folder)
    return out


def main() -> int:
    """`python -m ddpjob_trainer.stacks`: print every worker's stack on this machine (pod) now
    (what `ddpjob stacks NAME` runs in each pod through pods/exec)."""
    found = _workers()
    if not found:
        print("no worker with a registered stack dump runs here", file=sys.stderr)
        return 1
    by_folder: dict[str, dict[int, int]] = {}
    for rank, (pid, folder) in found.items():
        by_folder.setdefault(folder, {})[rank] = pid
    for folder, pids in by_folder.items():
        for rank, text in sorted(capture(pids, folder).items()):
            waiting, _ = summary(text)
            print(contract.stack_capture_text({"rank": rank, "attempt": os.environ.get(contract.ENV_ATTEMPT, "?"),
                                  "restart": "now", "trigger": "requested", "time": time.time(),
                                  "waiting": waiting, "text": text}, where=f" (pid {pids[rank]})"), end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
