"""DDPJobs that really train: `kubectl apply` of the examples, pods on two real nodes, torchrun
rendezvous through MASTER_ADDR resolved by CoreDNS, checkpoints on a volume both nodes mount, the
operator in-cluster (Helm, its own image and ServiceAccount) scraping the pods' own addresses."""
from __future__ import annotations

from tests.realpods.conftest import (
    EXAMPLES,
    apply_digits_as_the_readme_does,
    apply_docs,
    example_docs,
    exec_kill_trainer,
    pod_nodes,
    shared_checkpoint_pv,
    stalled,
    wait_job,
    wait_phase,
)

DIGITS_VAL_SAMPLES = 359  # scikit-learn's digits: 1797 samples, 20 % held out


def _digits_claim() -> str:
    docs = example_docs("digits.yaml")
    claims = [d["metadata"]["name"] for d in docs if d.get("kind") == "PersistentVolumeClaim"]
    assert claims, "examples/digits.yaml must carry the checkpoint claim a cluster run needs"
    return claims[0]


def test_digits_example_trains_across_two_real_nodes(real_cluster, namespaces):
    """The README's walkthrough: its helm install (the namespaces fixture) and its two lines that
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
    head, row = real_cluster.kubectl("get", "ddpj", "digits", "-n", ns).stdout.splitlines()[:2]
    # Columns by the header's offsets: PROGRESS ("96% (265/276)") holds a space.
    starts = [head.index(h) for h in head.split()] + [None]
    cols = {h: row[a:b].strip() for h, a, b in zip(head.split(), starts, starts[1:])}
    assert cols["PHASE"] == "Succeeded" and float(cols["ACCURACY"]) >= 0.95, (head, row)

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


def _pod_uids(cluster, namespace: str, job: str) -> dict[str, str]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"ddpjob.dev/job-name={job}", "-o",
                          "jsonpath={range .items[*]}{.metadata.name}={.metadata.uid}{\"\\n\"}{end}")
    return dict(line.split("=", 1) for line in out.stdout.split())


def test_killed_worker_restarts_in_place_counted_and_resumes_from_the_shared_checkpoint(real_cluster, namespaces,
                                                                                         tmp_path):
    """A worker SIGKILLed mid-training (an OOM kill, a segfault): every pod's workers restart where
    they are (torchrun's agents through the c10d rendezvous), no pod is recreated, the status
    names the restart (rank, pod, node, exit code, signal) and when training stepped again.
    Then rank 1's pod is deleted: that pod alone is replaced (pod 0 keeps its pod, its workers
    restart in place and wait in the rendezvous for the new pod), and the job still Succeeds."""
    ns = namespaces["restart"]
    ckpt = shared_checkpoint_pv(real_cluster, claim=_digits_claim(), namespace=ns, tmp=tmp_path)
    docs = example_docs("digits.yaml")
    # An in-memory snapshot after every step: the restart resumes from the step before the kill
    # (unless that step was a disk checkpoint's, everySteps 50 and each epoch's end).
    next(d for d in docs if d["kind"] == "DDPJob")["spec"]["trainer"]["checkpoint"]["snapshotEverySteps"] = 1
    apply_docs(real_cluster, docs, ns)

    # Once the first complete checkpoint (everySteps 50 in the example) is on the shared volume,
    # kill rank 1's worker. A job that ends first fails here, with its pods' story printed.
    wait_job(real_cluster, ns, "digits", lambda st: any((p / "MANIFEST.json").exists() for p in ckpt.rglob("step-*")),
             give_up=lambda st: st.get("phase") in ("Succeeded", "Failed"),
             desc="a complete checkpoint (then the kill)", timeout=600)
    uids = _pod_uids(real_cluster, ns, "digits")
    exec_kill_trainer(real_cluster, ns, "digits-1")

    # Seen while the job runs: the restart, attributed, then its recovery (every rank stepped again).
    st = wait_job(real_cluster, ns, "digits",
                  lambda st: any("recoverySeconds" in e for e in st.get("restartHistory") or []),
                  give_up=lambda st: st.get("phase") in ("Succeeded", "Failed"),
                  desc="the in-place restart's recovery in status.restartHistory", timeout=600)
    (entry,) = [e for e in st["restartHistory"] if e["kind"] == "InPlace"]
    assert (entry["pod"], entry["rank"], entry["exitCode"], entry["signal"]) == ("digits-1", 1, -9, "SIGKILL"), entry
    assert entry["node"] == pod_nodes(real_cluster, ns, "digits")["digits-1"], entry
    assert entry["resumedFromStep"] > 0, entry  # a disk checkpoint or a newer snapshot, not step 0
    # The step rank 1 had finished, read by its pod's agent at the kill: at worst the disk's interval lost.
    assert entry["stepsLost"] == max(0, entry["stepAtFailure"] - entry["resumedFromStep"]) <= 50, entry
    print(f"in-place restart: SIGKILL to every rank's next step in {entry['recoverySeconds']}s "
          f"(pods' clocks), resumed from step {entry['resumedFromStep']}, {entry['stepsLost']} step(s) lost")

    assert _pod_uids(real_cluster, ns, "digits") == uids  # no pod recreated

    # A deleted pod of rank 1: replaced alone, in the same attempt, under its own name.
    real_cluster.kubectl("delete", "pod", "digits-1", "-n", ns, "--wait=false")
    st = wait_job(real_cluster, ns, "digits",
                  lambda st: any("recoverySeconds" in e for e in st.get("restartHistory") or [] if e["kind"] == "Replace"),
                  give_up=lambda st: st.get("phase") in ("Succeeded", "Failed"),
                  desc="the replacement's recovery in status.restartHistory", timeout=600)
    (replaced,) = [e for e in st["restartHistory"] if e["kind"] == "Replace"]
    assert (replaced["rank"], replaced["pod"], replaced["newPod"], replaced["reason"], replaced["attempt"]) == (
        1, "digits-1", "digits-1-r1", "PodDeleted", 0), replaced
    # The checkpoint the stop vote saved at the deletion, else the last before it: at most the disk's interval lost.
    assert 0 <= replaced["stepsLost"] <= 50, replaced
    print(f"replacement: rank 1's pod deleted to every rank's next step in {replaced['recoverySeconds']}s "
          f"(operator's clock to the pods'), resumed from step {replaced['resumedFromStep']}, "
          f"{replaced['stepsLost']} step(s) lost")
    now = _pod_uids(real_cluster, ns, "digits")
    assert now["digits-0"] == uids["digits-0"] and "digits-1" not in now, (uids, now)
    assert now["digits-1-r1"] not in uids.values(), (uids, now)

    st = wait_phase(real_cluster, ns, "digits", {"Succeeded", "Failed"}, timeout=900)
    assert st["phase"] == "Succeeded", st
    assert _pod_uids(real_cluster, ns, "digits") == now  # nothing else recreated
    # One in-place restart (the kill; pod 0's restart for the replacement is part of it, not
    # another) and the replacement, a deletion, charged as a group restart would have been.
    assert (st.get("restarts"), st.get("countedRestarts"), st.get("inPlaceRestarts"), st["attempt"]) == (1, 1, 1, 0), st
    assert (st.get("result") or {}).get("evalSamples") == DIGITS_VAL_SAMPLES, st
    assert st["result"]["evalAccuracy"] >= 0.95, st  # as an undisturbed run (the walkthrough's test)
    # The pod's log marks each start of its workers (`ddpjob logs --attempt` filters on it).
    log0 = real_cluster.kubectl("logs", "-n", ns, "digits-0").stdout
    assert "==> ddpjob: attempt 0 restart 0 <==" in log0 and "==> ddpjob: attempt 0 restart 2 <==" in log0, log0[-3000:]
    logs = log0  # rank 0 logs the resume
    resumed = [ln for ln in logs.splitlines() if "resumed from" in ln]
    assert resumed and f"at step {entry['resumedFromStep']} " in resumed[0], resumed or logs[-3000:]
    # The newer of the two: the snapshot in the pods' /dev/shm (which the disk's lags), or the
    # disk checkpoint when the kill came right after one.
    from_memory = "in-memory snapshot /dev/shm/" in resumed[0]
    assert from_memory or f"/ckpt/step-{entry['resumedFromStep']:08d}" in resumed[0], resumed
    print(f"resumed from {'the in-memory snapshot' if from_memory else 'the disk checkpoint'}: {resumed[0]}")


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
