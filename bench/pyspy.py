"""py-spy on a running process, from outside (no change to what is measured), and the text summary
of its samples that bench/results/ keeps: the top frames of the flame graph.

`Sampler(pid, path)` records the process's stacks in py-spy's collapsed ("raw") format, one line
per distinct stack with its sample count, until `stop()`; `top_frames(path)` reads such a file and
returns the frames that hold most samples: inclusive (the frame anywhere in the stack: the width
of its bar in a flame graph), self (the frame on top: where the CPU is) and per package (the
module a frame's file belongs to). Only the thread that holds the GIL is sampled (--gil): the
shares are of the Python CPU time the operator spends, which is what a pure-Python process can
spend at most one core of; threads waiting on a socket or a lock do not count.

    .venv/bin/python bench/pyspy.py SAMPLES.txt [--top 25]      # print the summary of a recording
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

RATE = 25  # samples per second: py-spy's default is 100; a quarter keeps its own CPU low on 2 cores
# "function (path/to/file.py:123)" -> ("function", "path/to/file.py")
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


def _py_spy() -> str:
    """The py-spy of this venv (the test extra installs it), else one on PATH."""
    own = Path(sys.executable).with_name("py-spy")
    return str(own) if own.exists() else "py-spy"


class Sampler:
    """`py-spy record` of `pid` into `path` (collapsed stacks), from now until stop()."""

    def __init__(self, pid: int, path: Path, *, rate: int = RATE) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(path.with_suffix(".log"), "w")  # noqa: SIM115  (the child's for its lifetime)
        # --nonblocking: never pause the operator to read its memory (the sampled process runs as
        # it would unprofiled; a sample may rarely be torn).
        self.proc = subprocess.Popen([_py_spy(), "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate),
                                      "--nonblocking", "--gil", "--output", str(path)],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> Path | None:
        """Stop sampling and write the file (py-spy writes it on SIGINT); None when it recorded nothing."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.path if self.path.exists() and self.path.stat().st_size else None


def _frame_key(frame: str) -> tuple[str, str]:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip(), ""
    return m["fn"], m["file"]


def package_of(file: str) -> str:
    """The top-level package (or stdlib module) a frame's file belongs to: ddpjob_operator.cluster,
    kubernetes, json, asyncio, ...; "?" for a frame that names no file (a torn sample, --nonblocking)."""
    if not Path(file).name:
        return "?"
    parts = Path(file).with_suffix("").parts
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    elif any(p.startswith("python3") for p in parts):
        i = max(i for i, p in enumerate(parts) if p.startswith("python3"))
        parts = parts[i + 1:]
    for i, p in enumerate(parts):
        if p in ("ddpjob_operator", "ddpjob_trainer", "ddpjob_cli"):
            return ".".join(parts[i:i + 2])
    return parts[0] if parts else file


def read_stacks(path: Path) -> list[tuple[list[tuple[str, str]], int]]:
    """(frames root first, sample count) of each line of a collapsed-stack file."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append(([_frame_key(f) for f in stack.split(";")], int(count)))
    return out


def top_frames(path: Path, *, top: int = 25) -> dict:
    """The summary of one recording: total samples, and the `top` frames by inclusive and by self
    samples, and the packages by self samples, each with its share of all samples."""
    stacks = read_stacks(path)
    total = sum(n for _, n in stacks)
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    packages: collections.Counter = collections.Counter()
    for frames, n in stacks:
        for key in set(frames):
            inclusive[key] += n
        if frames:
            own[frames[-1]] += n
            packages[package_of(frames[-1][1])] += n

    def rows(counter: collections.Counter) -> list[dict]:
        return [{"frame": f"{fn} ({file})" if file else fn, "samples": n, "share": round(n / total, 3)}
                for (fn, file), n in counter.most_common(top)]
    return {"samples": total, "inclusive": rows(inclusive), "self": rows(own),
            "packages": [{"package": p, "samples": n, "share": round(n / total, 3)}
                         for p, n in packages.most_common(top)]}


def render(summary: dict, title: str = "") -> str:
    """The summary as text (what bench/results/ keeps beside the raw samples)."""
    lines = [title] if title else []
    lines.append(f"{summary['samples']} samples ({RATE}/s of the thread holding the GIL)")
    for key, label in (("inclusive", "inclusive (flame graph width)"), ("self", "self (top of stack)"),
                       ("packages", "self by package")):
        lines.append(f"\n{label}:")
        for row in summary[key]:
            lines.append(f"  {100 * row['share']:5.1f}%  {row['samples']:7d}  {row.get('frame') or row.get('package')}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description="Summarize a py-spy collapsed-stack recording (top frames).")
    ap.add_argument("samples", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    sys.stdout.write(render(top_frames(args.samples, top=args.top), title=os.fspath(args.samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
