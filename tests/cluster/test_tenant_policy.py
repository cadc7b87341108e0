"""The chart's tenant policy (ValidatingAdmissionPolicy) on the real API server, as a user who may
create DDPJobs and nothing else: each forbidden field is refused naming it; a decent job is accepted.

The policy is the chart's own template and default profile, rendered by helm; only its namespace
selector is narrowed to this test's namespace (the control plane is shared with other tests).
"""
from __future__ import annotations

import copy
import json
import uuid

import pytest
import yaml

from tests.cluster.test_crd import install_crd
from tests.support.cluster import REPO_ROOT, create_namespace, delete_namespace, wait_for

CHART = REPO_ROOT / "charts" / "ddpjob-operator"
ALLOWED_SA = "trainer"
ALLOWED_PC = "team-batch"


@pytest.fixture(scope="module")
def tenant(cluster, tmp_path_factory):
    """(namespace, user): the chart's default profile bound to a fresh namespace, and a user whose
    only right there is on DDPJobs."""
    install_crd(cluster)
    tag = uuid.uuid4().hex[:8]
    api = cluster.api()
    # A profile label of its own: the chart's default profile (a release that e2e tests may have
    # installed meanwhile) skips labelled namespaces, as docs/install.md tells admins to do.
    ns = create_namespace(api, prefix="tenant-", labels={"ddpjob.dev/tenant-profile": f"test-{tag}"})
    user = f"tenant-{tag}"
    values = yaml.safe_load((CHART / "values.yaml").read_text())["tenantPolicy"]
    profile = copy.deepcopy(values["profiles"][0])
    profile["namespaceSelector"] = {"matchLabels": {"ddpjob.dev/tenant-profile": f"test-{tag}"}}
    profile["serviceAccounts"] = [ALLOWED_SA]
    profile["priorityClasses"] = [ALLOWED_PC]
    vfile = tmp_path_factory.mktemp("tenant") / "values.yaml"
    vfile.write_text(yaml.safe_dump({"tenantPolicy": {**values, "profiles": [profile]}}))
    policy = cluster.helm("template", f"tp-{tag}", str(CHART), "--kube-version", "v1.36.3", "-f", str(vfile),
                          "--show-only", "templates/tenant-policy.yaml").stdout
    rbac = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "ddpjobs-only", "namespace": ns},
         "rules": [{"apiGroups": ["ddpjob.dev"], "resources": ["ddpjobs"],
                    "verbs": ["create", "get", "list", "delete"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "ddpjobs-only", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ddpjobs-only"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]},
    ]
    cluster.kubectl("apply", "-f", "-", input=policy)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
    try:
        # The policy reaches the API server's admission through an informer: wait until it bites.
        wait_for(lambda: create(cluster, ns, user, job("probe", securityContext={"privileged": True})).returncode != 0,
                 timeout=30, desc="tenant policy in force")
        yield ns, user
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=policy, check=False)
        delete_namespace(api, ns)
        api.close()


def job(name="job", **spec):
    return {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
            "spec": {"image": "reg/trainer:1", "nodes": 1, **spec}}


def create(cluster, ns, user, obj, *, dry_run=True):
    args = ["create", "-n", ns, "--as", user, "-f", "-"] + (["--dry-run=server"] if dry_run else [])
    return cluster.kubectl(*args, input=yaml.safe_dump(obj), check=False)


def test_the_user_may_create_ddpjobs_but_not_pods(cluster, tenant):
    ns, user = tenant
    for verb, resource, expected in (("create", "ddpjobs.ddpjob.dev", "yes"), ("create", "pods", "no"),
                                     ("get", "secrets", "no")):
        out = cluster.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", user, check=False).stdout
        assert out.strip() == expected, (verb, resource, out)


@pytest.mark.parametrize("spec,field", [
    ({"securityContext": {"privileged": True}}, "spec.securityContext.privileged"),
    ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}],
      "volumeMounts": [{"name": "root", "mountPath": "/host"}]}, "spec.volumes[].hostPath"),
    ({"securityContext": {"capabilities": {"add": ["CHOWN", "SYS_ADMIN"]}}},
     "spec.securityContext.capabilities.add: SYS_ADMIN"),
    ({"securityContext": {"windowsOptions": {"hostProcess": True}}}, "windowsOptions.hostProcess"),
    ({"securityContext": {"procMount": "Unmasked"}}, "spec.securityContext.procMount"),
    ({"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}}, "seccompProfile"),
    ({"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}, "appArmorProfile"),
    ({"podSecurityContext": {"seLinuxOptions": {"type": "spc_t"}}}, "seLinuxOptions"),
    ({"podSecurityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}},
     "spec.podSecurityContext.sysctls: kernel.msgmax"),
    ({"serviceAccountName": "cluster-admin-sa"}, "spec.serviceAccountName: ServiceAccount cluster-admin-sa"),
    ({"scheduling": {"priorityClassName": "system-node-critical"}},
     "spec.scheduling.priorityClassName: PriorityClass system-node-critical"),
    # spec.template says it all again, for any container, and host namespaces and ports too.
    ({"template": {"spec": {"hostNetwork": True}}}, "spec.template.spec.hostNetwork"),
    ({"template": {"spec": {"containers": [{"name": "side", "image": "s", "ports": [{"containerPort": 80,
                                                                                    "hostPort": 80}]}]}}},
     "hostPort"),
    ({"template": {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}},
     "spec.template.spec.volumes[].hostPath"),
    ({"template": {"spec": {"initContainers": [{"name": "i", "image": "s", "securityContext": {"privileged": True}}]}}},
     "securityContext.privileged"),
    ({"template": {"spec": {"containers": [{"name": "trainer", "securityContext": {
        "capabilities": {"add": ["SYS_ADMIN"]}}}]}}}, "capabilities.add"),
    ({"template": {"spec": {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}}},
     "spec.template.spec.securityContext.sysctls"),
    ({"template": {"spec": {"serviceAccountName": "cluster-admin-sa"}}},
     "spec.template.spec.serviceAccountName: ServiceAccount cluster-admin-sa"),
    ({"template": {"spec": {"priorityClassName": "system-node-critical"}}},
     "spec.template.spec.priorityClassName: PriorityClass system-node-critical"),
])
def test_forbidden_field_refused_naming_it(cluster, tenant, spec, field):
    ns, user = tenant
    proc = create(cluster, ns, user, job(**spec))
    assert proc.returncode != 0, f"accepted: {spec}"
    assert "ValidatingAdmissionPolicy" in proc.stderr and field in proc.stderr, proc.stderr


def test_host_namespaces_and_ports_cannot_even_be_written(cluster, tenant):
    """Baseline's host namespaces and host ports have no flat DDPJob field: strict field validation
    refuses them there (spec.template can say them, and the policy refuses them there)."""
    ns, user = tenant
    for spec in ({"hostNetwork": True}, {"hostPID": True}, {"hostIPC": True},
                 {"ports": [{"containerPort": 80, "hostPort": 80}]}):
        proc = create(cluster, ns, user, job(**spec))
        assert proc.returncode != 0 and "unknown field" in proc.stderr, (spec, proc.stderr)


def test_a_job_within_the_profile_is_accepted(cluster, tenant):
    ns, user = tenant
    ok = job("fine", serviceAccountName=ALLOWED_SA, scheduling={"priorityClassName": ALLOWED_PC},
             securityContext={"capabilities": {"add": ["NET_BIND_SERVICE"]}, "readOnlyRootFilesystem": True},
             podSecurityContext={"fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"},
                                 "sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}]},
             volumes=[{"name": "scratch", "emptyDir": {}}], volumeMounts=[{"name": "scratch", "mountPath": "/s"}],
             template={"spec": {"initContainers": [{"name": "stage", "image": "s", "securityContext": {
                 "capabilities": {"drop": ["ALL"]}}}], "serviceAccountName": ALLOWED_SA,
                 "priorityClassName": ALLOWED_PC, "terminationGracePeriodSeconds": 60}})
    proc = create(cluster, ns, user, ok, dry_run=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(cluster.kubectl("get", "ddpj", "fine", "-n", ns, "-o", "json").stdout)
    assert got["spec"]["serviceAccountName"] == ALLOWED_SA


def test_other_namespaces_are_not_bound(cluster, tenant, api):
    """The binding's namespaceSelector decides: the same job is admitted where it does not match.
    (This namespace carries a profile label of its own, so that a chart installed with default
    values meanwhile, by the e2e tests, does not bind it either.)"""
    other = create_namespace(api, prefix="tenant-other-", labels={"ddpjob.dev/tenant-profile": "none"})
    try:
        proc = cluster.kubectl("create", "-n", other, "--dry-run=server", "-f", "-",
                               input=yaml.safe_dump(job(securityContext={"privileged": True})), check=False)
        assert proc.returncode == 0, proc.stderr
    finally:
        delete_namespace(api, other)
