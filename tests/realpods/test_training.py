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


def test_killed_rank_restarts_the_group_and_resumes_from_the_shared_checkpoint(real_cluster, namespaces, tmp_path):
    ns = namespaces["restart"]
    ckpt = shared_checkpoint_pv(real_cluster, claim=_digits_claim(), namespace=ns, tmp=tmp_path)
    apply_docs(real_cluster, example_docs("digits.yaml"), ns)

    # Once the first complete checkpoint (everySteps 50 in the example) is on the shared volume,
    # kill rank 1's worker. A job that ends first fails here, with its pods' story printed.
    wait_job(real_cluster, ns, "digits", lambda st: any((p / "MANIFEST.json").exists() for p in ckpt.rglob("step-*")),
             give_up=lambda st: st.get("phase") in ("Succeeded", "Failed"),
             desc="a complete checkpoint (then the kill)", timeout=600)
    exec_kill_trainer(real_cluster, ns, "digits-1")

    st = wait_phase(real_cluster, ns, "digits", {"Succeeded", "Failed"}, timeout=900)
    assert st["phase"] == "Succeeded", st
    assert st.get("restarts", 0) >= 1, st
    result = st.get("result") or {}
    assert result.get("resumedFromStep", 0) > 0, st
    assert result.get("evalSamples") == DIGITS_VAL_SAMPLES, st
    # Why rank 1 died outlives its pod: the launcher left the termination message to the kubelet,
    # whose log tail has torchrun's account of the kill (the job opted in: logTailInStatus).
    killed = [f for f in st.get("failures") or [] if f.get("pod") == "digits-1" and f.get("attempt") == 0]
    assert killed and "SIGKILL" in killed[0].get("logTail", ""), st.get("failures")


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
