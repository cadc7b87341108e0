"""The chart's tenant policy on a real API server, as a tenant meets it: a fresh namespace bound to
one profile rendered by helm from the chart's own values.yaml (plus a test's values on top), users
whose only rights are those a test grants (RBAC), and requests sent as those users (impersonated),
dry-run or real.

The policy is tested against whichever control plane `policy_cluster` returns: the shared local one,
or with DDPJOB_CLUSTER=oldest the second one at the oldest Kubernetes the chart allows (make
test-oldest: the CEL must work on every Kubernetes the chart supports); nothing here needs that
cluster's nodes or add-ons.
"""
from __future__ import annotations

import contextlib
import copy
import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from tests.support.cluster import (OPERATOR_IMAGE_VALUES, REPO_ROOT, Cluster, create_namespace, delete_namespace,
                                   ensure_cluster, wait_for)

CHART = REPO_ROOT / "charts" / "ddpjob-operator"
# The chart renders the same policy for every Kubernetes version; this one satisfies its kubeVersion.
RENDER_VERSION = re.search(r"^KUBE_VERSION=(\S+)", (REPO_ROOT / "hack" / "versions.env").read_text(), re.M).group(1)
GROUP, VERSION, PLURAL = "ddpjob.dev", "v1alpha1", "ddpjobs"
# A Secret no test user may get: a job naming it shows that the profile's refs policy is in force.
PROBE_SECRET = "tenant-policy-probe"


def policy_cluster() -> Cluster:
    """The shared local cluster, DDPJOB_CLUSTER's (started if need be, as the session's `cluster`
    fixture does). A test module overrides its `cluster` fixture with this."""
    return ensure_cluster()


def job(name: str = "job", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DDPJob", "metadata": {"name": name},
            "spec": {"image": "reg/trainer:1", "nodes": 1, **spec}}


def role(ns: str, name: str, *rules: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": name, "namespace": ns}, "rules": list(rules)}


def binding(ns: str, name: str, role_name: str, user: str) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}


DDPJOBS_ONLY = {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["create", "get", "list", "patch", "delete"]}


def grant(cluster: Cluster, ns: str, user: str, *rules: dict[str, Any], can: tuple[str, str]) -> None:
    """A Role of its own with `rules`, bound to `user` in `ns`; returns once `kubectl auth can-i
    VERB TARGET` (`can`) says yes for them."""
    name = f"{user}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role(ns, name, *rules), binding(ns, name, name, user)]))
    wait_for(lambda: cluster.kubectl("auth", "can-i", *can, "-n", ns, "--as", user, check=False).stdout.strip() == "yes",
             timeout=30, desc=f"{user}'s RBAC ({' '.join(can)})")


def render_policy(cluster: Cluster, tag: str, profile: dict[str, Any], global_values: dict[str, Any],
                  tmp: Path) -> str:
    """The chart's tenant-policy.yaml for one profile, rendered by helm (`tag` names the release)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())["tenantPolicy"]
    vfile = tmp / f"values-{tag}.yaml"
    vfile.write_text(yaml.safe_dump({"tenantPolicy": {**values, **global_values, "profiles": [profile]}}))
    return cluster.helm("template", f"tp-{tag}", str(CHART), "--kube-version", RENDER_VERSION, "-f", str(vfile),
                        *[a for s in OPERATOR_IMAGE_VALUES for a in ("--set", s)],
                        "--show-only", "templates/tenant-policy.yaml").stdout


@contextlib.contextmanager
def bound_profile(cluster: Cluster, tmp: Path, user: str, global_values: dict[str, Any],
                  **profile_values: Any) -> Iterator[str]:
    """A fresh namespace under the chart's default profile (values.yaml's first profile, with these
    global tenantPolicy values and profile keys on top), where `user` may only use DDPJobs; yields
    the namespace once both of the profile's policies are in force there."""
    tag = uuid.uuid4().hex[:8]
    api = cluster.api()
    # A profile label of its own: the chart's default profile (a release that e2e tests may have
    # installed meanwhile) skips labelled namespaces, as docs/install.md tells admins to do.
    ns = create_namespace(api, prefix="tenant-", labels={"ddpjob.dev/tenant-profile": f"test-{tag}"})
    values = yaml.safe_load((CHART / "values.yaml").read_text())["tenantPolicy"]
    profile = copy.deepcopy(values["profiles"][0])
    profile["namespaceSelector"] = {"matchLabels": {"ddpjob.dev/tenant-profile": f"test-{tag}"}}
    profile.update(profile_values)
    policy = render_policy(cluster, tag, profile, global_values, tmp)
    cluster.kubectl("apply", "-f", "-", input=policy)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role(ns, "ddpjobs-only", DDPJOBS_ONLY),
                                                                  binding(ns, "ddpjobs-only", "ddpjobs-only", user)]))
    requests = Requests(cluster, ns)
    try:
        # The policies reach the API server's admission through an informer: wait until both bite.
        for spec, says in (({"securityContext": {"privileged": True}}, "privileged"),
                           ({"envFrom": [{"secretRef": {"name": PROBE_SECRET}}]}, f"Secret {PROBE_SECRET} is forbidden")):
            wait_for(lambda spec=spec, says=says: says in requests.create(user, job("probe", **spec)).message,
                     timeout=30, desc=f"tenant policy in force ({says})")
        yield ns
    finally:
        requests.close()
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=policy, check=False)
        delete_namespace(api, ns)
        api.close()


@dataclass(frozen=True)
class Answer:
    """The API server's answer to one request: HTTP status and, for a refusal, its message."""

    status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return 200 <= self.status <= 299

    @property
    def message(self) -> str:
        return "" if self.ok else str(self.body.get("message") or self.body)


class Requests:
    """DDPJob requests to one namespace as a given user (Impersonate-User, which a kubeconfig of
    system:masters may do: what `kubectl --as USER` sends), with strict field validation as kubectl's;
    `dry_run` is `--dry-run=server`: admitted or refused, nothing stored."""

    def __init__(self, cluster: Cluster, namespace: str):
        self.api = cluster.api()
        self.namespace = namespace

    def close(self) -> None:
        self.api.close()

    def _send(self, user: str, method: str, path: str, body: Any, *, dry_run: bool,
              content_type: str = "application/json") -> Answer:
        query = [("fieldValidation", "Strict")] + ([("dryRun", "All")] if dry_run else [])
        headers = {"Accept": "application/json", "Content-Type": content_type, "Impersonate-User": user}
        params = self.api.param_serialize(method=method, resource_path=path, query_params=query,
                                          header_params=headers, body=body, auth_settings=["BearerToken"])
        resp = self.api.call_api(*params, _request_timeout=(10, 60))
        resp.read()
        return Answer(resp.status, json.loads(resp.data) if resp.data else {})

    def _path(self, name: str = "") -> str:
        base = f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}"
        return f"{base}/{name}" if name else base

    def create(self, user: str, obj: dict[str, Any], *, dry_run: bool = True) -> Answer:
        return self._send(user, "POST", self._path(), obj, dry_run=dry_run)

    def patch(self, user: str, name: str, patch: dict[str, Any], *, dry_run: bool = True) -> Answer:
        """A JSON merge patch (kubectl patch --type merge)."""
        return self._send(user, "PATCH", self._path(name), patch, dry_run=dry_run,
                          content_type="application/merge-patch+json")
