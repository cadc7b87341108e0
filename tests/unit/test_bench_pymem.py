"""bench/pymem.py, the memory bench's tracer: a module run under it answers SIGUSR2 with the lines
that hold its live memory, the biggest first."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.support.cluster import wait_for

REPO = Path(__file__).resolve().parents[2]

HOLDER = '''
import signal, sys
HELD = [bytes(1000) for _ in range(20_000)]  # about 20 MiB, from this line
small = [bytes(1000) for _ in range(200)]
print("ready", flush=True)
while True:
    signal.pause()
'''


def test_a_dump_names_the_line_that_holds_the_memory(tmp_path):
    (tmp_path / "holder.py").write_text(HOLDER)
    out = tmp_path / "dumps"
    proc = subprocess.Popen([sys.executable, str(REPO / "bench/pymem.py"), str(out), "-m", "holder"],
                            cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR2)
        dump = wait_for(lambda: (out / "0.txt").exists() and (out / "0.txt").read_text(),
                        timeout=60, desc="the first dump")
    finally:
        proc.kill()
        proc.wait()
    lines = dump.splitlines()
    total = float(lines[0].split()[1])
    assert lines[0].startswith("live:") and total >= 19, lines[0]
    first = next(i for i, line in enumerate(lines) if "MiB" in line and "blocks" in line)
    size = float(lines[first].split()[0])
    assert size >= 19, lines[first]
    # The biggest entry's frames name the holder's line; the small list comes later, if at all.
    entry = lines[first + 1:first + 1 + 4]
    assert any("HELD = [bytes(1000)" in f for f in entry), entry
