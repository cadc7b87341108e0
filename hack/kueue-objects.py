#!/usr/bin/env python3
"""Kueue's own webhook configurations and RBAC, rewritten for the local control plane.

Reads, on stdin, the objects in Kueue's config/components/webhook/manifests.yaml and
config/components/rbac/{role,metrics_auth_role,manager_secrets_role}.yaml as `kubectl create --dry-run=client -o json`
prints them (one JSON document per file, a List where a file holds several) and writes a JSON List to apply. Stdlib only: cluster-up runs it with the system python3.

- Webhooks call Kueue at a URL on 127.0.0.1 (no Service: the API server and Kueue share the
  loopback), trusting the cluster CA that signed Kueue's serving certificate.
- Only Kueue's own kinds and pods are kept: this cluster enables no other integration, and a
  webhook for a kind Kueue does not serve would refuse every such object.
- The pod webhooks match only namespaces labelled NS_LABEL=true, the same selector that
  Kueue's managedJobsNamespaceSelector uses, so the API server never calls Kueue for
  another test's pods, and a stopped Kueue cannot refuse them.
- The (Cluster)Roles are prefixed kueue- (Kueue's are called manager-role, metrics-auth-role ...) and
  bound to the user that Kueue's client certificate names; kustomize's namespace "system" is
  Kueue's own namespace, kueue-system here.

Usage: kueue-objects.py URL_BASE CA_FILE USER NS_LABEL < list.json > objects.json
"""
from __future__ import annotations

import base64
import json
import sys

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_NAMESPACE = "kueue-system"


def keep(hook: dict) -> bool:
    groups = {g for rule in hook.get("rules", []) for g in rule.get("apiGroups", [])}
    resources = {r for rule in hook.get("rules", []) for r in rule.get("resources", [])}
    return groups == {KUEUE_GROUP} or (groups == {""} and resources == {"pods"})


def read_objects(text: str) -> list[dict]:
    decoder, objs, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return objs
        doc, pos = decoder.raw_decode(text, pos)
        objs.extend(doc["items"] if doc.get("kind") == "List" else [doc])


def main(url_base: str, ca_file: str, user: str, ns_label: str) -> None:
    with open(ca_file, "rb") as f:
        ca_bundle = base64.b64encode(f.read()).decode()
    out = []
    for obj in read_objects(sys.stdin.read()):
        kind = obj["kind"]
        if kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            obj["metadata"] = {"name": "kueue-" + obj["metadata"]["name"]}
            hooks = []
            for hook in obj["webhooks"]:
                if not keep(hook):
                    continue
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": url_base + path, "caBundle": ca_bundle}
                hook["timeoutSeconds"] = 10
                if hook["rules"][0]["apiGroups"] == [""]:
                    hook["namespaceSelector"] = {"matchLabels": {ns_label: "true"}}
                hooks.append(hook)
            obj["webhooks"] = hooks
            out.append(obj)
        elif kind in ("ClusterRole", "Role"):
            role = "kueue-" + obj["metadata"]["name"]
            obj["metadata"] = {"name": role}
            if kind == "Role":
                obj["metadata"]["namespace"] = KUEUE_NAMESPACE
            out.append(obj)
            out.append({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": kind + "Binding",
                "metadata": dict(obj["metadata"]),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            })
        else:
            sys.exit(f"kueue-objects.py: unexpected {kind} {obj['metadata'].get('name')}")
    json.dump({"apiVersion": "v1", "kind": "List", "items": out}, sys.stdout)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
