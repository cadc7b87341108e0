"""The Helm chart, rendered by the real helm binary: lint, values combinations, schema, RBAC."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import OPERATOR_IMAGE_VALUES

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ddpjob-operator"
RELEASE, NS = "ddpjob", "ddpjob-system"


def find_helm() -> str | None:
    """The helm that `make cluster-up` links, else hack/build.sh's cache, else PATH."""
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    linked = REPO / ".cache" / "bin" / "helm"
    if linked.exists():
        return str(linked)
    versions = (REPO / "hack" / "versions.env").read_text()
    m = re.search(r"^HELM_VERSION=(\S+)", versions, re.M)
    cache = Path(os.environ.get("DDPJOB_CACHE", Path.home() / ".cache" / "ddpjob"))
    if m and (cache / "bin" / f"helm-{m.group(1)}" / "helm").exists():
        return str(cache / "bin" / f"helm-{m.group(1)}" / "helm")
    return shutil.which("helm")


HELM = find_helm()
# A helm built with `go install` (hack/build.sh) defaults to Kubernetes v1.20 for offline
# rendering, below the chart's kubeVersion; render for the version the local cluster runs.
KUBE_VERSION = re.search(r"^KUBE_VERSION=v?(\S+)", (REPO / "hack" / "versions.env").read_text(), re.M).group(1)
pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary: `make build-cluster` builds it")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


# Every render names the image it means (the chart has no default); `sets` and values files come after.
IMAGE = tuple(a for s in OPERATOR_IMAGE_VALUES for a in ("--set", s))


def render(*sets: str, values: dict | None = None, tmp_path: Path | None = None) -> list[dict]:
    """`helm template` with --set pairs (and an optional values file); parsed documents."""
    args = ["template", RELEASE, str(CHART), "--namespace", NS, "--kube-version", KUBE_VERSION]
    if "image" not in (values or {}):        # --set would win over the file's own image
        args += IMAGE
    for s in sets:
        args += ["--set", s]
    if values is not None:
        assert tmp_path is not None
        f = tmp_path / "values.yaml"
        f.write_text(yaml.safe_dump(values))
        args += ["-f", str(f)]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def render_error(*sets: str) -> str:
    proc = helm("template", RELEASE, str(CHART), "--namespace", NS, "--kube-version", KUBE_VERSION, *IMAGE,
                *[a for s in sets for a in ("--set", s)], check=False)
    assert proc.returncode != 0, f"helm template {sets} should fail but rendered:\n{proc.stdout[:500]}"
    return proc.stderr


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {kinds(docs)}"
    return found[0]


def container(docs: list[dict]) -> dict:
    workload = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(workload) == 1, kinds(docs)
    (c,) = workload[0]["spec"]["template"]["spec"]["containers"]
    return c


# The RBAC contract: exactly these (apiGroup, resource) -> verbs, nothing else.
EXPECTED_RULES = {
    ("ddpjob.dev", "ddpjobs"): {"get", "list", "watch", "delete"},
    ("ddpjob.dev", "ddpjobs/status"): {"patch"},
    ("ddpjob.dev", "ddpjobs/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "services"): {"get", "create"},
    ("", "events"): {"create"},
    # The job's captured stacks, <job>-stacks (decisions/stacks.py).
    ("", "configmaps"): {"get", "create", "patch"},
    # spec.scheduling.gang: the gang scheduler's PodGroup.
    ("scheduling.x-k8s.io", "podgroups"): {"get", "create"},
    ("scheduling.volcano.sh", "podgroups"): {"get", "create"},
}
PEERING_VERBS = {"get", "list", "watch", "patch"}
# Cluster mode only (a Role cannot grant a cluster-scoped resource): is a pod's node simulated by kwok?
NODE_RULE = (("", "nodes"), {"get"})


def rule_table(role: dict) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                table.setdefault((group, res), set()).update(rule["verbs"])
    return table


def assert_least_privilege(table: dict[tuple[str, str], set[str]]) -> None:
    for (group, res), verbs in table.items():
        assert "*" not in verbs and group != "*" and res != "*", (group, res, verbs)
        assert res not in ("secrets", "nodes/status"), f"must never grant {res}"
        assert res != "nodes" or verbs == {"get"}, f"nodes: only get, never {verbs}"
        assert group != "rbac.authorization.k8s.io", f"must never grant RBAC objects: {res}"
        assert not res.startswith(("pods/exec", "pods/attach", "pods/portforward")), res


# --- lint and schema ---------------------------------------------------------------------

@pytest.mark.parametrize("sets", [
    (),
    ("ha.enabled=true", "replicaCount=3"),
    ("rbac.namespaced=true", "operator.watchNamespaces={team-a,team-b}"),
    ("monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.enabled=true",
     "monitoring.prometheusRule.enabled=true", "monitoring.dashboards.enabled=true"),
], ids=["defaults", "ha", "namespaced", "monitoring"])
def test_helm_lint_strict_is_clean(sets):
    args = ["lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART), *IMAGE] + [a for s in sets for a in ("--set", s)]
    proc = helm(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_default_values_match_schema():
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


@pytest.mark.parametrize("bad, needle", [
    ("replicaCount=two", "replicaCount"),
    ("image.pullPolicy=Sometimes", "pullPolicy"),
    ("operator.logLevel=VERBOSE", "logLevel"),
    ("operator.metricsPort=70000", "metricsPort"),
    ("operater.logLevel=INFO", "operater"),            # a typo'd key is rejected, not ignored
    ("operator.watchNamespaces={Bad_NS}", "watchNamespaces"),
    ("monitoring.podMonitor.interval=often", "interval"),
    ("tenantPolicy.rdmaResources={ib}", "rdmaResources"),      # not an extended resource name
])
def test_schema_rejects_bad_values(bad, needle):
    err = render_error(bad)
    assert "schema" in err.lower() and needle in err, err


def test_the_chart_refuses_a_control_plane_older_than_the_oldest_ci_runs():
    oldest = re.search(r"^KUBE_OLDEST_VERSION=v?(\S+)", (REPO / "hack" / "versions.env").read_text(), re.M).group(1)
    minor = ".".join(oldest.split(".")[:2])
    older = f"1.{int(minor.split('.')[1]) - 1}.9"
    proc = helm("template", RELEASE, str(CHART), "--kube-version", older, *IMAGE, check=False)
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr and older in proc.stderr, proc.stderr
    for supported in (f"{minor}.0", KUBE_VERSION):
        assert helm("template", RELEASE, str(CHART), "--kube-version", supported, *IMAGE).returncode == 0


@pytest.mark.parametrize("sets, needle", [
    (("rbac.namespaced=true",), "watchNamespaces"),
    (("replicaCount=2",), "ha.enabled"),
    (("ha.enabled=true",), "replicaCount >= 2"),
    (("operator.healthPort=8080",), "must differ"),
])
def test_unsafe_combinations_fail_with_a_clear_message(sets, needle):
    assert needle in render_error(*sets)


def test_every_values_key_is_commented():
    """Each chart-defined key in values.yaml (a property in values.schema.json) has a comment line
    right above it, or is a section whose keys do; contents of free-form Kubernetes objects
    (resources, securityContext, ...) are covered by their key's comment."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z]\w*):(.*)$", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = schema
        for _, key in stack:
            parent = parent.get("properties", {}).get(key, {})
        stack.append((indent, m.group(2)))
        if "properties" not in parent:
            continue                       # inside a free-form object: not a chart key
        node = parent["properties"].get(m.group(2))
        assert node is not None, f"values.yaml key {'.'.join(k for _, k in stack)} is not in the schema"
        is_section = "properties" in node and m.group(3).strip() == ""
        if not is_section and not lines[i - 1].strip().startswith("#"):
            missing.append(".".join(k for _, k in stack))
    assert not missing, f"values.yaml keys without a comment: {missing}"


# --- default install ------------------------------------------------------------------------

CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding")


def test_defaults_render_a_recreate_deployment_with_cluster_rbac():
    docs = render()
    assert kinds(docs) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount",
                           "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                           "ValidatingAdmissionPolicyBinding"]
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    for d in docs:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"]["namespace"] == NS, d["kind"]
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa
    crb = one(docs, "ClusterRoleBinding")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NS}]
    assert crb["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]


def test_restrictive_security_context_and_tmp_volume():
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])


def test_probes_and_ports_follow_the_operator_settings():
    docs = render("operator.healthPort=9091", "operator.metricsPort=9090")
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 9090, "health": 9091}
    for probe in (c["livenessProbe"], c["readinessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    svc = one(docs, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert svc["spec"]["selector"].items() <= \
        one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()


def parse_operator_args(c: dict) -> dict:
    """Parse the container's args with the real `ddpjob operator` click command."""
    from ddpjob_cli import main as cli

    assert c["command"] == ["ddpjob"] and c["args"][0] == "operator"
    ctx = cli.main.commands["operator"].make_context("operator", list(c["args"][1:]))
    return ctx.params


def test_operator_args_are_accepted_by_the_real_cli():
    params = parse_operator_args(container(render(
        "operator.defaultRuntimeClass=nvidia-cdi", "operator.clusterDomain=cluster.local",
        "operator.scrapeInterval=30", "operator.progressInterval=7", "operator.unschedulableTimeout=120",
        "operator.logLevel=DEBUG", "operator.logFormat=json")))
    assert params["all_namespaces"] is True and params["namespaces"] == ()
    assert params["default_runtime_class"] == "nvidia-cdi"
    assert params["cluster_domain"] == "cluster.local"
    assert params["scrape_interval"] == 30 and params["unschedulable_timeout"] == 120
    assert params["progress_interval"] == 7
    assert params["log_level"] == "DEBUG" and params["log_format"] == "json"
    assert params["metrics_port"] == 8080 and params["health_port"] == 8081
    assert params["peering"] == "", "a single replica runs standalone (no peering object needed)"


def test_the_charts_progress_interval_is_the_operators_default():
    """One default: the chart's value is held to OperatorConfig's (the CLI's default too)."""
    from ddpjob_operator.base.config import OperatorConfig
    assert parse_operator_args(container(render()))["progress_interval"] == OperatorConfig().progress_interval


def test_the_schemas_log_choices_are_the_clis():
    from ddpjob_operator.base.config import LOG_FORMATS, LOG_LEVELS
    props = json.loads((CHART / "values.schema.json").read_text())["properties"]["operator"]["properties"]
    assert tuple(props["logLevel"]["enum"]) == LOG_LEVELS and tuple(props["logFormat"]["enum"]) == LOG_FORMATS


def test_default_rbac_is_exactly_the_contract():
    table = rule_table(one(render(), "ClusterRole"))
    assert_least_privilege(table)
    assert table.pop(NODE_RULE[0]) == NODE_RULE[1]
    assert table == EXPECTED_RULES


# --- namespaced mode --------------------------------------------------------------------------

def test_namespaced_mode_renders_roles_only_in_the_listed_namespaces():
    docs = render("rbac.namespaced=true", "operator.watchNamespaces={team-a,team-b}")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    roles = [d for d in docs if d["kind"] == "Role"]
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NS}]
    for r in roles:
        table = rule_table(r)
        assert_least_privilege(table)
        assert table == EXPECTED_RULES
    params = parse_operator_args(container(docs))
    assert params["all_namespaces"] is False and params["namespaces"] == ("team-a", "team-b")


def test_watch_namespaces_without_namespaced_rbac_keeps_a_cluster_role():
    docs = render("operator.watchNamespaces={team-a}")
    assert "ClusterRole" in kinds(docs) and "Role" not in kinds(docs)
    assert parse_operator_args(container(docs))["namespaces"] == ("team-a",)


def test_rbac_and_service_account_can_be_brought_by_the_user():
    docs = render("rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=my-sa",
                  "tenantPolicy.enabled=false")
    assert kinds(docs) == ["Deployment", "Service"]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "my-sa"


# --- HA -------------------------------------------------------------------------------------------

def test_ha_peers_with_distinct_priorities():
    docs = render("ha.enabled=true", "replicaCount=3", "peering.name=ddpjob-ha")
    assert "Deployment" not in kinds(docs)
    sts = one(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 3
    c = container(docs)
    env = {e["name"]: e for e in c["env"]}
    assert env["DDPJOB_PRIORITY"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    params = parse_operator_args(c)
    assert params["peering"] == "ddpjob-ha"
    assert "--priority" not in " ".join(c["args"]), "the per-pod env must decide the priority"
    assert one(docs, "ClusterKopfPeering")["metadata"]["name"] == "ddpjob-ha"
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    table = rule_table(one(docs, "ClusterRole"))
    assert table.pop(("kopf.dev", "clusterkopfpeerings")) == PEERING_VERBS
    assert table.pop(NODE_RULE[0]) == NODE_RULE[1]
    assert table == EXPECTED_RULES


def test_ha_in_namespaced_mode_uses_one_kopfpeering_per_namespace():
    docs = render("ha.enabled=true", "replicaCount=2", "rbac.namespaced=true",
                  "operator.watchNamespaces={team-a,team-b}")
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert "ClusterKopfPeering" not in kinds(docs)
    for r in (d for d in docs if d["kind"] == "Role"):
        assert rule_table(r)[("kopf.dev", "kopfpeerings")] == PEERING_VERBS


def test_peering_crds_ship_in_crds_dir():
    names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in (CHART / "crds").glob("*.yaml")}
    assert {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= names


# --- scheduling knobs and monitoring flags ---------------------------------------------------------

def test_scheduling_and_pod_metadata_values_reach_the_pod(tmp_path):
    docs = render(values={
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "gpu", "operator": "DoesNotExist"}]}]}}},
        "podAnnotations": {"a": "b"}, "podLabels": {"team": "ml"},
        "imagePullSecrets": [{"name": "regcred"}],
        "image": {"repository": "example.com/op", "tag": "1.2.3", "pullPolicy": "Always"},
        "operator": {"extraEnv": [{"name": "DDPJOB_SCRAPE_URL_TEMPLATE", "value": "x"}]},
    }, tmp_path=tmp_path)
    tpl = one(docs, "Deployment")["spec"]["template"]
    spec = tpl["spec"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["tolerations"][0]["key"] == "dedicated"
    assert "nodeAffinity" in spec["affinity"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert tpl["metadata"]["annotations"] == {"a": "b"} and tpl["metadata"]["labels"]["team"] == "ml"
    c = container(docs)
    assert c["image"] == "example.com/op:1.2.3" and c["imagePullPolicy"] == "Always"
    assert {"name": "DDPJOB_SCRAPE_URL_TEMPLATE", "value": "x"} in c["env"]


def test_image_tag_defaults_to_app_version():
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert container(render("image.tag="))["image"] == f"localhost/ddpjob/operator:{app_version}"


def test_the_default_image_is_the_releases_own_and_an_empty_one_fails_naming_the_value():
    """No image flags: the operator image of the chart's own release (make release writes its
    registry into the packaged values.yaml); set to nothing, the chart stops naming the value."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    proc = helm("template", RELEASE, str(CHART), "--namespace", NS, "--kube-version", KUBE_VERSION)
    images = [c["image"] for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]]
    assert images == [f"ghcr.io/ddpjob/operator:{app_version}"]
    err = render_error("image.repository=")
    assert "image.repository is empty" in err and "docs/install.md" in err, err


MONITORING = {
    "podMonitor": ("podmonitor.yaml", "PodMonitor"),
    "serviceMonitor": ("servicemonitor.yaml", "ServiceMonitor"),
    "prometheusRule": ("prometheusrule.yaml", "PrometheusRule"),
    "dashboards": ("dashboards-configmap.yaml", "ConfigMap"),
}


def test_no_monitoring_objects_by_default():
    assert not {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap"} & set(kinds(render()))


@pytest.mark.parametrize("key", sorted(MONITORING))
def test_monitoring_object_only_when_enabled(key):
    template, kind = MONITORING[key]
    docs = render(f"monitoring.{key}.enabled=true", f"monitoring.{key}.labels.release=kps")
    objs = [d for d in docs if d["kind"] == kind]
    assert objs, f"monitoring.{key}.enabled=true rendered no {kind}"
    assert all(o["metadata"]["labels"].get("release") == "kps" for o in objs)
    others = {other for k2, (_, other) in MONITORING.items() if k2 != key}
    assert not others & set(kinds(docs))


def test_helm_package_holds_the_chart_and_nothing_else(tmp_path):
    import tarfile

    helm("package", str(CHART), "-d", str(tmp_path))
    (pkg,) = tmp_path.glob("ddpjob-operator-*.tgz")
    with tarfile.open(pkg) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"Chart.yaml", "values.yaml", "values.schema.json", "templates/NOTES.txt",
            "crds/kopfpeerings.kopf.dev.yaml", "crds/clusterkopfpeerings.kopf.dev.yaml"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".swp", "~"))]


# --- tenant policy (two ValidatingAdmissionPolicies per profile) --------------------------------

def policies(docs: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    """({profile: fields policy spec}, {profile: refs policy spec}) of the rendered documents."""
    fields, refs = {}, {}
    prefix = f"{RELEASE}-ddpjob-operator-"
    for d in docs:
        if d["kind"] == "ValidatingAdmissionPolicy":
            name = d["metadata"]["name"].removeprefix(prefix)
            if name.endswith("-refs"):
                refs[name.removesuffix("-refs")] = d["spec"]
            else:
                fields[name] = d["spec"]
    return fields, refs


def lists_of(spec: dict) -> dict[str, object]:
    """The policy's variables that are plain JSON lists (the allow-lists), parsed."""
    out = {}
    for v in spec["variables"]:
        try:
            out[v["name"]] = json.loads(v["expression"])
        except ValueError:
            pass
    return out


def test_tenant_policy_default_profile_is_baseline_with_its_allow_lists():
    docs = render()
    vaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    binds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert set(vaps) == set(binds) == {f"{RELEASE}-ddpjob-operator-baseline", f"{RELEASE}-ddpjob-operator-baseline-refs"}
    for name, binding in binds.items():
        assert binding["spec"]["policyName"] == name
        assert binding["spec"]["validationActions"] == ["Deny"]
        # Namespaces that carry a profile label of their own are left to that profile.
        assert binding["spec"]["matchResources"]["namespaceSelector"] == {
            "matchExpressions": [{"key": "ddpjob.dev/tenant-profile", "operator": "DoesNotExist"}]}
        vap = vaps[name]["spec"]
        assert vap["failurePolicy"] == "Fail"
        assert vap["matchConstraints"]["resourceRules"][0]["resources"] == ["ddpjobs"]
        # UPDATE is checked when the spec changes (a tenant's patch), not on the operator's metadata updates.
        assert vap["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE", "UPDATE"]
        assert [m["expression"] for m in vap["matchConditions"]] == [
            "request.operation == 'CREATE' || object.spec != oldObject.spec"]
    fields, _ = policies(docs)
    lists = lists_of(fields["baseline"])
    assert lists["serviceAccounts"] == [] and lists["priorityClasses"] == [] and lists["runtimeClasses"] == []
    assert lists["schedulers"] == [] and lists["tolerations"] == ["nvidia.com/gpu"]
    assert "nvidia.com/*" in lists["nodeSelectorKeys"] and "kubernetes.io/hostname" not in lists["nodeSelectorKeys"]
    assert "SYS_ADMIN" not in lists["allowedCapabilities"] and "CHOWN" in lists["allowedCapabilities"]
    # Allow, don't deny: what a training pod needs, by name; nodeName and friends are not in it.
    assert {"containers", "initContainers", "volumes", "affinity", "tolerations"} <= set(lists["podFields"])
    assert not {"nodeName", "schedulingGates", "ephemeralContainers", "overhead", "priority"} & set(lists["podFields"])
    assert not {"stdin", "tty"} & set(lists["containerFields"])
    assert not {"hostPath", "nfs", "gitRepo", "clusterTrustBundle", "podCertificate"} & set(lists["volumeTypes"])
    assert lists["nvidiaEnv"][:2] == ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"]
    text = json.dumps(fields["baseline"]["validations"])
    for field in ("privileged", "hostPath", "capabilities.add", "hostProcess", "procMount", "seccompProfile",
                  "appArmorProfile", "seLinuxOptions", "sysctls", "serviceAccountName", "priorityClassName",
                  "podFieldsRefused", "containerFieldsRefused", "volumeTypesRefused", "tokensRefused",
                  "nvidiaEnvRefused", "runtimeClassRefused", "tolerationsRefused", "schedulerRefused",
                  "nodeSelectionRefused", "schedulingKeysRefused", "dataSourcesRefused", "securityAnnotationsRefused",
                  "probeHostsRefused", "object.spec.nodes <= 256"):
        assert field in text, field
    # spec.template can say all of it again, for any of its containers, and host namespaces and ports too.
    template = [v["message"] for v in fields["baseline"]["validations"] if v["message"].startswith("spec.template")]
    for field in ("hostNetwork", "hostPort", "hostPath", "privileged", "capabilities.add", "hostProcess", "procMount",
                  "seccompProfile", "appArmorProfile", "seLinuxOptions", "sysctls", "serviceAccountName",
                  "priorityClassName"):
        assert any(field in m for m in template), field


def test_tenant_policy_profiles_per_namespace_label(tmp_path):
    profiles = [{"name": "strict", "baseline": True,
                 "namespaceSelector": {"matchLabels": {"ddpjob.dev/tenant-profile": "strict"}}},
                {"name": "trusted", "baseline": False, "serviceAccounts": ["*"], "priorityClasses": ["high"],
                 "namespaceSelector": {"matchLabels": {"ddpjob.dev/tenant-profile": "trusted"}}}]
    docs = render(values={"tenantPolicy": {"profiles": profiles, "validationActions": ["Warn", "Audit"]}},
                  tmp_path=tmp_path)
    vaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    binds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert set(vaps) == set(binds) == {f"{RELEASE}-ddpjob-operator-{p}{s}" for p in ("strict", "trusted")
                                       for s in ("", "-refs")}
    fields, _ = policies(docs)
    trusted = json.dumps(fields["trusted"]["validations"])
    sa_check = "object.spec.serviceAccountName in variables.serviceAccounts"
    assert "privileged" not in trusted and sa_check not in trusted  # "*": any account
    assert "hostNetwork" not in trusted and "probeHostsRefused" not in trusted
    assert "priorityClassName" in trusted
    # The allow-list and the classes that are not Pod Security's hold in every profile.
    assert "podFieldsRefused" in trusted and "tokensRefused" in trusted and "schedulingKeysRefused" in trusted
    assert binds[f"{RELEASE}-ddpjob-operator-trusted"]["spec"]["validationActions"] == ["Warn", "Audit"]
    assert binds[f"{RELEASE}-ddpjob-operator-trusted-refs"]["spec"]["validationActions"] == ["Warn", "Audit"]


def test_tenant_policy_allow_lists_for_every_profile(tmp_path):
    """tenantPolicy.serviceAccounts / priorityClasses / runtimeClasses / schedulers / tolerations /
    nodeSelectorKeys (a cloud identity's account, a platform's node pool) join each profile's own
    lists; a profile that allows any ("*") still does, and loses that validation."""
    profiles = [{"name": "team", "serviceAccounts": ["trainer"], "tolerations": ["nvidia.com/gpu"],
                 "namespaceSelector": {"matchLabels": {"ddpjob.dev/tenant-profile": "team"}}},
                {"name": "trusted", "serviceAccounts": ["*"], "tolerations": ["*"], "schedulers": ["*"],
                 "nodeSelectorKeys": ["*"], "podFields": ["*"], "containerFields": ["*"], "volumeTypes": ["*"],
                 "namespaceSelector": {"matchLabels": {"ddpjob.dev/tenant-profile": "trusted"}}}]
    # --set as docs/install.md and docs/shared-cluster.md write it
    docs = render("tenantPolicy.serviceAccounts={s3-reader,trainer}", "tenantPolicy.priorityClasses={research-high}",
                  "tenantPolicy.runtimeClasses={nvidia-cdi}", "tenantPolicy.schedulers={volcano}",
                  "tenantPolicy.tolerations={dedicated:NoSchedule}", "tenantPolicy.nodeSelectorKeys={pool}",
                  values={"tenantPolicy": {"profiles": profiles}}, tmp_path=tmp_path)
    fields, _ = policies(docs)
    team = lists_of(fields["team"])
    assert {k: team[k] for k in ("serviceAccounts", "priorityClasses", "runtimeClasses", "schedulers", "tolerations",
                                 "nodeSelectorKeys")} == {
        "serviceAccounts": ["s3-reader", "trainer"], "priorityClasses": ["research-high"],
        "runtimeClasses": ["nvidia-cdi"], "schedulers": ["volcano"],
        "tolerations": ["dedicated:NoSchedule", "nvidia.com/gpu"], "nodeSelectorKeys": ["pool"]}
    trusted = json.dumps(fields["trusted"]["validations"])
    for gone in ("object.spec.serviceAccountName in variables.serviceAccounts", "tolerationsRefused", "schedulerRefused", "nodeSelectionRefused",
                 "podFieldsRefused", "containerFieldsRefused", "volumeTypesRefused"):
        assert gone not in trusted, gone
    # Tokens need a named account whatever the list says; a runtime class needs GPUs even with "*".
    assert "tokensRefused" in trusted and "runtimeClassRefused" in trusted
    assert "priorityClassName" in trusted


def test_tenant_policy_profile_openings(tmp_path):
    """A profile opens a class deliberately: nvidiaEnv names toolkit variables it allows, hostNetwork
    lets a baseline profile's template use the host's network, podFields add PodSpec fields,
    maxNodes bounds a job (unset: only the CRD's 10000)."""
    profiles = [{"name": "video", "baseline": True, "nvidiaEnv": ["NVIDIA_DRIVER_CAPABILITIES"], "hostNetwork": True,
                 "podFields": ["nodeName"], "namespaceSelector": {}}]
    fields, _ = policies(render(values={"tenantPolicy": {"profiles": profiles}}, tmp_path=tmp_path))
    spec = fields["video"]
    lists = lists_of(spec)
    assert "NVIDIA_DRIVER_CAPABILITIES" not in lists["nvidiaEnv"] and "NVIDIA_VISIBLE_DEVICES" in lists["nvidiaEnv"]
    assert "nodeName" in lists["podFields"]
    host = [v for v in spec["validations"] if "hostPID" in v["expression"]]
    assert len(host) == 1 and "hostNetwork" not in host[0]["expression"]
    assert "object.spec.nodes <=" not in json.dumps(spec["validations"])


def test_tenant_policy_rdma_resources_per_profile_and_for_all(tmp_path):
    """spec.rdma (devices + IPC_LOCK) is refused by baseline profiles unless its resource is in
    tenantPolicy.rdmaResources or the profile's own; "*" or baseline: false allow any. (On the API
    server: tests/cluster/test_tenant_policy.py.)"""
    def rdma_check(spec):
        return [v for v in spec["validations"] if "object.spec.rdma" in v["expression"]]

    default = policies(render())[0]["baseline"]
    (check,) = rdma_check(default)
    assert "tenantPolicy.rdmaResources" in check["message"] and "tenantPolicy.rdmaResources" in check["messageExpression"]
    assert lists_of(default)["rdmaResources"] == []
    profiles = [{"name": "team", "baseline": True, "rdmaResources": ["rdma/hca_shared_devices_a"],
                 "namespaceSelector": {"matchLabels": {"ddpjob.dev/tenant-profile": "team"}}},
                {"name": "any", "baseline": True, "rdmaResources": ["*"],
                 "namespaceSelector": {"matchLabels": {"ddpjob.dev/tenant-profile": "any"}}},
                {"name": "trusted", "baseline": False,
                 "namespaceSelector": {"matchLabels": {"ddpjob.dev/tenant-profile": "trusted"}}}]
    vaps, _ = policies(render("tenantPolicy.rdmaResources={rdma/ib}", values={"tenantPolicy": {"profiles": profiles}},
                              tmp_path=tmp_path))
    assert lists_of(vaps["team"])["rdmaResources"] == ["rdma/ib", "rdma/hca_shared_devices_a"]
    assert rdma_check(vaps["team"]) and not rdma_check(vaps["any"]) and not rdma_check(vaps["trusted"])


def test_tenant_policy_checks_objects_in_every_profile_within_the_cel_budget(tmp_path):
    """The objects check is about the user, not the namespace: a profile without baseline has it too,
    in a policy of its own (each policy has its own CEL budget). An authorization check costs 350000
    of the API server's 1000000 per expression and 10000000 per policy and request, so no expression
    makes more than one, and one request at most 6 (one per kind: may the user get them all?) + 20."""
    profiles = [{"name": "open", "baseline": False, "serviceAccounts": ["*"], "priorityClasses": ["*"],
                 "namespaceSelector": {}}]
    fields, refs = policies(render(values={"tenantPolicy": {"profiles": profiles}}, tmp_path=tmp_path))
    spec = refs["open"]
    assert ".check(" not in json.dumps(fields["open"])
    kinds_checked = {v["name"] for v in spec["variables"] if ".check(" in v["expression"]}
    assert kinds_checked == {f"readsAll{k}" for k in ("Secret", "ConfigMap", "PersistentVolumeClaim", "VolumeSnapshot",
                                                      "ResourceClaim", "ResourceClaimTemplate")}
    # A validation per object that a request may add, per kind (a message expression may read no
    # variable that asks the authorizer: each names its object from that kind's plain list) ...
    per_object = [v for v in spec["validations"] if ".check(" in v["expression"]]
    assert len(per_object) == 20 + 10 + 10 + 4 + 4 + 4
    assert all("variables.toCheck" in v["messageExpression"] and "unread" not in v["messageExpression"]
               for v in per_object)
    exprs = [v["expression"] for v in spec["variables"] + spec["validations"]]
    assert all(e.count(".check(") <= 1 for e in exprs)
    # ... but each asks only within the budget: 20 objects whose kind the user may not read whole.
    budget = next(v["expression"] for v in spec["variables"] if v["name"] == "withinBudget")
    assert "size(variables.unread) <= 20" in budget and all("!variables.withinBudget" in v["expression"] for v in per_object)
    assert len(kinds_checked) + 20 <= 10_000_000 // 350_000


def test_tenant_quota_is_off_by_default_and_one_per_tenant_namespace():
    assert "ResourceQuota" not in kinds(render())
    docs = render("tenantQuota.enabled=true", "operator.watchNamespaces={team-a,team-b}")
    quotas = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "ResourceQuota"}
    assert set(quotas) == {"team-a", "team-b"}
    assert quotas["team-a"]["spec"]["hard"] == {"count/pods": "256", "requests.nvidia.com/gpu": "64"}
    docs = render("tenantQuota.enabled=true", "tenantQuota.namespaces={ml}", "tenantQuota.hard.count/pods=32")
    (quota,) = [d for d in docs if d["kind"] == "ResourceQuota"]
    assert quota["metadata"]["namespace"] == "ml" and quota["spec"]["hard"]["count/pods"] == "32"
    assert "tenantQuota.namespaces" in render_error("tenantQuota.enabled=true")


def test_tenant_policy_can_be_switched_off():
    assert "ValidatingAdmissionPolicy" not in kinds(render("tenantPolicy.enabled=false"))


def test_the_charts_operator_defaults_are_the_operators_own():
    """The chart passes every one of these as a flag, so a default changed in OperatorConfig only
    (the CLI's defaults come from it) would silently not reach Helm installs."""
    import dataclasses

    from ddpjob_operator.base.config import OperatorConfig

    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]
    defaults = {f.name: f.default for f in dataclasses.fields(OperatorConfig)}
    snake = {key: re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower() for key in values}
    shared = {key: name for key, name in snake.items() if name in defaults}
    assert len(shared) >= 7, shared
    assert {key: values[key] for key in shared} == {key: defaults[name] for key, name in shared.items()}
