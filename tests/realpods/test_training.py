"""DDPJobs that really train: `kubectl apply` of the examples, pods on two real nodes, torchrun
rendezvous through MASTER_ADDR resolved by CoreDNS, checkpoints on a volume both nodes mount, the
operator in-cluster (Helm, its own image and ServiceAccount) scraping the pods' own addresses."""
from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddpjob_api.contract import STALL_ERROR_RE
from ddpjob_operator.base.objmeta import parse_time

from tests.realpods.conftest import (
    EXAMPLES,
    apply_digits_as_the_readme_does,
    apply_docs,
    example_docs,
    exec_kill_trainer,
    operator_metrics,
    pod_nodes,
    real_nodes,
    shared_checkpoint_pv,
    stalled,
    wait_job,
    wait_phase,
)
from tests.support.cluster import wait_for
from tests.support.status import condition, table_row

DDPJOB = str(Path(sys.executable).parent / "ddpjob")  # the CLI as a user runs it
DIGITS_VAL_SAMPLES = 359  # scikit-learn's digits: 1797 samples, 20 % held out
# The frozen rank's hang timeout: each start-up stage of a worker on a loaded CI machine (a rank in
# process-group set-up waiting for its peer still importing torch) stays far below it.
HANG_TIMEOUT = 60
FREEZE_AT = 5
# The restart test's in-memory snapshots: after every step. A worker restarted in place resumes
# from the newest one every rank holds (or a newer disk checkpoint): it loses at most this many.
SNAPSHOT_EVERY = 1
# Issue 45's guard: a restart in place (status.restartHistory's recoverySeconds: its worker's
# failure to every rank's next step) takes at most this share of the same job's group restart (its
# kill to every rank's next step). bench/recovery.py: 0.38 on a quiet machine, 0.49 on a loaded one.
# This test on a machine with a 1-minute load of 8-14 measured restarts in place of 6.3 and 8.5 s
# and, in another run, a group restart of 13.2 s: one restart alone can come near the limit (stop
# 59's CI: a stall's 17.5 s, 1.1x its group restart, beside the kill's 6.1 s), so the faster of the
# run's two is compared.
MAX_INPLACE_OVER_GROUP = 0.6


def _first_row(table: str) -> dict[str, str]:
    return table_row(*table.splitlines()[:2])


def _digits_claim() -> str:
    docs = example_docs("digits.yaml")
    claims = [d["metadata"]["name"] for d in docs if d.get("kind") == "PersistentVolumeClaim"]
    assert claims, "examples/digits.yaml must carry the checkpoint claim a cluster run needs"
    return claims[0]


def test_digits_example_trains_across_two_real_nodes(real_cluster, namespaces):
    """The real-pod walkthrough (docs/development.md): its helm install (the namespaces fixture) and its two lines that
    apply examples/digits.yaml to the real nodes, in this test's namespace."""
    ns = namespaces["digits"]
    ckpt = apply_digits_as_the_readme_does(real_cluster, ns) / _digits_claim()

    # The most ranks the operator's scrapes saw at once while the job ran: the last snapshot alone
    # may count one, when rank 1's pod exited before the operator's final scrape of the attempt.
    reporting = []

    def ended(st):
        reporting.append((st.get("progress") or {}).get("ranksReporting") or 0)
        return st.get("phase") in {"Succeeded", "Failed"}
    st = wait_job(real_cluster, ns, "digits", ended, give_up=stalled, desc="the job's end", timeout=900)
    assert st["phase"] == "Succeeded", st

    # One pod per node: the two ranks really talked across the nodes' bridges.
    where = pod_nodes(real_cluster, ns, "digits")
    assert set(where) == {"digits-0", "digits-1"}, where
    assert len(set(where.values())) == 2, f"both pods on one node: {where}"

    # The result the trainer reported from inside pod 0, folded into the job's status.
    result = st.get("result") or {}
    assert result.get("evalAccuracy", 0) >= 0.95, st
    assert result.get("evalSamples") == result.get("evalDatasetSize") == DIGITS_VAL_SAMPLES, st
    assert st["masterAddr"] == f"digits-0.digits.{ns}.svc", st
    # What a user sees first: `kubectl get ddpj digits` shows the outcome and its accuracy.
    cols = _first_row(real_cluster.kubectl("get", "ddpj", "digits", "-n", ns).stdout)
    assert cols["PHASE"] == "Succeeded" and float(cols["ACCURACY"]) >= 0.95, cols
    # The terminal write carries where the run ended (the result's last step, written after the
    # last scrape), with no ETA: in the status, `kubectl get ddpj -o wide` and `ddpjob list -o wide`.
    prog = st.get("progress") or {}
    assert prog.get("step") == result["steps"] == result["totalSteps"], st
    assert (prog.get("percent"), prog.get("evalAccuracy")) == (100.0, result["evalAccuracy"]), st
    assert "eta" not in prog and "etaSeconds" not in prog, st
    final = f"100% ({result['steps']}/{result['totalSteps']})"
    cols = _first_row(real_cluster.kubectl("get", "ddpj", "digits", "-n", ns, "-o", "wide").stdout)
    assert cols["PROGRESS"] == final and cols["ETA"] in ("", "<none>"), cols  # kubectl leaves an absent field blank
    listed = subprocess.run([DDPJOB, "list", "-n", ns, "-o", "wide"], env=real_cluster.env(), capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    cols = _first_row(listed.stdout)
    assert (cols["PHASE"], cols["PROGRESS"], cols["ETA"]) == ("Succeeded", final, "-"), cols

    # The operator scraped the real pods while they trained (no URL template in this tier).
    assert max(reporting) == 2, (reporting, st)

    # `kubectl logs` works (API server -> kubelet), and rank 1 found the master by its DNS name.
    log1 = real_cluster.kubectl("logs", "-n", ns, "digits-1").stdout
    assert f"digits-0.digits.{ns}.svc" in log1, log1[-2000:]
    log0 = real_cluster.kubectl("logs", "-n", ns, "digits-0").stdout
    assert "eval" in log0.lower(), log0[-2000:]

    # Checkpoints landed on the shared volume, complete (manifest present).
    steps = sorted(p.name for p in ckpt.rglob("step-*") if (p / "MANIFEST.json").exists())
    assert steps, f"no complete checkpoint under {ckpt}: {list(ckpt.rglob('*'))[:20]}"


def _mean_step_seconds(cluster, namespace: str, pod: str) -> float:
    """The mean step time of the pod's rank, from its own metrics endpoint (read inside the pod)."""
    from ddpjob_operator.decisions.samples import parse_metrics

    code = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9400/metrics', timeout=10).read().decode())"
    out = cluster.kubectl("exec", "-n", namespace, pod, "--", "python", "-c", code, timeout=60)
    (rank,) = parse_metrics(out.stdout).values()
    return rank.step_seconds_sum / rank.step_seconds_count


def _pod_uids(cluster, namespace: str, job: str) -> dict[str, str]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"ddpjob.dev/job-name={job}", "-o",
                          "jsonpath={range .items[*]}{.metadata.name}={.metadata.uid}{\"\\n\"}{end}")
    return dict(line.split("=", 1) for line in out.stdout.split())


def _assert_recoveries_observed_once(cluster, operator_namespace: str, ns: str, history: list[dict]) -> None:
    """The operator's recovery histograms (its /metrics, this job's namespace alone): every recovery
    in the history observed once, by kind; a superseded restart never stepped again and is not."""
    def by_kind(key: str) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        for e in history:
            if "recoverySeconds" in e and e.get(key) is not None:
                n, total = out.get(e["kind"], (0, 0.0))
                out[e["kind"]] = (n + 1, round(total + e[key], 6))
        return out
    expected = {"recovery_seconds": by_kind("recoverySeconds"), "recovery_steps_lost": by_kind("stepsLost")}
    assert expected["recovery_seconds"].keys() == {"InPlace", "Group", "Replace"}, history

    def histograms() -> dict[str, dict[str, tuple[int, float]]]:
        got: dict[str, dict[str, tuple[int, float]]] = {}
        for family in text_string_to_metric_families(operator_metrics(cluster, operator_namespace)):
            name = family.name.removeprefix("ddpjob_operator_")
            if name in expected:
                values = {(s.name.rsplit("_", 1)[1], s.labels["kind"]): s.value for s in family.samples
                          if s.labels.get("namespace") == ns and s.name.endswith(("_count", "_sum"))}
                got[name] = {kind: (int(n), round(values[("sum", kind)], 6))
                             for (what, kind), n in values.items() if what == "count" and n}
        return got
    seen: list[dict] = []
    try:
        # The operator observes a recovery right after the status write that records it.
        wait_for(lambda: seen.append(histograms()) or seen[-1] == expected, timeout=60, interval=1,
                 desc="the operator's recovery histograms")
    except AssertionError:
        raise AssertionError(f"the operator's /metrics hold {seen[-1] if seen else 'nothing'} for namespace {ns}, "
                             f"its recoveries in status.restartHistory {expected}") from None


def _assert_goodput_accounts_for_the_wall_time(cluster, ns: str, st: dict, *, stall: dict, step_time: float) -> None:
    """Where its time went (docs/goodput.md): every second of its wall time once, the restarts'
    seconds theirs (recovering, recomputing their lost steps, the stall's), as `kubectl get ddpj` shows it."""
    g, history = st["goodput"], st["restartHistory"]
    created = cluster.kubectl("get", "ddpj", "digits", "-n", ns, "-o", "jsonpath={.metadata.creationTimestamp}").stdout
    wall = (parse_time(st["completionTime"]) - parse_time(created)).total_seconds()
    assert sum(g["seconds"].values()) == pytest.approx(wall, rel=0.02), (g, wall)
    assert g["seconds"]["recovering"] == pytest.approx(sum(e.get("recoverySeconds", 0) for e in history), abs=1.0), g
    # The lost steps' own time, not a margin on it: they are new workers' first steps, whose time
    # against the run's mean varies (1.18x in one run, 1.62x of 3 steps in rehearsal 9, which a
    # half-either-way margin failed). Counted where steps were lost, and not every step's: far under
    # training's. None may be: the snapshot of every step, a group restart killed just after a disk
    # checkpoint and the deletion's stop vote each lose 0 (rehearsal 12), and then none is counted.
    lost = sum(e.get("stepsLost", 0) for e in history)
    if lost:
        assert 0 < g["seconds"]["recomputing"] < g["seconds"]["training"] / 4, (g, lost, step_time)
    else:
        assert g["seconds"]["recomputing"] == 0, (g, history)
    assert g["seconds"]["stalled"] == pytest.approx(float(STALL_ERROR_RE.match(stall["message"]).group(1))), g
    assert g["seconds"]["training"] > 0 and g["seconds"]["starting"] > 0, g
    assert _first_row(cluster.kubectl("get", "ddpj", "digits", "-n", ns).stdout)["GOODPUT"] == g["display"]
    print(f"goodput: {g['display']} of {wall:.0f}s: {g['seconds']}")


def test_frozen_then_killed_worker_restart_in_place_counted_and_a_deleted_pod_is_replaced_alone(
        real_cluster, namespaces, tmp_path):
    """A rank that freezes (alive, never stepping again: a hung collective), then a worker
    SIGKILLed mid-training (an OOM kill, a segfault): each time every pod's workers restart where
    they are (torchrun's agents through the c10d rendezvous), no pod is recreated, the status names
    the restart (rank, pod, node; the stall, or the exit code and signal) and when training
    stepped again. Then rank 1's torchrun agent is SIGKILLed: its pod fails and the group restarts
    (new pods, resumed from the disk checkpoint). The guard of issue 45, measured in this run: the
    faster in-place restart's recovery takes at most MAX_INPLACE_OVER_GROUP of the group restart's, and
    the killed worker's loses at most the snapshot interval. Then rank 1's pod is deleted: that pod alone is
    replaced (pod 0 keeps its pod, its workers restart in place and wait in the rendezvous for the
    new pod), and the job still Succeeds. The operator's recovery histograms, read from its
    /metrics, observed each of these recoveries once, by kind."""
    ns = namespaces["restart"]
    ckpt = shared_checkpoint_pv(real_cluster, claim=_digits_claim(), namespace=ns, tmp=tmp_path)
    docs = example_docs("digits.yaml")
    spec = next(d for d in docs if d["kind"] == "DDPJob")["spec"]
    # An in-memory snapshot after every step: the restart resumes from the step before the kill
    # (unless that step was a disk checkpoint's, everySteps 50 and each epoch's end).
    spec["trainer"]["checkpoint"]["snapshotEverySteps"] = SNAPSHOT_EVERY
    # Rank 1 blocks in Python fetching its step FREEZE_AT's batch in its first start (debug.py),
    # rank 0 waiting for it in that step's collective: restartOnHang's default restarts it in
    # place once it made no progress for the hang timeout, its pods' agents capturing every
    # rank's stack first.
    spec["hangTimeoutSeconds"] = HANG_TIMEOUT
    # Attempt 1 (after the group restart) holds at its step boundaries until the test has deleted
    # rank 1's pod: the deletion comes while it trains, however long the test took to get there.
    release = ckpt / "release"
    spec["env"] = [*(spec.get("env") or []), {"name": "DDPJOB_DEBUG_BLOCK_FETCH", "value": f"1:{FREEZE_AT}"},
                   {"name": "DDPJOB_DEBUG_HOLD", "value": f"1:{spec['trainer']['checkpoint']['dir']}/{release.name}"}]
    # The stall and the kill (in place), the group restart (and the in-place restart of pod 0's
    # worker, which fails on its dead peer, where a scrape sees it first), the deletion (charged as
    # a group restart), and one to spare: a counted restart that reaches the limit fails the job.
    spec["failurePolicy"]["maxRestarts"] = 6
    apply_docs(real_cluster, docs, ns)

    def ended(st):
        return st.get("phase") in ("Succeeded", "Failed")

    # The stall: rank 1's agent kills its frozen worker, and every rank steps again.
    st = wait_job(real_cluster, ns, "digits",
                  lambda st: any("recoverySeconds" in e for e in st.get("restartHistory") or []),
                  give_up=ended, desc="the stalled rank's in-place restart and its recovery", timeout=600)
    (stall,) = [e for e in st["restartHistory"] if e["kind"] == "InPlace"]
    # Both ranks stopped after step FREEZE_AT - 1 (rank 0 waits for rank 1's gradients in the
    # next step), so either agent's kill may come first and be the entry's rank; the stacks both
    # pods captured before it name rank 1, the one not in the collective, with the sleep's frame.
    assert (stall["reason"], stall["signal"]) == ("Stalled", "SIGKILL"), stall
    assert (stall["pod"], stall["rank"]) in {("digits-1", 1), ("digits-0", 0)}, stall
    assert stall["message"].startswith("stalled: no progress for "), stall
    assert stall["message"].endswith(f"s in training after step {FREEZE_AT - 1} (hang timeout {HANG_TIMEOUT}s)"), stall
    culprit = stall.get("culprit") or {}
    assert (culprit.get("rank"), culprit.get("pod")) == (1, "digits-1") and culprit.get("waitingIn"), stall
    assert "_block_in_fetch" in culprit["frames"], culprit
    assert culprit["node"] == pod_nodes(real_cluster, ns, "digits")["digits-1"], culprit
    # Stalled named rank 1 and the sleep's frame (its event outlives the condition, which the
    # restart clears at once).
    events = real_cluster.kubectl("get", "events", "-n", ns, "-o", "jsonpath={range .items[?(@.reason==\"Stalled\")]}"
                                  "{.message}{\"\\n\"}{end}").stdout
    assert any("stacks: rank 1 (pod digits-1" in ev and "_block_in_fetch" in ev for ev in events.splitlines()), events
    # Every rank's captured stack, kept in the job's ConfigMap, through the CLI: rank 1 in the
    # sleep, rank 0 waiting in the collective.
    kept = subprocess.run([DDPJOB, "logs", "digits", "-n", ns, "--stacks", "--attempt", "0"], env=real_cluster.env(),
                          capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0, kept.stderr
    assert "=== rank 1 (pod digits-1" in kept.stdout and "in _block_in_fetch" in kept.stdout, kept.stdout[-4000:]
    assert re.search(r"=== rank 0 \(pod digits-0 on node \S+\), attempt 0 restart 0: \w+ capture at .*, waiting in \w",
                     kept.stdout), kept.stdout[-4000:]
    # A stack on demand, while it trains (pods/exec in each pod).
    now = subprocess.run([DDPJOB, "stacks", "digits", "-n", ns], env=real_cluster.env(), capture_output=True,
                         text=True, timeout=120)
    assert now.returncode == 0 and "=== rank 0 " in now.stdout and "=== rank 1 " in now.stdout, (now.stdout, now.stderr)
    # From the newest in-memory snapshot (every step): at most the step rank 0 took beyond rank 1.
    assert stall["resumedFromStep"] >= FREEZE_AT - 1 and stall["stepsLost"] <= 1, stall
    print(f"in-place restart of a frozen rank (rank {stall['rank']} named): its stall to every rank's next step in {stall['recoverySeconds']}s "
          f"(pods' clocks), resumed from step {stall['resumedFromStep']}")

    # Once the first complete checkpoint (everySteps 50 in the example) is on the shared volume,
    # kill rank 1's worker. A job that ends first fails here, with its pods' story printed.
    wait_job(real_cluster, ns, "digits", lambda st: any((p / "MANIFEST.json").exists() for p in ckpt.rglob("step-*")),
             give_up=ended, desc="a complete checkpoint (then the kill)", timeout=600)
    uids = _pod_uids(real_cluster, ns, "digits")
    exec_kill_trainer(real_cluster, ns, "digits-1")

    # Seen while the job runs: the restart, attributed, then its recovery (every rank stepped again).
    st = wait_job(real_cluster, ns, "digits",
                  lambda st: sum("recoverySeconds" in e for e in st.get("restartHistory") or []) == 2,
                  give_up=ended, desc="the kill's in-place restart and its recovery in status.restartHistory", timeout=600)
    (_, entry) = [e for e in st["restartHistory"] if e["kind"] == "InPlace"]
    assert (entry["pod"], entry["rank"], entry["exitCode"], entry["signal"]) == ("digits-1", 1, -9, "SIGKILL"), entry
    assert entry["node"] == pod_nodes(real_cluster, ns, "digits")["digits-1"], entry
    assert entry["resumedFromStep"] > 0, entry  # a disk checkpoint or a newer snapshot, not step 0
    # The step rank 1 had finished, read by its pod's agent at the kill, less the step resumed
    # from: the newest snapshot every rank holds (or a disk checkpoint newer than it) loses at most
    # the snapshot interval (issue 45's guard).
    assert entry["stepsLost"] == max(0, entry["stepAtFailure"] - entry["resumedFromStep"]) <= SNAPSHOT_EVERY, entry
    print(f"in-place restart: SIGKILL to every rank's next step in {entry['recoverySeconds']}s "
          f"(pods' clocks), resumed from step {entry['resumedFromStep']}, {entry['stepsLost']} step(s) lost")

    assert _pod_uids(real_cluster, ns, "digits") == uids  # no pod recreated, for the stall or the kill
    # The pod's log marks each start of its workers (`ddpjob logs --attempt` filters on it); read
    # now, before the group restart deletes the pod.
    log0 = real_cluster.kubectl("logs", "-n", ns, "digits-0").stdout
    for restart in (0, 1, 2):  # the first start, after the stall, after the kill
        assert f"==> ddpjob: attempt 0 restart {restart} <==" in log0, log0[-3000:]
    # Rank 0 logs each resume: after the stall, then after the kill.
    resumed = [ln for ln in log0.splitlines() if "resumed from" in ln][1:2]
    assert resumed and f"at step {entry['resumedFromStep']} " in resumed[0], resumed or log0[-3000:]
    # The newer of the two: the snapshot in the pods' /dev/shm (which the disk's lags), or the
    # disk checkpoint when the kill came right after one.
    from_memory = "in-memory snapshot /dev/shm/" in resumed[0]
    assert from_memory or f"/ckpt/step-{entry['resumedFromStep']:08d}" in resumed[0], resumed
    print(f"resumed from {'the in-memory snapshot' if from_memory else 'the disk checkpoint'}: {resumed[0]}")

    # Rank 1's torchrun agent SIGKILLed: its pod fails (the launcher ends with its agent) and the
    # group restarts: attempt 1's new pods, a fresh /dev/shm, the disk checkpoint.
    killed_at = exec_kill_trainer(real_cluster, ns, "digits-1", agent=True)
    st = wait_job(real_cluster, ns, "digits",
                  lambda st: any("recoverySeconds" in e for e in st.get("restartHistory") or [] if e["kind"] == "Group"),
                  give_up=ended, desc="the group restart's recovery in status.restartHistory", timeout=600)
    (group,) = [e for e in st["restartHistory"] if e["kind"] == "Group"]
    assert (group["attempt"], group["reason"], st["attempt"]) == (0, "PodFailed", 1), group
    assert group["message"].startswith("pod digits-1 failed with exit code "), group
    # Its failedAt is the operator's pass that saw the pod fail; every rank of attempt 1 stepped at
    # failedAt + recoverySeconds. From the kill, as an in-place restart's starts at its worker's
    # (the agent's timestamp, within a second of the kill): bench/recovery.py's two arms. In place:
    # the faster of this run's two, the stall's and the kill's (the same path: the agent's failure,
    # a rendezvous round, new workers, the snapshot). One restart slowed by a loaded machine does not
    # fail the guard (stop 59's CI: the stall's 17.5 s beside the kill's 6.1 s, 0.74 as a mean); a
    # path that got slower does, in both.
    group_s = group["failedAt"] + group["recoverySeconds"] - killed_at
    in_place_s = min(stall["recoverySeconds"], entry["recoverySeconds"])
    ratio = in_place_s / group_s
    print(f"group restart: SIGKILL of rank 1's agent to every rank's next step in {group_s:.3f}s (status: "
          f"recoverySeconds {group['recoverySeconds']}s from the operator's pass), resumed from step "
          f"{group['resumedFromStep']}, {group.get('stepsLost')} step(s) lost; in place ({stall['recoverySeconds']}s, "
          f"{entry['recoverySeconds']}s) / group: {ratio:.2f} (at most {MAX_INPLACE_OVER_GROUP} asserted)")
    assert ratio <= MAX_INPLACE_OVER_GROUP, (
        f"restarts in place took {in_place_s:.3f}s at best (the stall's {stall['recoverySeconds']}s, the kill's "
        f"{entry['recoverySeconds']}s), {ratio:.2f}x the same job's group restart ({group_s:.3f}s from the kill "
        f"to every rank's next step), above the {MAX_INPLACE_OVER_GROUP} asserted: group {group}")
    uids = _pod_uids(real_cluster, ns, "digits")
    assert {"digits-0-a1", "digits-1-a1"} <= set(uids), uids

    # A deleted pod of rank 1: replaced alone, in the same attempt, under its own name. Attempt 1
    # holds after its first step until then (DDPJOB_DEBUG_HOLD): released once its pod is deleted.
    real_cluster.kubectl("delete", "pod", "digits-1-a1", "-n", ns, "--wait=false")
    release.touch()
    st = wait_job(real_cluster, ns, "digits",
                  lambda st: any("recoverySeconds" in e for e in st.get("restartHistory") or [] if e["kind"] == "Replace"),
                  give_up=ended, desc="the replacement's recovery in status.restartHistory", timeout=600)
    (replaced,) = [e for e in st["restartHistory"] if e["kind"] == "Replace"]
    assert (replaced["rank"], replaced["pod"], replaced["newPod"], replaced["reason"], replaced["attempt"]) == (
        1, "digits-1-a1", "digits-1-a1-r1", "PodDeleted", 1), replaced
    # The checkpoint the stop vote saved at the deletion, else the last before it: at most the disk's interval lost.
    assert 0 <= replaced["stepsLost"] <= 50, replaced
    print(f"replacement: rank 1's pod deleted to every rank's next step in {replaced['recoverySeconds']}s "
          f"(operator's clock to the pods'), resumed from step {replaced['resumedFromStep']}, "
          f"{replaced['stepsLost']} step(s) lost")
    now = _pod_uids(real_cluster, ns, "digits")
    assert now["digits-0-a1"] == uids["digits-0-a1"] and "digits-1-a1" not in now, (uids, now)
    assert now["digits-1-a1-r1"] not in uids.values(), (uids, now)
    # The ranks' step time, from their own endpoints, while they still train (the ledger's check below).
    step_time = statistics.median(_mean_step_seconds(real_cluster, ns, pod) for pod in ("digits-0-a1", "digits-1-a1-r1"))

    st = wait_phase(real_cluster, ns, "digits", {"Succeeded", "Failed"}, timeout=900)
    assert st["phase"] == "Succeeded", st
    assert _pod_uids(real_cluster, ns, "digits") == now  # nothing else recreated
    # In place: the stall and the kill, and, where a scrape saw it before the pod's failure, pod
    # 0's worker failing on its dead peer at the agent's kill, which the group restart superseded
    # (pod 0's restart for the replacement is part of it, not another); each one is in the history
    # and counted. The group restart (a failed pod) and the replacement (a deletion) are charged.
    history = st["restartHistory"]
    in_place = [e for e in history if e["kind"] == "InPlace"]
    assert [bool(e.get("superseded")) for e in in_place] in ([False, False], [False, False, True]), history
    assert (st.get("restarts"), st.get("countedRestarts"), st.get("inPlaceRestarts"), st["attempt"]) == (
        2, 2, len(in_place), 1), st
    assert (st.get("result") or {}).get("evalSamples") == DIGITS_VAL_SAMPLES, st
    assert st["result"]["evalAccuracy"] >= 0.95, st  # as an undisturbed run (the walkthrough's test)
    # Attempt 1's pod 0: its first start resumed from the disk checkpoint (a new pod's /dev/shm
    # holds no snapshot), its second is the replacement's round.
    log0 = real_cluster.kubectl("logs", "-n", ns, "digits-0-a1").stdout
    for restart in (0, 1):
        assert f"==> ddpjob: attempt 1 restart {restart} <==" in log0, log0[-3000:]
    assert "debug: rank 0 released at step" in log0, log0[-3000:]  # it held until the deletion
    first = next((ln for ln in log0.splitlines() if "resumed from" in ln), "")
    assert f"resumed from /ckpt/step-{group['resumedFromStep']:08d} at step {group['resumedFromStep']} " in first, (
        first or log0[-3000:])

    _assert_recoveries_observed_once(real_cluster, namespaces.operator_namespace, ns, st["restartHistory"])
    _assert_goodput_accounts_for_the_wall_time(real_cluster, ns, st, stall=stall, step_time=step_time)


# Each step of the elastic job sleeps at least this long (no CPU: the floor holds on an idle
# machine too), so that at one node the job outlasts what growing back takes once the test sees it
# shrunk (uncordon, the replacement's start and its agent's join, about 20 s) several times over:
# after the deletion at step 10, 2 x 266 steps at world size 1, at least 80 s. The shrink itself
# (keep-alive, then torchrun's 30 s last call) takes no steps.
ELASTIC_STEP_SLEEP = "0.15"


def test_an_elastic_job_trains_on_fewer_nodes_while_a_replacement_cannot_start_and_grows_back(
        real_cluster, namespaces, tmp_path):
    """spec.elastic minNodes 1 of 2: rank 1's pod is deleted while no node can take its
    replacement (both real nodes cordoned). The survivor does not wait for it: torchrun's round
    completes with one node and training goes on at world size 1 (condition Resized, FewerNodes).
    Once the nodes take pods again the replacement starts, its agent joins, and the job trains on
    both nodes again (AllNodes); pod 0 is never recreated, and the job Succeeds as an undisturbed
    run does."""
    ns = namespaces["elastic"]
    shared_checkpoint_pv(real_cluster, claim=_digits_claim(), namespace=ns, tmp=tmp_path)
    docs = example_docs("digits.yaml")
    spec = next(d for d in docs if d["kind"] == "DDPJob")["spec"]
    spec["elastic"] = {"minNodes": 1, "maxNodes": 2}
    spec["trainer"]["checkpoint"]["snapshotEverySteps"] = 5
    spec["env"] = [*(spec.get("env") or []), {"name": "DDPJOB_DEBUG_STEP_SLEEP", "value": ELASTIC_STEP_SLEEP}]
    apply_docs(real_cluster, docs, ns)
    # Both ranks reporting: with minNodes 1, torchrun's round completes without a pod that starts
    # its agent more than the last call (30 s) after pod 0's, and the job trains on one node until
    # it joins (a loaded node: CI's run 56). A pod deleted before it joined is no loss to shrink by.
    wait_job(real_cluster, ns, "digits",
             lambda st: (st.get("progress") or {}).get("step", 0) >= 10 and (st.get("progress") or {}).get("ranksReporting") == 2,
             give_up=lambda st: st.get("phase") in ("Succeeded", "Failed"), desc="training on both nodes", timeout=600)
    uids = _pod_uids(real_cluster, ns, "digits")
    nodes = real_nodes(real_cluster)
    try:
        for node in nodes:
            real_cluster.kubectl("cordon", node)
        deleted = time.monotonic()
        real_cluster.kubectl("delete", "pod", "digits-1", "-n", ns, "--wait=false")

        def fewer(st):
            c = condition(st, "Resized")
            return c is not None and (c["status"], c["reason"]) == ("True", "FewerNodes")
        st = wait_job(real_cluster, ns, "digits", fewer, give_up=lambda st: st.get("phase") in ("Succeeded", "Failed"),
                      desc="Resized: FewerNodes (training at world size 1)", timeout=600)
        shrunk = time.monotonic() - deleted
        assert st["phase"] == "Running", st
        assert "running on 1 of 2 nodes" in condition(st, "Resized")["message"], st
        pods = real_cluster.kubectl("get", "pods", "-n", ns, "-l", "ddpjob.dev/job-name=digits", "-o",
                                    "jsonpath={range .items[*]}{.metadata.name}={.status.phase}{\"\\n\"}{end}").stdout
        assert dict(line.split("=", 1) for line in pods.split()) == {"digits-0": "Running", "digits-1-r1": "Pending"}, pods
        step = (st.get("progress") or {}).get("step", 0)
        print(f"elastic: rank 1's pod deleted, its replacement unschedulable; training on 1 node "
              f"{shrunk:.1f}s later (seen by the test through the status), at step {step}")
    finally:
        for node in nodes:
            real_cluster.kubectl("uncordon", node, check=False)

    def grown(st):
        c = condition(st, "Resized")
        return c is not None and (c["status"], c["reason"]) == ("False", "AllNodes")
    st = wait_job(real_cluster, ns, "digits", grown, give_up=lambda st: st.get("phase") in ("Succeeded", "Failed"),
                  desc="Resized: AllNodes (the replacement joined)", timeout=600)
    (replaced,) = [e for e in st["restartHistory"] if e["kind"] == "Replace"]
    assert (replaced["rank"], replaced["pod"], replaced["newPod"], replaced["reason"]) == (
        1, "digits-1", "digits-1-r1", "PodDeleted"), replaced
    print(f"elastic: both nodes train again, {time.monotonic() - deleted:.1f}s after the deletion "
          f"(replacement's recovery {replaced.get('recoverySeconds')}s on the status)")

    st = wait_phase(real_cluster, ns, "digits", {"Succeeded", "Failed"}, timeout=900)
    assert st["phase"] == "Succeeded", st
    now = _pod_uids(real_cluster, ns, "digits")
    assert now["digits-0"] == uids["digits-0"] and set(now) == {"digits-0", "digits-1-r1"}, (uids, now)
    # The deletion is charged as the group restart it replaced; shrinking and growing are not restarts.
    assert (st.get("restarts"), st.get("inPlaceRestarts", 0), st["attempt"]) == (1, 0, 0), st
    assert (st.get("result") or {}).get("evalSamples") == DIGITS_VAL_SAMPLES, st
    assert st["result"]["evalAccuracy"] >= 0.95, st  # as an undisturbed run (the walkthrough's test)


def test_custom_script_example_runs_unchanged_with_its_script_from_a_configmap(real_cluster, namespaces):
    ns = namespaces["custom"]
    # The way the example's header tells a user to deliver the script.
    real_cluster.kubectl("create", "configmap", "custom-script-train", "-n", ns,
                         f"--from-file={EXAMPLES / 'scripts' / 'train.py'}")
    apply_docs(real_cluster, example_docs("custom-script.yaml"), ns)
    st = wait_phase(real_cluster, ns, "custom-script", {"Succeeded", "Failed"}, timeout=900)
    assert st["phase"] == "Succeeded", st
    log0 = real_cluster.kubectl("logs", "-n", ns, "custom-script-0").stdout
    assert "epoch" in log0.lower(), log0[-2000:]
