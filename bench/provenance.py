"""Where a benchmark result comes from. Every bench writes its JSON through `Provenance.write`.

The docs quote results under bench/results/ as what the code of their commit does
(hack/gen-docs.py), so a result must come from that commit and nothing else:

- a bench refuses to start, and again to write under bench/results/, while the tree has uncommitted
  changes (untracked files included) under the paths it measures (bench/results/ itself aside);
- it refuses to write there when HEAD moved while it ran;
- every result records, under "provenance": the commit, the command line, the machine (cores,
  memory), the 1-minute load average before and after the run, and the paths it measured.

A result written anywhere else (a scratch --out) is never refused: a dirty tree's result lists
the uncommitted paths instead, so that it cannot pass for a committed one. A copy of the tree
without git (a lent GPU machine) names its commit in DDPJOB_BENCH_COMMIT; the result says so.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = "bench/results"
COMMIT_ENV = "DDPJOB_BENCH_COMMIT"


class UncommittedChanges(SystemExit):
    """The bench stops: a result under bench/results/ would not be its commit's. SystemExit, so the
    command ends with the message and status 1, not a traceback."""

    def __init__(self, message: str):
        super().__init__(f"bench: {message}")


def _git(repo: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """The machine a result was measured on."""
    memory = _memory_bytes()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpus": os.cpu_count(), "cpus_usable": usable,
            "memory_gib": round(memory / 2**30, 1) if memory else None,
            "platform": platform.platform(), "python": platform.python_version()}


class Provenance:
    """Made when a bench starts, before it spends any time: `Provenance("api", "operator", "bench", out=args.out)`
    names the paths (relative to the repository) whose code the bench measures and where its result
    goes; a result bound for bench/results/ from a tree it may not come from is refused here."""

    def __init__(self, *measured: str, out: str | Path, repo: Path = REPO, argv: Sequence[str] | None = None):
        if not measured:
            raise ValueError("name the paths the bench measures")
        self.repo, self.measured, self.out = repo.resolve(), tuple(measured), Path(out).resolve()
        argv = list(sys.argv if argv is None else argv)
        script = Path(argv[0]).resolve() if argv else None
        if script is not None and script.is_relative_to(self.repo):
            argv[0] = str(script.relative_to(self.repo))
        self.command = shlex.join(argv)
        self.load_before = round(os.getloadavg()[0], 2)
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.in_git = _git(repo, "rev-parse", "HEAD") is not None
        self.commit = self._head()
        self.dirty_at_start = self.uncommitted()
        self._check()

    def _head(self) -> str | None:
        head = _git(self.repo, "rev-parse", "HEAD")
        return head.strip() if head else os.environ.get(COMMIT_ENV) or None

    def uncommitted(self) -> list[str]:
        """Paths under the measured ones that differ from HEAD (untracked ones too, ignored ones
        not), bench/results/ left out: results and their logs are what a bench writes."""
        if not self.in_git:
            return []
        out = _git(self.repo, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--",
                   *self.measured, f":(exclude){RESULTS}") or ""
        paths, entries = [], iter(out.split("\0"))
        for entry in entries:
            if entry:
                paths.append(entry[3:])
                if entry[0] in "RC":    # a rename or copy: its old path comes next
                    next(entries, None)
        return sorted(paths)

    def _check(self) -> None:
        """Refuse a result bound for bench/results/ unless it is HEAD's, HEAD being the commit the bench began on."""
        if not self.out.is_relative_to(self.repo / RESULTS):
            return
        dirty = sorted(set(self.dirty_at_start) | set(self.uncommitted()))
        if dirty:
            raise UncommittedChanges(
                f"uncommitted changes under the paths this bench measures ({', '.join(self.measured)}): "
                f"{', '.join(dirty)}. Commit them first (a result under {RESULTS}/ is quoted as its commit's), "
                "or write to a scratch --out outside it")
        if self.commit is None:
            raise UncommittedChanges(
                f"no commit: this tree is not a git checkout; name the commit it is a clean copy of in {COMMIT_ENV}")
        if self.in_git and self._head() != self.commit:
            raise UncommittedChanges(f"HEAD moved while the bench ran ({self.commit[:12]} -> "
                                     f"{(self._head() or '?')[:12]}): its result is neither commit's")

    def record(self) -> dict[str, Any]:
        """What a result says about where it comes from (the load 'after' is read now)."""
        out: dict[str, Any] = {
            "commit": self.commit, "command": self.command, "measured_paths": list(self.measured),
            "machine": machine(), "load_1min": {"before": self.load_before, "after": round(os.getloadavg()[0], 2)},
            "started": self.started, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if not self.in_git and self.commit:
            out["commit_from"] = f"{COMMIT_ENV} (no git checkout: the caller names the commit the tree is a copy of)"
        dirty = sorted(set(self.dirty_at_start) | set(self.uncommitted()))
        if dirty:
            out["uncommitted"] = dirty
        return out

    def write(self, result: dict[str, Any], *, indent: int = 2) -> Path:
        """Write `result` and its provenance to the bench's out (checked again: the tree may have
        changed while the bench ran). A bench may write after every run: each write is checked."""
        self._check()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({**result, "provenance": self.record()}, indent=indent) + "\n")
        return self.out
