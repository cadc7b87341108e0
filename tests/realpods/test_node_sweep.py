"""hack/nodes-lib.sh's sweep_dead_clusters, which hack/nodes-up.sh runs before it starts nodes.

A run that is killed (a session's end, CI's time limit) never reaches cluster-down; its processes
die but its mounts, runtime dirs and iptables rules are kernel state and stay. Stop 21's CI started
after such a run and its pods' API traffic went to the dead cluster's DNAT target, so the in-cluster
operator crash-looped. Here a dead cluster's leftovers are made by hand (with addresses from
TEST-NET, which no pod uses) next to a "live" one, and the sweep must remove exactly the dead one's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster import REPO_ROOT

DEAD, LIVE = "dead00beef", "cafe00cafe"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("iptables"),
    reason="the sweep edits mounts and iptables: needs root and iptables, as the real nodes do")


def iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", *args], capture_output=True, text=True, check=check)


def rules(table: str) -> str:
    return iptables("-t", table, "-S").stdout


def leftovers(cluster_id: str) -> list[tuple[str, list[str]]]:
    tag = ["-m", "comment", "--comment", f"ddpjob-nodes-{cluster_id}"]
    return [("filter", ["FORWARD", "-s", "192.0.2.1/32", "-d", "192.0.2.2/32", *tag, "-j", "DROP"]),
            ("nat", ["PREROUTING", "-s", "192.0.2.1/32", "-d", "192.0.2.9/32", "-p", "tcp", "--dport", "443",
                     *tag, "-j", "DNAT", "--to-destination", "192.0.2.3:9"])]


@pytest.fixture
def fake_clusters():
    made_dirs, made_rules, live = [], [], None
    try:
        for cid in (DEAD, LIVE):
            for table, rule in leftovers(cid):
                iptables("-t", table, "-A", *rule)
                made_rules.append((table, rule))
            run, var = Path(f"/run/ddpjob-{cid}"), Path(f"/var/lib/ddpjob-{cid}")
            for d in (run / "ddpjob-node-0" / "state" / "shm", var / "ddpjob-node-0" / "kubelet"):
                d.mkdir(parents=True, exist_ok=True)
            made_dirs += [run, var]
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(run / "ddpjob-node-0" / "state" / "shm")],
                           check=True)
        # What keeps a cluster alive: a process whose command line names its runtime dir, as
        # containerd's --config and kubelet's --root-dir do.
        live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                                 f"/run/ddpjob-{LIVE}/ddpjob-node-0/containerd.toml"])
        yield
    finally:
        if live:
            live.kill()
            live.wait()
        for table, rule in made_rules:
            iptables("-t", table, "-D", *rule, check=False)
        for d in made_dirs:
            subprocess.run(["umount", "-R", str(d / "ddpjob-node-0" / "state" / "shm")], capture_output=True)
            shutil.rmtree(d, ignore_errors=True)


def sweep(*, wrap: list[str] | None = None) -> subprocess.CompletedProcess:
    script = ('set -euo pipefail; HERE=hack; ROOT="$PWD"; source hack/versions.env; source hack/nodes-lib.sh; '
              'log() { echo "$*"; }; sweep_dead_clusters; echo swept')
    return subprocess.run([*(wrap or []), "bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)


def test_sweep_removes_a_dead_clusters_rules_mounts_and_dirs_and_keeps_a_live_ones(fake_clusters):
    proc = sweep()
    assert proc.returncode == 0, proc.stderr
    assert f"ddpjob-{DEAD}" in proc.stdout and f"ddpjob-{LIVE}" not in proc.stdout, proc.stdout
    assert f"ddpjob-nodes-{DEAD}" not in rules("filter") + rules("nat")
    assert not Path(f"/run/ddpjob-{DEAD}").exists() and not Path(f"/var/lib/ddpjob-{DEAD}").exists()
    assert f"/run/ddpjob-{DEAD}/" not in Path("/proc/self/mountinfo").read_text()
    # The live one keeps everything.
    assert rules("filter").count(f"ddpjob-nodes-{LIVE}") == 1 and rules("nat").count(f"ddpjob-nodes-{LIVE}") == 1
    assert f"/run/ddpjob-{LIVE}/ddpjob-node-0/state/shm" in Path("/proc/self/mountinfo").read_text()


def test_the_running_clusters_own_rules_survive_a_sweep(fake_clusters, real_cluster):
    """The sweep runs beside this test run's own cluster: its rules (nodes-up's tag) stay."""
    before = [line for line in rules("nat").splitlines() if "ddpjob-nodes-" in line
              and DEAD not in line and LIVE not in line]
    assert before, "the running cluster's real nodes have no DNAT rule to keep"
    assert sweep().returncode == 0
    after = rules("nat")
    assert all(line in after for line in before)


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare (util-linux) for a network namespace")
def test_a_machine_with_no_rule_at_all_is_swept_without_error():
    """The common case on a fresh machine: no ddpjob rule anywhere. Under `set -euo pipefail`,
    grep's "no match" once ended nodes-up silently (a rehearsal's cluster-up failed on it); a fresh
    network namespace has no iptables rules at all."""
    proc = sweep(wrap=["unshare", "--net"])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("swept"), proc.stdout + proc.stderr
