"""A release as a cluster gets it: `make release` publishes this checkout's images and chart to an OCI
registry (the local one, on loopback), `helm install oci://...` with no image flags installs the
operator, and examples/digits.yaml, its spec.image naming the release's trainer, trains to Succeeded
on the real nodes, whose kubelets pull both images from the registry. The operator's namespace and
the job's are labelled Pod Security `restricted`."""
from __future__ import annotations

import uuid

from tests.realpods.conftest import (
    apply_docs,
    example_docs,
    shared_checkpoint_pv,
    stalled,
    wait_job,
)
from tests.realpods.releases import forget_on_nodes, local_cluster_values, pulled_images
from tests.support.cluster import create_namespace, delete_namespace

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}
DIGITS_VAL_SAMPLES = 359


def test_a_release_installs_from_its_oci_chart_with_no_image_flags_and_trains_digits(real_cluster, checkout_release,
                                                                                   tmp_path):
    release = checkout_release
    api = real_cluster.api()
    op_ns = create_namespace(api, prefix="rel-op-", labels=RESTRICTED)
    job_ns = create_namespace(api, prefix="rel-job-", labels=RESTRICTED)
    name = f"rel{uuid.uuid4().hex[:6]}"
    forget_on_nodes(release)
    try:
        # As docs/install.md's line, with the registry's address and its plain HTTP, and this
        # cluster's platform values (the real nodes' label and taint, for the operator and in the
        # tenant policy for the jobs): no image value.
        real_cluster.helm("install", name, release.chart, "--version", release.version, "--plain-http", "-n", op_ns,
                          "-f", str(local_cluster_values(tmp_path)), "--set", f"operator.watchNamespaces[0]={job_ns}",
                          "--set", "operator.scrapeInterval=3", "--wait", "--timeout", "300s", timeout=360)
        deployment = real_cluster.kubectl("get", "deployment", "-n", op_ns, "-o",
                                          "jsonpath={.items[0].spec.template.spec.containers[0].image}").stdout
        assert deployment == release.operator, deployment

        docs = example_docs("digits.yaml", image=release.trainer)
        claim = next(d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim")
        shared_checkpoint_pv(real_cluster, claim=claim, namespace=job_ns, tmp=tmp_path)
        apply_docs(real_cluster, docs, job_ns)
        st = wait_job(real_cluster, job_ns, "digits", lambda s: s.get("phase") in {"Succeeded", "Failed"},
                      give_up=stalled, desc="the job's end", timeout=900)
        assert st["phase"] == "Succeeded", st
        result = st.get("result") or {}
        assert result.get("evalAccuracy", 0) >= 0.95 and result.get("evalSamples") == DIGITS_VAL_SAMPLES, st

        # Both images came from the registry: each kubelet pulled them (none had them by that name).
        pulled = pulled_images(real_cluster, job_ns) | pulled_images(real_cluster, op_ns)
        assert {img for _, img in pulled} == {release.operator, release.trainer}, pulled
        assert {pod for pod, img in pulled if img == release.trainer} == {"digits-0", "digits-1"}, pulled
    finally:
        real_cluster.helm("uninstall", name, "-n", op_ns, "--wait", "--timeout", "60s", check=False, timeout=90)
        for ns in (job_ns, op_ns):
            delete_namespace(api, ns)
        real_cluster.kubectl("delete", "pv", f"{job_ns}-digits-checkpoints", "--wait=false", check=False)
        api.close()
