"""A tenant gains nothing through the operator (issue 50), tried the way an attacker would.

One hostile DDPJob per field and class, flat fields and spec.template alike, each sent as a user
who may create, get and patch DDPJobs in one namespace and nothing else (impersonated, as
`kubectl --as` does), `--dry-run=server`, against the chart's real tenant policy; on create, and as
a patch of a job the tenant already has. Every one must be refused naming its field; every control
must pass, including every DDPJob of examples/ and the real-pod tier (what `make test` trains under
the same policy). A few hostile jobs are also rendered by the operator's own builder and created as
pods (by the admin, as the operator would), to show what the API server would have kept.

The policy: the chart's values.yaml with examples/local-cluster/operator-values.yaml's tenantPolicy
on top (the real-pod tier's install: its jobs select the real nodes and tolerate their taint) and
one allowed ServiceAccount for the token controls; its namespace selector narrowed to this test's
namespace. One install for the module; each case is one or two requests.
"""
from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.cluster.test_crd import install_crd
from tests.support.cluster import REPO_ROOT, create_namespace, delete_namespace, wait_for
from tests.support.tenancy import DDPJOBS_ONLY, Requests, bound_profile, grant, job, policy_cluster

ALLOWED_SA = "trainer"
LOCAL_CLUSTER = yaml.safe_load((REPO_ROOT / "examples" / "local-cluster" / "operator-values.yaml").read_text())
# Objects of the namespace a pod may read through the kubelet: the reader may get these, by name.
CONFIG, DATA, SNAPSHOT, CLAIM, CLAIM_TEMPLATE = "team-config", "team-data", "team-snap", "team-claim", "team-gpus"
METADATA = "169.254.169.254"   # a cloud's metadata address: never contacted (no pod here runs)


@pytest.fixture(scope="module")
def cluster():
    """The control plane the policy is tested on (tests/support/tenancy.py: DDPJOB_CLUSTER)."""
    return policy_cluster()


@dataclass(frozen=True)
class Users:
    ns: str
    tenant: str      # DDPJobs only
    reader: str      # + get on the objects named above
    member: str      # + get on every ConfigMap and PVC of the namespace (examples/ make their own)
    base: str        # a job the tenant created, that the patches below try to turn hostile


@pytest.fixture(scope="module")
def users(cluster, tmp_path_factory):
    install_crd(cluster)
    tag = uuid.uuid4().hex[:8]
    tenant = f"attacker-{tag}"
    platform = {**LOCAL_CLUSTER["tenantPolicy"], "serviceAccounts": [ALLOWED_SA]}
    with bound_profile(cluster, tmp_path_factory.mktemp("attacks"), tenant, platform) as ns:
        reader, member = f"{tenant}-reader", f"{tenant}-member"
        grant(cluster, ns, reader, DDPJOBS_ONLY,
              {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": [CONFIG]},
              {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"], "resourceNames": [DATA]},
              {"apiGroups": ["snapshot.storage.k8s.io"], "resources": ["volumesnapshots"], "verbs": ["get"],
               "resourceNames": [SNAPSHOT]},
              {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"],
               "resourceNames": [CLAIM]},
              {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"], "verbs": ["get"],
               "resourceNames": [CLAIM_TEMPLATE]},
              can=("get", f"configmap/{CONFIG}"))
        grant(cluster, ns, member, DDPJOBS_ONLY,
              {"apiGroups": [""], "resources": ["configmaps", "persistentvolumeclaims"], "verbs": ["get"]},
              can=("get", "persistentvolumeclaims"))
        requests = Requests(cluster, ns)
        made = requests.create(tenant, job("base", gpusPerNode=0), dry_run=False)
        assert made.ok, made.body
        yield Users(ns, tenant, reader, member, "base")
        requests.close()


@pytest.fixture(scope="module")
def requests(cluster, users):
    r = Requests(cluster, users.ns)
    yield r
    r.close()


@dataclass(frozen=True)
class Case:
    """A hostile spec (merged into a plain one-node CPU job) and what its refusal must say."""

    id: str
    cls: int                   # issue 50's class (0: the allow-list itself)
    spec: dict[str, Any]
    says: str
    patch: bool = True         # False: the fields it sets are immutable, so a patch is the CRD's to refuse


def tpl(**pod: Any) -> dict[str, Any]:
    return {"template": {"spec": pod}}


def side(**container: Any) -> dict[str, Any]:
    """A template with one sidecar container."""
    return tpl(containers=[{"name": "side", "image": "reg/side:1", **container}])


def vol(where: str, v: dict[str, Any]) -> dict[str, Any]:
    return {"volumes": [v]} if where == "flat" else tpl(volumes=[v])


AT = {"flat": "spec", "template": "spec.template.spec"}
SA_TOKEN = {"serviceAccountToken": {"audience": "sts.amazonaws.com", "expirationSeconds": 86400, "path": "token"}}
APPARMOR = "container.apparmor.security.beta.kubernetes.io/trainer"
SECCOMP = "seccomp.security.alpha.kubernetes.io/pod"
CONTROL_PLANE = "node-role.kubernetes.io/control-plane"


def hostile_cases() -> list[Case]:
    out: list[Case] = []
    for where in ("flat", "template"):
        at = AT[where]
        meta = (lambda key, kv: {key: kv}) if where == "flat" else \
            (lambda key, kv: {"template": {"metadata": {"labels" if key == "podLabels" else "annotations": kv}}})
        meta_at = {"podLabels": "spec.podLabels", "podAnnotations": "spec.podAnnotations"} if where == "flat" else \
            {"podLabels": "spec.template.metadata.labels", "podAnnotations": "spec.template.metadata.annotations"}
        out += [
            # 1. A ServiceAccount token: the namespace's default account's, for any audience.
            Case(f"1-projected-token-{where}", 1, vol(where, {"name": "tok", "projected": {"sources": [SA_TOKEN]}}),
                 f"{at}.volumes[tok].projected.sources[].serviceAccountToken forbidden"),
            # 2. AppArmor / seccomp unconfined through an annotation the API server turns into the field.
            Case(f"2-apparmor-annotation-{where}", 2, meta("podAnnotations", {APPARMOR: "unconfined"}),
                 f"{meta_at['podAnnotations']}[{APPARMOR}]: unconfined forbidden"),
            Case(f"2-seccomp-annotation-{where}", 2, meta("podAnnotations", {SECCOMP: "unconfined"}),
                 f"{meta_at['podAnnotations']}[{SECCOMP}]: unconfined forbidden"),
            # 4. Label keys Prometheus reads as the operator's own (the CRD refuses them, for everyone).
            Case(f"4-look-alike-dash-{where}", 4, meta("podLabels", {"ddpjob-dev/job-name": "victim"}),
                 f"{meta_at['podLabels']} must not use ddpjob.dev/ keys, nor keys that Prometheus reads"),
            Case(f"4-look-alike-underscore-{where}", 4, meta("podLabels", {"ddpjob_dev_job_name": "victim"}),
                 f"{meta_at['podLabels']} must not use ddpjob.dev/ keys, nor keys that Prometheus reads"),
            # 5. GPUs without asking: the toolkit's variables, a runtime class in a job without GPUs.
            Case(f"5-runtime-class-no-gpus-{where}", 5,
                 {"runtimeClassName": "nvidia"} if where == "flat" else tpl(runtimeClassName="nvidia"),
                 f"{at}.runtimeClassName: nvidia in a job without GPUs"),
            Case(f"5-runtime-class-not-listed-{where}", 5,
                 {"gpusPerNode": 8, **({"runtimeClassName": "nvidia-legacy"} if where == "flat" else
                                       tpl(runtimeClassName="nvidia-legacy"))},
                 f"{at}.runtimeClassName: nvidia-legacy is not an allowed runtime class", patch=False),
            # 6. The node: tolerations, scheduler, node selection outside the lists.
            Case(f"6-tolerate-everything-{where}", 6,
                 {"scheduling": {"tolerations": [{"operator": "Exists"}]}} if where == "flat" else
                 tpl(tolerations=[{"operator": "Exists"}]),
                 f"{'spec.scheduling' if where == 'flat' else at}.tolerations[<every key>] forbidden"),
            Case(f"6-tolerate-control-plane-{where}", 6,
                 {"scheduling": {"tolerations": [{"key": CONTROL_PLANE, "operator": "Exists", "effect": "NoSchedule"}]}}
                 if where == "flat" else tpl(tolerations=[{"key": CONTROL_PLANE, "operator": "Exists",
                                                           "effect": "NoSchedule"}]),
                 f"tolerations[{CONTROL_PLANE}:NoSchedule] forbidden"),
            Case(f"6-node-selector-{where}", 6,
                 {"scheduling": {"nodeSelector": {CONTROL_PLANE: ""}}} if where == "flat" else
                 tpl(nodeSelector={CONTROL_PLANE: ""}),
                 f"nodeSelector[{CONTROL_PLANE}] forbidden"),
            Case(f"6-node-affinity-{where}", 6,
                 {"scheduling": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                                                  "values": ["cp-0"]}]}]}}}}} if where == "flat" else
                 tpl(affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                     "weight": 100, "preference": {"matchFields": [{"key": "metadata.name", "operator": "In",
                                                                    "values": ["cp-0"]}]}}]}}),
                 "matchExpressions[kubernetes.io/hostname] forbidden" if where == "flat" else
                 "preference.matchFields[metadata.name] forbidden"),
            Case(f"6-scheduler-{where}", 6,
                 {"scheduling": {"schedulerName": "my-scheduler"}} if where == "flat" else tpl(schedulerName="my-scheduler"),
                 "schedulerName: my-scheduler forbidden"),
            # 7. Other objects of the namespace, by the creator's own `get`; scheduling groups; size.
            Case(f"7-configmap-volume-{where}", 7, vol(where, {"name": "cfg", "configMap": {"name": CONFIG}}),
                 f"{at}.volumes[cfg].configMap: ConfigMap {CONFIG} is forbidden"),
            Case(f"7-projected-configmap-{where}", 7,
                 vol(where, {"name": "cfg", "projected": {"sources": [{"configMap": {"name": CONFIG}}]}}),
                 f"{at}.volumes[cfg].projected.sources[].configMap: ConfigMap {CONFIG} is forbidden"),
            Case(f"7-pvc-{where}", 7, vol(where, {"name": "data", "persistentVolumeClaim": {"claimName": DATA}}),
                 f"{at}.volumes[data].persistentVolumeClaim: PersistentVolumeClaim {DATA} is forbidden"),
            Case(f"7-pvc-clone-{where}", 7, vol(where, {"name": "copy", "ephemeral": {"volumeClaimTemplate": {"spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                "dataSource": {"kind": "PersistentVolumeClaim", "name": DATA}}}}}),
                 f"{at}.volumes[copy].ephemeral.volumeClaimTemplate.spec.dataSource: PersistentVolumeClaim {DATA} "
                 "is forbidden"),
            Case(f"7-snapshot-clone-{where}", 7, vol(where, {"name": "copy", "ephemeral": {"volumeClaimTemplate": {"spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                "dataSourceRef": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": SNAPSHOT}}}}}),
                 f"dataSourceRef: VolumeSnapshot {SNAPSHOT} is forbidden"),
            Case(f"7-populator-clone-{where}", 7, vol(where, {"name": "copy", "ephemeral": {"volumeClaimTemplate": {"spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                "dataSourceRef": {"apiGroup": "populator.example.com", "kind": "Backup", "name": "other-team"}}}}}),
                 f"{at}.volumes[copy].ephemeral.volumeClaimTemplate.spec.dataSourceRef: Backup forbidden"),
            Case(f"7-bind-a-pv-{where}", 7, vol(where, {"name": "copy", "ephemeral": {"volumeClaimTemplate": {"spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                "volumeName": "released-pv-of-another-team"}}}}),
                 f"{at}.volumes[copy].ephemeral.volumeClaimTemplate.spec.volumeName forbidden"),
            Case(f"7-pod-group-label-{where}", 7, meta("podLabels", {"scheduling.x-k8s.io/pod-group": "victim"}),
                 f"{meta_at['podLabels']}[scheduling.x-k8s.io/pod-group] forbidden"),
            Case(f"7-kueue-group-label-{where}", 7, meta("podLabels", {"kueue.x-k8s.io/pod-group-name": "victim-a0"}),
                 f"{meta_at['podLabels']}[kueue.x-k8s.io/pod-group-name] forbidden"),
            Case(f"7-kueue-queue-label-{where}", 7, meta("podLabels", {"kueue.x-k8s.io/queue-name": "other-queue"}),
                 f"{meta_at['podLabels']}[kueue.x-k8s.io/queue-name] forbidden"),
            Case(f"7-volcano-group-annotation-{where}", 7, meta("podAnnotations", {"scheduling.k8s.io/group-name": "victim"}),
                 f"{meta_at['podAnnotations']}[scheduling.k8s.io/group-name] forbidden"),
            # The allow-list: a volume type that mounts from a server the tenant picks.
            Case(f"0-nfs-volume-{where}", 0, vol(where, {"name": "n", "nfs": {"server": METADATA, "path": "/"}}),
                 f"{at}.volumes[n].nfs forbidden"),
        ]
    out += [
        # 1. Template-only ways to a token.
        Case("1-automount-template", 1, tpl(automountServiceAccountToken=True),
             "spec.template.spec.automountServiceAccountToken forbidden"),
        Case("1-automount-with-another-account", 1,
             {"serviceAccountName": "default", **tpl(automountServiceAccountToken=True)},
             "spec.serviceAccountName: ServiceAccount default is not allowed"),
        # 3. Requests the kubelet makes from the node, to a host the tenant picks (template only:
        # the flat fields have no probes).
        Case("3-liveness-http-host", 3, side(livenessProbe={"httpGet": {"host": METADATA, "port": 80, "path": "/"}}),
             f"spec.template.spec.containers[side].livenessProbe.httpGet.host: {METADATA} forbidden"),
        Case("3-readiness-tcp-host", 3, side(readinessProbe={"tcpSocket": {"host": METADATA, "port": 80}}),
             f"spec.template.spec.containers[side].readinessProbe.tcpSocket.host: {METADATA} forbidden"),
        Case("3-startup-http-host-trainer", 3,
             tpl(containers=[{"name": "trainer", "startupProbe": {"httpGet": {"host": METADATA, "port": 80}}}]),
             f"spec.template.spec.containers[trainer].startupProbe.httpGet.host: {METADATA} forbidden"),
        Case("3-prestop-http-host", 3, side(lifecycle={"preStop": {"httpGet": {"host": METADATA, "port": 80}}}),
             f"spec.template.spec.containers[side].lifecycle.preStop.httpGet.host: {METADATA} forbidden"),
        Case("3-poststart-tcp-host-init", 3,
             tpl(initContainers=[{"name": "init", "image": "reg/i:1", "restartPolicy": "Always",
                                  "lifecycle": {"postStart": {"tcpSocket": {"host": METADATA, "port": 80}}}}]),
             f"spec.template.spec.initContainers[init].lifecycle.postStart.tcpSocket.host: {METADATA} forbidden"),
        # 4. A template label spelt with dots only.
        Case("4-look-alike-dots-template", 4, {"template": {"metadata": {"labels": {"ddpjob.dev.job-name": "victim"}}}},
             "spec.template.metadata.labels must not use ddpjob.dev/ keys, nor keys that Prometheus reads"),
        # 5. The toolkit's variables, in the flat env and in any template container.
        Case("5-visible-devices-flat", 5, {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
             "spec.env[NVIDIA_VISIBLE_DEVICES] forbidden"),
        Case("5-driver-capabilities-flat", 5, {"env": [{"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "all"}]},
             "spec.env[NVIDIA_DRIVER_CAPABILITIES] forbidden"),
        Case("5-visible-devices-trainer-template", 5,
             tpl(containers=[{"name": "trainer", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]),
             "spec.template.spec.containers[trainer].env[NVIDIA_VISIBLE_DEVICES] forbidden"),
        Case("5-visible-devices-init", 5,
             tpl(initContainers=[{"name": "init", "image": "reg/i:1",
                                  "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]),
             "spec.template.spec.initContainers[init].env[NVIDIA_VISIBLE_DEVICES] forbidden"),
        # 6. The node by name: no scheduler, no taints, no one-pod-per-node.
        Case("6-node-name", 6, tpl(nodeName="cp-0"), "spec.template.spec.nodeName forbidden"),
        # 7. Objects named in env, DRA claims, and the size of a job.
        Case("7-configmap-env-flat", 7,
             {"env": [{"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": CONFIG, "key": "k"}}}]},
             f"spec.env[CFG].valueFrom.configMapKeyRef: ConfigMap {CONFIG} is forbidden"),
        Case("7-configmap-envfrom-flat", 7, {"envFrom": [{"configMapRef": {"name": CONFIG}}]},
             f"spec.envFrom[].configMapRef: ConfigMap {CONFIG} is forbidden"),
        Case("7-configmap-envfrom-template", 7, side(envFrom=[{"configMapRef": {"name": CONFIG}}]),
             f"spec.template.spec.containers[side].envFrom[].configMapRef: ConfigMap {CONFIG} is forbidden"),
        Case("7-dra-claim", 7, tpl(resourceClaims=[{"name": "gpu", "resourceClaimName": CLAIM}]),
             f"spec.template.spec.resourceClaims[gpu].resourceClaimName: ResourceClaim {CLAIM} is forbidden"),
        Case("7-dra-claim-template", 7, tpl(resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": CLAIM_TEMPLATE}]),
             f"spec.template.spec.resourceClaims[gpu].resourceClaimTemplateName: ResourceClaimTemplate {CLAIM_TEMPLATE} "
             "is forbidden"),
        Case("7-nodes", 7, {"nodes": 10000}, "spec.nodes: 10000: at most 256 pods per job", patch=False),
        Case("7-elastic-max-nodes", 7, {"nodes": 2, "elastic": {"minNodes": 1, "maxNodes": 1000}},
             "spec.elastic.maxNodes: 1000: at most 256 pods per job", patch=False),
        # 0. The allow-list: what a training pod does not need starts refused, Kubernetes' new fields too.
        Case("0-scheduling-gates", 0, tpl(schedulingGates=[{"name": "mine"}]),
             "spec.template.spec.schedulingGates forbidden"),
        Case("0-ephemeral-containers", 0, tpl(ephemeralContainers=[{"name": "dbg", "image": "reg/d:1"}]),
             "spec.template.spec.ephemeralContainers forbidden"),
        Case("0-hostname-override", 0, tpl(hostnameOverride="other-pod"), "spec.template.spec.hostnameOverride forbidden"),
        Case("0-container-tty", 0, side(stdin=True, tty=True), "spec.template.spec.containers[side].stdin"),
        Case("0-cluster-trust-bundle", 0, tpl(volumes=[{"name": "ctb", "projected": {"sources": [
            {"clusterTrustBundle": {"name": "corp-ca", "path": "ca.pem"}}]}}]),
             "spec.template.spec.volumes[ctb].projected.sources[].clusterTrustBundle forbidden"),
    ]
    return out


HOSTILE = hostile_cases()


def controls() -> list[tuple[str, str, dict[str, Any]]]:
    """(id, who, spec) that must be admitted: the same fields within the profile."""
    return [
        ("token-with-the-allowed-account", "tenant",
         {"serviceAccountName": ALLOWED_SA, **tpl(automountServiceAccountToken=True,
                                                  volumes=[{"name": "tok", "projected": {"sources": [SA_TOKEN]}}])}),
        ("no-token-without-an-account", "tenant", tpl(automountServiceAccountToken=False)),
        ("apparmor-and-seccomp-annotations-that-confine", "tenant",
         {"podAnnotations": {APPARMOR: "runtime/default", SECCOMP: "localhost/profiles/train.json"},
          "template": {"metadata": {"annotations": {APPARMOR: "localhost/train"}}}}),
        ("probes-and-hooks-on-the-pod-itself", "tenant",
         side(livenessProbe={"httpGet": {"port": 8080, "path": "/healthz"}},
              readinessProbe={"tcpSocket": {"port": 8080}},
              lifecycle={"preStop": {"sleep": {"seconds": 5}}})),
        ("own-labels", "tenant", {"podLabels": {"team": "vision", "ddpjob-devices": "a"},
                                  "template": {"metadata": {"labels": {"app.kubernetes.io/part-of": "llm"}}}}),
        ("gpus-and-the-operators-runtime-class", "tenant", {"gpusPerNode": 8, "nodes": 4}),
        ("cuda-visible-devices-is-not-the-toolkits", "tenant", {"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]}),
        ("gpu-taint-and-gpu-node-labels", "tenant",
         {"scheduling": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                         "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                         "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                             "nodeSelectorTerms": [{"matchExpressions": [{"key": "topology.kubernetes.io/zone",
                                                                          "operator": "In", "values": ["a"]}]}]}}}}}),
        ("the-platforms-own-node-pool", "tenant",
         {"scheduling": {"nodeSelector": {"ddpjob.dev/node-kind": "real"},
                         "tolerations": [{"key": "ddpjob.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}]}}),
        ("gang-through-the-operator", "tenant", {"nodes": 2, "scheduling": {"gang": {"scheduler": "coscheduling"}}}),
        ("objects-the-creator-may-get", "reader",
         {"envFrom": [{"configMapRef": {"name": CONFIG}}],
          "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": DATA}},
                      {"name": "copy", "ephemeral": {"volumeClaimTemplate": {"spec": {
                          "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                          "dataSourceRef": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                                            "name": SNAPSHOT}}}}}],
          "template": {"spec": {"resourceClaims": [{"name": "a", "resourceClaimName": CLAIM},
                                                   {"name": "b", "resourceClaimTemplateName": CLAIM_TEMPLATE}],
                                "volumes": [{"name": "cfg", "projected": {"sources": [{"configMap": {"name": CONFIG}},
                                                                                      {"downwardAPI": {"items": []}}]}}]}}}),
        ("fresh-ephemeral-volume", "tenant", tpl(volumes=[{"name": "scratch", "ephemeral": {"volumeClaimTemplate": {
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}}}])),
        ("at-most-max-nodes", "tenant", {"nodes": 256, "elastic": {"minNodes": 2, "maxNodes": 256}}),
    ]


CONTROLS = controls()
# Fields a control sets that the CRD keeps from a patch (immutable): controls with them are created only.
IMMUTABLE = ("nodes", "gpusPerNode", "elastic")


def refused(answer, says: str) -> bool:
    return answer.status in (403, 422) and says in answer.message


@pytest.mark.parametrize("case", HOSTILE, ids=[c.id for c in HOSTILE])
def test_a_hostile_job_is_refused_naming_its_field(requests, users, case):
    answer = requests.create(users.tenant, job("hostile", **{"gpusPerNode": 0, **case.spec}))
    assert refused(answer, case.says), f"class {case.cls}: {answer.status} {answer.message or 'ADMITTED'}"


@pytest.mark.parametrize("case", [c for c in HOSTILE if c.patch], ids=[c.id for c in HOSTILE if c.patch])
def test_a_patch_that_makes_a_job_hostile_is_refused(requests, users, case):
    """The same on UPDATE: a user who may patch DDPJobs turns their existing job into the hostile one."""
    answer = requests.patch(users.tenant, users.base, {"spec": case.spec})
    assert refused(answer, case.says), f"class {case.cls}: {answer.status} {answer.message or 'ADMITTED'}"


@pytest.mark.parametrize("cid,who,spec", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_a_control_within_the_profile_passes(requests, users, cid, who, spec):
    user = getattr(users, who)
    answer = requests.create(user, job("control", **{"gpusPerNode": 0, **spec}))
    assert answer.ok, answer.message
    if not any(key in spec for key in IMMUTABLE):
        answer = requests.patch(user, users.base, {"spec": spec})
        assert answer.ok, answer.message


def test_the_attacker_holds_rights_on_ddpjobs_only(cluster, users):
    """The premise: the attacker holds no right but on DDPJobs (and cannot create pods itself)."""
    for verb, resource, expected in (("create", "ddpjobs.ddpjob.dev", "yes"), ("patch", "ddpjobs.ddpjob.dev", "yes"),
                                     ("create", "pods", "no"), ("get", "configmaps", "no"), ("get", "secrets", "no"),
                                     ("get", "persistentvolumeclaims", "no"), ("create", "serviceaccounts/token", "no")):
        out = cluster.kubectl("auth", "can-i", verb, resource, "-n", users.ns, "--as", users.tenant, check=False).stdout
        assert out.strip() == expected, (verb, resource, out)


# --- what the real-pod tier and examples/ use passes under the same policy ---------------------

def example_jobs() -> list[tuple[str, dict[str, Any]]]:
    """Every DDPJob of examples/ as a user applies it, the real-pod tier's versions of them (on the
    real nodes, examples/local-cluster's way), and the real-pod tier's own jobs."""
    from tests.realpods.conftest import example_docs
    from tests.realpods.test_image_features import features_job
    from tests.realpods.test_template import templated_job

    out = []
    for path in sorted((REPO_ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "DDPJob":
                out.append((f"examples/{path.name}", doc))
                out += [(f"realpods: examples/{path.name}", d) for d in example_docs(path.name) if d.get("kind") == "DDPJob"]
    out.append(("realpods: test_template", templated_job("token")))
    out.append(("realpods: test_image_features", features_job("http://127.0.0.1:5000")))
    return out


def test_every_example_and_real_pod_job_passes(requests, users):
    """What `make test` trains on the real nodes, and what a user applies from examples/, under the
    policy the real-pod tier installs; as a member of the namespace who may read its ConfigMaps and
    PVCs (the examples bring their own), and may do nothing else."""
    jobs = example_jobs()
    assert len(jobs) >= 9, [name for name, _ in jobs]
    refusals = {}
    for name, doc in jobs:
        doc = copy.deepcopy(doc)
        doc["metadata"] = {"name": "example"}
        answer = requests.create(users.member, doc)
        if not answer.ok:
            refusals[name] = answer.message
    assert refusals == {}


# --- UPDATE: only a spec change is checked --------------------------------------------------------

def test_a_job_from_before_a_rule_keeps_its_metadata_updates(cluster, users):
    """The operator's own updates of a job (finalizers, kopf's annotations) and a tenant's label edits
    change no pod: a job admitted before a rule (here: before its namespace was bound to the
    profile) still takes them, while an edit of its spec is checked against the whole spec."""
    api = cluster.api()
    profile = cluster.kubectl("get", "ns", users.ns, "-o", "jsonpath={.metadata.labels.ddpjob\\.dev/tenant-profile}").stdout
    late = create_namespace(api, prefix="tenant-late-", labels={"ddpjob.dev/tenant-profile": "none"})
    try:
        grant(cluster, late, users.tenant, DDPJOBS_ONLY, can=("patch", "ddpjobs.ddpjob.dev"))
        r = Requests(cluster, late)
        before = r.create(users.tenant, job("old", gpusPerNode=0, **tpl(nodeName="cp-0")), dry_run=False)
        assert before.ok, before.message
        cluster.kubectl("label", "ns", late, f"ddpjob.dev/tenant-profile={profile}", "--overwrite")
        wait_for(lambda: refused(r.patch(users.tenant, "old", {"spec": {"podLabels": {"a": "b"}}}),
                                 "spec.template.spec.nodeName forbidden"), timeout=30, desc="the profile binds the namespace")
        answer = r.patch(users.tenant, "old", {"metadata": {"labels": {"team": "vision"},
                                                            "annotations": {"note": "kept"}}}, dry_run=False)
        assert answer.ok, answer.message
        r.close()
    finally:
        delete_namespace(api, late)
        api.close()


# --- what the API server keeps: the hostile jobs' pods, had the operator created them ------------

NOWHERE = {"ddpjob.dev/test-no-such-node": "true"}   # no node has it: these pods never run


def operator_pod(spec: dict[str, Any], namespace: str) -> dict[str, Any]:
    """Pod 0 of a one-node job with `spec`, as the operator's builder renders it."""
    from ddpjob_cli.local import validate
    from ddpjob_operator.base.config import OperatorConfig
    from ddpjob_operator.builders.render import render_pod

    doc = job("kept", gpusPerNode=0, **spec)
    doc["metadata"]["namespace"] = namespace
    pod = render_pod(validate(doc), 0, config=OperatorConfig())
    pod["metadata"].pop("ownerReferences", None)     # no DDPJob stands behind it
    if "nodeName" not in pod["spec"]:
        pod["spec"]["nodeSelector"] = NOWHERE
    return pod


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []) if c["name"] == name)


KEPT = {
    # The default ServiceAccount's token, mounted.
    "1-automount-template": lambda p: p["spec"]["automountServiceAccountToken"] is True and p["spec"][
        "serviceAccountName"] == "default" and any(
        "serviceAccountToken" in s for v in p["spec"]["volumes"] for s in (v.get("projected") or {}).get("sources", [])
        if v["name"].startswith("kube-api-access-")),
    # The annotation became the field.
    "2-apparmor-annotation-flat": lambda p: (_container(p, "trainer").get("securityContext") or {}).get(
        "appArmorProfile") == {"type": "Unconfined"},
    # The node-side request, kept as written.
    "3-liveness-http-host": lambda p: _container(p, "side")["livenessProbe"]["httpGet"]["host"] == METADATA,
    # Bound to the node the tenant named, no scheduler involved.
    "6-node-name": lambda p: p["spec"]["nodeName"] == "cp-0" and "nodeSelector" not in p["spec"],
    # Every GPU of the node, on the toolkit's defaults.
    "5-visible-devices-flat": lambda p: {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in _container(p, "trainer")["env"],
}


@pytest.mark.parametrize("case_id", sorted(KEPT))
def test_what_the_api_server_would_have_kept(cluster, users, case_id):
    """The refusal is the only thing in the way: the same spec, as the operator renders it and
    creates it with its own rights, is admitted and kept."""
    from kubernetes import client

    case = next(c for c in HOSTILE if c.id == case_id)
    core = client.CoreV1Api(api := cluster.api())
    pod = operator_pod(case.spec, users.ns)
    name = f"kept-{uuid.uuid4().hex[:6]}"
    pod["metadata"]["name"] = name
    try:
        core.create_namespaced_pod(users.ns, pod)
        kept = api.sanitize_for_serialization(core.read_namespaced_pod(name, users.ns))
        assert KEPT[case_id](kept), yaml.safe_dump(kept["spec"])[:3000]
    finally:
        core.delete_namespaced_pod(name, users.ns, grace_period_seconds=0)
        api.close()
