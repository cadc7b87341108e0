"""torchapi: the one home of torch names that are private or newer than pyproject's floor.

`make test-floor` runs this file again on the trainer image's torch (hack/versions.env), so each
fallback is proven on the version that needs it and the public path on the newest.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import datetime as dt

import pytest
import torch
import torch.distributed as dist

from ddpjob_trainer import torchapi

TRAINER = Path(__file__).resolve().parents[2] / "trainer" / "ddpjob_trainer"


def _private_torch_names(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"{node.module}:{p}" for p in parts if p.startswith("_") and p != "__future__"]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch") and "._" in a.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in ("torch", "dist", "dcp"):
                found.append(ast.unparse(node))
    return found


def test_no_trainer_module_but_torchapi_names_a_private_torch_api():
    offenders = {p.name: names for p in sorted(TRAINER.rglob("*.py"))
                 if p.name != "torchapi.py" and (names := _private_torch_names(p))}
    assert offenders == {}, f"private torch names outside torchapi.py: {offenders}"


def test_the_guard_sees_a_private_import():
    src = "from torch.distributed._shard._utils import narrow_tensor_by_index\nx = dist._set_pg_timeout\n"
    path = TRAINER.parent / "no-such-module.py"
    try:
        path.write_text(src)
        assert len(_private_torch_names(path)) == 3
    finally:
        path.unlink()


# Two ranks over a FileStore: rank 1 shortens the default group's timeout with torchapi.set_timeout,
# then enters an all-reduce rank 0 never joins. Rank 0 stays in the group (its exit would fail the
# all-reduce at once, for another reason) until rank 1 is done. Without a working set_timeout the
# all-reduce waits the group's 30 minutes and pytest's timeout fails the test.
_RANK = textwrap.dedent("""
    import datetime as dt, os, sys, time
    import torch, torch.distributed as dist
    from ddpjob_trainer import torchapi
    rank, store, done = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=dt.timedelta(minutes=30))
    if rank == 0:
        while not os.path.exists(done):
            time.sleep(0.05)
        os._exit(0)
    torchapi.set_timeout(dt.timedelta(seconds=1))
    try:
        dist.all_reduce(torch.zeros(1))
    except (RuntimeError, dist.DistBackendError) as exc:
        print("raised:", exc)
    open(done, "w").close()
    os._exit(0)
""")


@pytest.mark.skipif(not torchapi.TIMEOUT_SETTABLE_FOR_GLOO,
                    reason=f"torch {torch.__version__} cannot change a gloo group's timeout: the next test covers it")
def test_set_timeout_shortens_a_live_groups_collectives(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    args = [str(tmp_path / "store"), str(tmp_path / "done")]
    peer = subprocess.Popen([sys.executable, str(script), "0", *args])
    try:
        out = subprocess.run([sys.executable, str(script), "1", *args], capture_output=True, text=True,
                             timeout=600)
    finally:
        (tmp_path / "done").touch()
        peer.wait(timeout=60)
    assert "raised:" in out.stdout and "imed out" in out.stdout, (torch.__version__, out.stdout, out.stderr)


@pytest.mark.skipif(torchapi.TIMEOUT_SETTABLE_FOR_GLOO,
                    reason=f"torch {torch.__version__} has the public set_timeout: the previous test covers it")
def test_on_older_torch_set_timeout_uses_the_private_spelling_and_says_gloo_keeps_its_timeout():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert torchapi.set_timeout(dt.timedelta(seconds=5)) is False
    finally:
        dist.destroy_process_group()
