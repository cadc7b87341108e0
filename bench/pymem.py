"""Where a Python process's memory is, by the line that allocated it: runs a module under
tracemalloc and writes the live allocations' top lines each time it gets SIGUSR2. The memory
counterpart of bench/pyspy.py, for the operator's memory bench (`operator_memory.py --tracemalloc`).

tracemalloc counts only what Python allocates (objects, their buffers), not the interpreter's own
or the allocator's slack, and it slows the process and adds to its RSS: a traced run says where the
memory goes, an untraced run how much there is.

    .venv/bin/python bench/pymem.py DIR -m MODULE [ARGS...]   # DIR/<n>.txt per SIGUSR2
"""
from __future__ import annotations

import linecache
import runpy
import signal
import sys
import tracemalloc
from pathlib import Path

FRAMES = 4   # each allocation's innermost frames: enough to see which caller of json or dict it was
TOP = 30     # lines in each dump


def summary(snapshot: tracemalloc.Snapshot, *, top: int = TOP) -> str:
    """The lines that hold the most live memory (by the innermost frame of this repository or a
    library, whichever allocated), each with its callers, and the total."""
    total = sum(s.size for s in snapshot.statistics("filename"))
    out = [f"live: {total / 2**20:.1f} MiB traced"]
    for stat in snapshot.statistics("traceback")[:top]:
        out.append(f"{stat.size / 2**20:8.2f} MiB {stat.count:9d} blocks")
        for frame in stat.traceback:
            out.append(f"    {frame.filename}:{frame.lineno}  {linecache.getline(frame.filename, frame.lineno).strip()}")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        sys.exit(__doc__.splitlines()[-1].strip())
    out, module = Path(argv[0]), argv[2]
    out.mkdir(parents=True, exist_ok=True)
    dumps = [0]

    def dump(*_: object) -> None:
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        path = out / f"{dumps[0]}.txt"
        path.with_suffix(".tmp").write_text(summary(snap))
        path.with_suffix(".tmp").rename(path)  # whole, or not there: the bench waits for the name
        dumps[0] += 1

    tracemalloc.start(FRAMES)
    signal.signal(signal.SIGUSR2, dump)
    sys.argv = [module, *argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
