"""The launcher's exit guard (ddpjob_trainer/launch/exitguard/sitecustomize.py): users' own scripts,
unchanged, free their process group before interpreter finalization, where gloo's threads abort
the process. Real child interpreters; the abort itself is a race, so these tests observe the
mechanism: when a reference cycle (as a DDP model makes) is freed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ddpjob_trainer.launch.node import EXIT_GUARD, with_exit_guard

# A cycle whose finalizer reports whether the interpreter was already finalizing when it ran.
CYCLE = textwrap.dedent("""
    import sys
    import torch.distributed

    class Held:
        def __del__(self):
            print("freed while finalizing:", sys.is_finalizing(), flush=True)

    held = Held()
    held.me = held
    del held
""")


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.parametrize("before, after", [
    (None, EXIT_GUARD),
    ("", EXIT_GUARD),
    ("/a", f"{EXIT_GUARD}:/a"),
    (f"/a:{EXIT_GUARD}:/b", f"{EXIT_GUARD}:/a:/b"),  # a launcher below a launcher adds it once
    ("/a::/b", f"{EXIT_GUARD}:/a::/b"),  # an empty entry (the working directory) is the user's
])
def test_the_guard_goes_first_and_the_users_path_is_kept(before, after):
    env = {"HOME": "/h"} if before is None else {"HOME": "/h", "PYTHONPATH": before}
    assert with_exit_guard(env) == {"HOME": "/h", "PYTHONPATH": after}


@pytest.mark.parametrize("guarded, finalizing", [(True, False), (False, True)])
def test_a_cycle_is_freed_while_the_interpreter_is_whole(guarded, finalizing):
    """Unguarded, the cycle (and with it a DDP model's process group) is freed by the collection
    inside finalization: the case that aborts."""
    env = with_exit_guard(plain_env()) if guarded else plain_env()
    proc = run_python(CYCLE, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"freed while finalizing: {finalizing}\n"


def test_the_sitecustomize_it_shadows_still_runs(tmp_path):
    """An image's own sitecustomize (Debian's, a company's) is imported too, as without the guard."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nprint('theirs ran', flush=True)\n")
    env = with_exit_guard({**plain_env(), "PYTHONPATH": str(theirs)})
    proc = run_python(CYCLE + "import sitecustomize; print(sitecustomize.__file__)\n", env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "theirs ran", str(theirs / "sitecustomize.py"), "freed while finalizing: False"]


def test_the_launchers_child_runs_guarded(termination_log, monkeypatch, tmp_path):
    """The real launcher: its child (torchrun, the user's command) gets the guard, and the user's
    own PYTHONPATH after it."""
    from ddpjob_trainer.launch.node import main

    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("PYTHONPATH", "/opt/mine")
    out = tmp_path / "path.txt"
    script = f"import os; open({str(out)!r}, 'w').write(os.environ['PYTHONPATH'])"
    assert main(["--", sys.executable, "-c", script]) == 0
    assert out.read_text() == f"{EXIT_GUARD}{os.pathsep}/opt/mine"
