"""The chart's tenant policy (ValidatingAdmissionPolicy) on the real API server, as a user who may
create DDPJobs and nothing else: each forbidden field is refused naming it; a decent job is accepted.
A Secret, in every place a DDPJob can name one, is refused for that user and accepted for one who
may get it.

The policy is the chart's own template and default profile, rendered by helm; only its namespace
selector is narrowed to this test's namespace (the control plane is shared with other tests). This
module's profile also allows every volume type and ephemeral containers (volumeTypes, podFields):
the Secret check must hold in every place a pod names a Secret, whatever the field allow-list lets
through. The seven classes of issue 50, against the default lists: tests/cluster/test_tenant_attacks.py.
"""
from __future__ import annotations

import json
import uuid

import pytest
import yaml

from tests.cluster.test_crd import install_crd
from tests.support.cluster import create_namespace, delete_namespace, wait_for
from tests.support.tenancy import CHART, binding, bound_profile, job, policy_cluster, role

ALLOWED_SA = "trainer"
ALLOWED_PC = "team-batch"
CLOUD_SA = "s3-reader"       # allowed by tenantPolicy.serviceAccounts, for every profile
SECRET = "team-token"        # the reader may get it; the plain user may not
MAX_SECRETS = 20             # distinct objects one request may add (tenant-policy.yaml's budget)
MAX_CONFIGMAPS = 10          # of them ConfigMaps (refKinds)


@pytest.fixture(scope="module")
def cluster():
    """The control plane the policy is tested on (tests/support/tenancy.py: DDPJOB_CLUSTER)."""
    return policy_cluster()


@pytest.fixture(scope="module")
def tenant(cluster, tmp_path_factory):
    """(namespace, user): the chart's default profile bound to a fresh namespace, and a user whose
    only right there is on DDPJobs."""
    install_crd(cluster)
    tag = uuid.uuid4().hex[:8]
    with bound_profile(cluster, tmp_path_factory.mktemp("tenant"), f"tenant-{tag}", {"serviceAccounts": [CLOUD_SA]},
                       serviceAccounts=[ALLOWED_SA], priorityClasses=[ALLOWED_PC], volumeTypes=["*"],
                       podFields=["ephemeralContainers"]) as ns:
        yield ns, f"tenant-{tag}"


@pytest.fixture(scope="module")
def readers(cluster, tenant):
    """(reader, all_reader): users who, besides DDPJobs, may get SECRET, s0..s19 and ConfigMaps
    c0..c10, or every Secret and ConfigMap of the namespace."""
    ns, user = tenant
    reader, all_reader = f"{user}-reader", f"{user}-all"
    some = [SECRET] + [f"s{i}" for i in range(MAX_SECRETS)]
    configs = [f"c{i}" for i in range(MAX_CONFIGMAPS + 1)]
    rbac = []
    for who, names, config_names in ((reader, {"resourceNames": some}, {"resourceNames": configs}), (all_reader, {}, {})):
        rbac += [role(ns, who, {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], **names},
                      {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], **config_names}),
                 binding(ns, who, who, who), binding(ns, f"ddpjobs-{who}", "ddpjobs-only", who)]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
    for who in (reader, all_reader):
        wait_for(lambda: cluster.kubectl("auth", "can-i", "get", f"secret/{SECRET}", "-n", ns, "--as", who,
                                         check=False).stdout.strip() == "yes", timeout=30, desc=f"{who}'s RBAC")
    return reader, all_reader


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


@pytest.mark.parametrize("spec", [{"serviceAccountName": CLOUD_SA},
                                  {"template": {"spec": {"serviceAccountName": CLOUD_SA}}}])
def test_a_service_account_allowed_for_every_profile_is_accepted(cluster, tenant, spec):
    """tenantPolicy.serviceAccounts (IRSA / Workload Identity accounts, docs/install.md) adds to the
    profile's own list: both are allowed, others are still refused."""
    ns, user = tenant
    proc = create(cluster, ns, user, job(**spec))
    assert proc.returncode == 0, proc.stderr
    proc = create(cluster, ns, user, job(serviceAccountName="other"))
    assert proc.returncode != 0 and f"allowed: {CLOUD_SA}, {ALLOWED_SA}" in proc.stderr, proc.stderr


# --- Secrets: a DDPJob may use only those its creator may get ---------------------------------

# Each volume type that names a Secret: (its CRD field below volumes[], the volume, the field the
# policy's message names). cephfs.secretFile is a path on the node, not a Secret.
SECRET_VOLUMES = [
    ("secret.secretName", lambda s: {"secret": {"secretName": s}}, "secret"),
    ("projected.sources[].secret", lambda s: {"projected": {"sources": [{"secret": {"name": s}}]}},
     "projected.sources[].secret"),
    ("azureFile.secretName", lambda s: {"azureFile": {"secretName": s, "shareName": "share"}}, "azureFile.secretName"),
    ("csi.nodePublishSecretRef", lambda s: {"csi": {"driver": "csi.example.com", "nodePublishSecretRef": {"name": s}}},
     "csi.nodePublishSecretRef"),
    ("cephfs.secretRef", lambda s: {"cephfs": {"monitors": ["mon.example:6789"], "secretRef": {"name": s}}},
     "cephfs.secretRef"),
    ("cinder.secretRef", lambda s: {"cinder": {"volumeID": "v", "secretRef": {"name": s}}}, "cinder.secretRef"),
    ("flexVolume.secretRef", lambda s: {"flexVolume": {"driver": "example/flex", "secretRef": {"name": s}}},
     "flexVolume.secretRef"),
    ("iscsi.secretRef", lambda s: {"iscsi": {"targetPortal": "iscsi.example:3260", "lun": 0,
                                             "iqn": "iqn.2001-04.com.example:disk", "secretRef": {"name": s}}},
     "iscsi.secretRef"),
    ("rbd.secretRef", lambda s: {"rbd": {"monitors": ["mon.example:6789"], "image": "img", "secretRef": {"name": s}}},
     "rbd.secretRef"),
    ("scaleIO.secretRef", lambda s: {"scaleIO": {"gateway": "https://sio.example", "system": "sio",
                                                 "secretRef": {"name": s}}}, "scaleIO.secretRef"),
    ("storageos.secretRef", lambda s: {"storageos": {"secretRef": {"name": s}}}, "storageos.secretRef"),
]
# Each way a container names a Secret: (CRD field below the container, its fields, the message's field).
SECRET_ENV = [
    ("env[].valueFrom.secretKeyRef",
     lambda s: {"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": s, "key": "token"}}}]},
     "env[TOKEN].valueFrom.secretKeyRef"),
    ("envFrom[].secretRef", lambda s: {"envFrom": [{"secretRef": {"name": s}}]}, "envFrom[].secretRef"),
]


def _places():
    """(CRD field, spec naming the Secret given, field the message names) for every place."""
    out = [(f"spec.{f}", mk, f"spec.{at}") for f, mk, at in SECRET_ENV]
    out += [(f"spec.volumes[].{f}", lambda s, mk=mk: {"volumes": [{"name": "v", **mk(s)}]}, f"spec.volumes[v].{at}")
            for f, mk, at in SECRET_VOLUMES]
    out.append(("spec.imagePullSecrets", lambda s: {"imagePullSecrets": [{"name": s}]}, "spec.imagePullSecrets"))
    # MLflow's credentials: the operator turns the Secret into the pods' env (envvars.mlflow_secret_env).
    out.append(("spec.trainer.mlflow.credentialsSecret",
                lambda s: {"trainer": {"mlflow": {"trackingUri": "http://mlflow.example:5000", "credentialsSecret": s}}},
                "spec.trainer.mlflow.credentialsSecret"))
    tpl = "spec.template.spec"
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        out += [(f"{tpl}.{kind}[].{f}",
                 lambda s, kind=kind, mk=mk: {"template": {"spec": {kind: [{"name": "c", "image": "i", **mk(s)}]}}},
                 f"{tpl}.{kind}[c].{at}") for f, mk, at in SECRET_ENV]
    out += [(f"{tpl}.volumes[].{f}", lambda s, mk=mk: {"template": {"spec": {"volumes": [{"name": "v", **mk(s)}]}}},
             f"{tpl}.volumes[v].{at}") for f, mk, at in SECRET_VOLUMES]
    out.append((f"{tpl}.imagePullSecrets", lambda s: {"template": {"spec": {"imagePullSecrets": [{"name": s}]}}},
                f"{tpl}.imagePullSecrets"))
    return out


PLACES = _places()


def test_every_field_of_the_crd_that_names_a_secret_is_tried():
    """The cases below cover the CRD as it is: a new Secret-naming field in the schema (a new
    volume type, say) fails here until the policy and a case name it."""
    crd = yaml.safe_load((CHART / "crds" / "ddpjobs.ddpjob.dev.yaml").read_text())
    found = set()

    def walk(node, path):
        props = node.get("properties") or {}
        for key, child in props.items():
            named = "secret" in key.lower() and key != "secretFile"
            sub = f"{path}.{key}"
            if named and not any("secret" in k.lower() for k in (child.get("properties") or {})):
                found.add(sub)
            walk(child, sub)
        if "items" in node:
            walk(node["items"], path + "[]")

    for version in crd["spec"]["versions"]:
        walk(version["schema"]["openAPIV3Schema"]["properties"]["spec"], "spec")
    assert found == {field for field, _, _ in PLACES}


@pytest.mark.parametrize("field,spec,at", PLACES, ids=[p[0] for p in PLACES])
def test_a_secret_is_refused_unless_its_creator_may_get_it(cluster, tenant, readers, field, spec, at):
    ns, user = tenant
    reader, _ = readers
    proc = create(cluster, ns, user, job(**spec(SECRET)))
    assert proc.returncode != 0, f"accepted: {field}"
    assert f"{at}: Secret {SECRET} is forbidden" in proc.stderr and f"and {user} may not" in proc.stderr, proc.stderr
    proc = create(cluster, ns, reader, job(**spec(SECRET)))
    assert proc.returncode == 0, proc.stderr
    proc = create(cluster, ns, reader, job(**spec("other-token")))   # one the reader may not get
    assert proc.returncode != 0 and "Secret other-token is forbidden" in proc.stderr, proc.stderr


def test_an_update_is_checked_for_the_secrets_it_adds(cluster, tenant, readers):
    """A user without Secret rights may edit a job that names a Secret (the operator's own
    metadata updates are such edits), but may not add one."""
    ns, user = tenant
    reader, _ = readers
    env = [{"name": "A", "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "a"}}}]
    assert create(cluster, ns, reader, job("upd", env=env), dry_run=False).returncode == 0

    def patch(body):
        return cluster.kubectl("patch", "ddpj", "upd", "-n", ns, "--as", user, "--type", "merge",
                               "-p", json.dumps(body), check=False)

    proc = patch({"metadata": {"labels": {"team": "vision"}}, "spec": {"env": env + [{"name": "B", "value": "1"}]}})
    assert proc.returncode == 0, proc.stderr
    proc = patch({"spec": {"envFrom": [{"secretRef": {"name": "other-token"}}]}})
    assert proc.returncode != 0 and "spec.envFrom[].secretRef: Secret other-token is forbidden" in proc.stderr, \
        proc.stderr


def test_the_number_of_secrets_is_bounded_unless_the_user_may_get_them_all(cluster, tenant, readers):
    """Each Secret is an authorization check from the API server's CEL budget: the most a request
    may add is checked and admitted; one more is refused saying why; a user who may get every
    Secret of the namespace is not counted."""
    ns, _ = tenant
    reader, all_reader = readers

    def many(names):
        return job(envFrom=[{"secretRef": {"name": n}} for n in names])

    most = [f"s{i}" for i in range(MAX_SECRETS)]
    proc = create(cluster, ns, reader, many(most + most))      # repeats are checked once
    assert proc.returncode == 0, proc.stderr
    proc = create(cluster, ns, reader, many(most + [SECRET]))
    assert proc.returncode != 0 and f"at most {MAX_SECRETS} distinct Secrets" in proc.stderr, proc.stderr
    proc = create(cluster, ns, all_reader, many([f"x{i}" for i in range(3 * MAX_SECRETS)]))
    assert proc.returncode == 0, proc.stderr
    # A kind of its own has its own, smaller bound within the 20, on the same terms.
    configs = [f"c{i}" for i in range(MAX_CONFIGMAPS + 1)]
    proc = create(cluster, ns, reader, job(envFrom=[{"configMapRef": {"name": n}} for n in configs[:-1]]))
    assert proc.returncode == 0, proc.stderr
    proc = create(cluster, ns, reader, job(envFrom=[{"configMapRef": {"name": n}} for n in configs]))
    assert proc.returncode != 0 and f"at most {MAX_CONFIGMAPS} ConfigMaps" in proc.stderr, proc.stderr
    proc = create(cluster, ns, all_reader, job(envFrom=[{"configMapRef": {"name": f"x{i}"}} for i in range(30)]))
    assert proc.returncode == 0, proc.stderr


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


# --- RDMA: spec.rdma adds devices and IPC_LOCK, so only where the platform team allows it -------

RDMA_RESOURCE = "rdma/ib"


@pytest.fixture(scope="module")
def rdma_tenant(cluster, tenant, tmp_path_factory):
    """(namespace, user): the default profile with tenantPolicy.rdmaResources=[rdma/ib]."""
    user = f"{tenant[1]}-rdma"
    with bound_profile(cluster, tmp_path_factory.mktemp("rdma"), user, {"rdmaResources": [RDMA_RESOURCE]}) as ns:
        yield ns, user


def rdma_job(resource=RDMA_RESOURCE, **spec):
    return job("rdma", gpusPerNode=8, rdma={"resource": resource, "devicesPerNode": 4}, **spec)


def test_an_rdma_job_is_refused_by_a_default_install_naming_the_value(cluster, tenant):
    ns, user = tenant
    proc = create(cluster, ns, user, rdma_job())
    assert proc.returncode != 0, "accepted"
    assert ("spec.rdma.resource: rdma/ib is not allowed" in proc.stderr and "allowed: none" in proc.stderr
            and "tenantPolicy.rdmaResources" in proc.stderr), proc.stderr


def test_an_rdma_job_is_admitted_where_the_platform_allows_its_resource(cluster, rdma_tenant):
    ns, user = rdma_tenant
    proc = create(cluster, ns, user, rdma_job(), dry_run=False)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(cluster.kubectl("get", "ddpj", "rdma", "-n", ns, "-o", "json").stdout)
    assert stored["spec"]["rdma"] == {"resource": RDMA_RESOURCE, "devicesPerNode": 4}


def test_rdma_allows_only_its_resources_and_ipc_lock_only_through_spec_rdma(cluster, rdma_tenant):
    """The value allows the listed resources, not any device, and IPC_LOCK only as spec.rdma's:
    a container that adds it itself is refused as before."""
    ns, user = rdma_tenant
    proc = create(cluster, ns, user, rdma_job("vpc.amazonaws.com/efa"))
    assert proc.returncode != 0 and f"(allowed: {RDMA_RESOURCE};" in proc.stderr, proc.stderr
    proc = create(cluster, ns, user, job(gpusPerNode=8, securityContext={"capabilities": {"add": ["IPC_LOCK"]}}))
    assert proc.returncode != 0 and "spec.securityContext.capabilities.add: IPC_LOCK" in proc.stderr, proc.stderr
