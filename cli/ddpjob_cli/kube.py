"""The cluster commands' only Kubernetes I/O: a kubeconfig resolved like kubectl's, and a few
JSON requests to the API server (never to a pod: logs come through the API server too).

Objects come back as plain dicts (camelCase, as the API serves them) for `views.py`. Every API or
configuration failure is raised as `CliError`, one line saying what to do, which the commands
print without a traceback.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from kubernetes import client, config as kconfig
from urllib3.exceptions import HTTPError

from ddpjob_api import labels
from ddpjob_api.spec import API_VERSION
from ddpjob_operator.cluster.k8s import child_path, job_path
from ddpjob_operator.base.podinfo import is_simulated_node
from ddpjob_operator.cluster.scrape import MAX_BODY_BYTES

from .views import api_error, missing_object

USER_AGENT = "ddpjob-cli"
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class CliError(Exception):
    """A failure the command reports as one line (exit code `code`)."""

    def __init__(self, message: str, code: int = 1, *, missing: bool = False):
        super().__init__(message)
        self.code = code
        self.missing = missing   # the API said 404 for the object itself (the resource exists)


def _kubeconfig_paths(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    env = os.environ.get("KUBECONFIG")
    paths = env.split(os.pathsep) if env else [os.path.expanduser("~/.kube/config")]
    return [p for p in paths if p]


class Kube:
    """An API client for the kubeconfig (`--kubeconfig`, else $KUBECONFIG, else ~/.kube/config;
    in a pod without one, the pod's service account) and `--context`; `namespace` is `-n`, else
    the context's namespace, else "default"."""

    def __init__(self, *, kubeconfig: str | None = None, context: str | None = None,
                 namespace: str | None = None, request_timeout: float = 30):
        cfg = client.Configuration()
        paths = _kubeconfig_paths(kubeconfig)
        existing = [p for p in paths if Path(p).exists()]
        ctx_ns = None
        if existing:
            files = os.pathsep.join(existing)   # the client merges several, as kubectl does
            try:
                kconfig.load_kube_config(config_file=files, context=context, client_configuration=cfg)
                contexts, active = kconfig.list_kube_config_contexts(config_file=files)
            except (kconfig.ConfigException, ValueError, OSError, TypeError) as exc:
                raise CliError(f"cannot use kubeconfig {', '.join(existing)}: {' '.join(str(exc).split())} "
                               "(check --context and the file, e.g. kubectl config get-contexts)") from None
            chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
            ctx_ns = ((chosen or {}).get("context") or {}).get("namespace")
            self.where = f"context {(chosen or {}).get('name')}"
        elif os.environ.get("KUBERNETES_SERVICE_HOST") and not kubeconfig:
            try:
                kconfig.load_incluster_config(client_configuration=cfg)
            except kconfig.ConfigException as exc:
                raise CliError(f"no kubeconfig, and this pod's service account is unusable ({exc}): "
                               "pass --kubeconfig FILE") from None
            ctx_ns = _SA_NAMESPACE.read_text().strip() if _SA_NAMESPACE.exists() else None
            self.where = "in-cluster service account"
        else:
            raise CliError(f"no kubeconfig: {' or '.join(paths)} does not exist; set KUBECONFIG or pass "
                           "--kubeconfig FILE (and --context NAME)")
        self.server = cfg.host
        self.namespace = namespace or ctx_ns or "default"
        self.namespace_given = namespace is not None
        self.api = client.ApiClient(cfg)
        self.api.user_agent = USER_AGENT
        self.timeout = request_timeout
        self._simulated: dict[str, bool] = {}

    # --- raw requests -----------------------------------------------------------------------------

    def _call(self, method: str, path: str, *, query: list | None = None, body: Any = None,
              content_type: str = "application/json", stream: bool = False, forever: bool = False,
              name: str | None = None, namespace: str | None = None, verb: str = "get") -> Any:
        headers = {"Accept": "application/json, */*", "Content-Type": content_type}
        params = self.api.param_serialize(method=method, resource_path=path, query_params=query or [],
                                          header_params=headers, body=body, auth_settings=["BearerToken"])
        try:
            # A followed log has no read timeout: a quiet rank is not a dead connection.
            resp = self.api.call_api(*params, _request_timeout=(10, None if forever else self.timeout))
        except (HTTPError, OSError) as exc:
            raise CliError(f"cannot reach the API server at {self.server} ({self.where}): "
                           f"{' '.join(str(exc).split())[:200]}") from None
        if not 200 <= resp.status <= 299:
            resp.read()
            raise CliError(api_error(resp.status, resp.data, name=name, namespace=namespace, verb=verb),
                           missing=missing_object(resp.status, resp.data))
        if stream:
            return resp.response
        try:
            resp.read()
        except (HTTPError, OSError) as exc:
            raise CliError(f"lost the API server at {self.server}: {exc}") from None
        return json.loads(resp.data) if resp.data else None

    # --- DDPJobs ----------------------------------------------------------------------------------

    def list_jobs(self, *, all_namespaces: bool = False) -> list[dict[str, Any]]:
        ns = None if all_namespaces else self.namespace
        data = self._call("GET", job_path(ns), namespace=ns, verb="list") or {}
        items = list(data.get("items") or [])
        for item in items:  # a list's items carry no apiVersion/kind
            item.setdefault("apiVersion", API_VERSION)
            item.setdefault("kind", "DDPJob")
        return items

    def get_job(self, name: str) -> dict[str, Any]:
        return self._call("GET", job_path(self.namespace, name), name=name, namespace=self.namespace)

    def find_job(self, name: str) -> dict[str, Any] | None:
        """The job, or None when it does not exist (any other failure raises)."""
        try:
            return self.get_job(name)
        except CliError as exc:
            if exc.missing:
                return None
            raise

    def create_job(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = (obj.get("metadata") or {}).get("name")
        return self._call("POST", job_path(self.namespace), body=obj, name=name,
                          namespace=self.namespace, verb="create")

    def delete_job(self, name: str) -> None:
        self._call("DELETE", job_path(self.namespace, name), query=[("propagationPolicy", "Background")],
                   name=name, namespace=self.namespace, verb="delete")

    def patch_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", job_path(self.namespace, name), body={"spec": spec},
                          content_type="application/merge-patch+json", name=name, namespace=self.namespace,
                          verb="patch")

    # --- pods, events, logs -------------------------------------------------------------------------

    def pods(self, job: str) -> list[dict[str, Any]]:
        data = self._call("GET", child_path("v1", "Pod", self.namespace),
                          query=[("labelSelector", labels.training_selector(job))], namespace=self.namespace,
                          verb="list") or {}
        return list(data.get("items") or [])

    def events(self) -> list[dict[str, Any]]:
        """The namespace's events (describe picks the job's and its pods'); [] when not allowed to read them."""
        try:
            data = self._call("GET", f"/api/v1/namespaces/{self.namespace}/events", namespace=self.namespace,
                              verb="list") or {}
        except CliError:
            return []
        return list(data.get("items") or [])

    def log_lines(self, pod: str, *, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """The trainer container's log lines, through the API server (follow: until the container ends)."""
        query = [("container", labels.CONTAINER)] + ([("follow", "true")] if follow else []) \
            + ([("tailLines", str(tail))] if tail is not None else [])
        raw = self._call("GET", f"{child_path('v1', 'Pod', self.namespace, pod)}/log", query=query, stream=True,
                         forever=follow, name=pod, namespace=self.namespace)
        buf = b""
        try:
            for chunk in raw.stream(4096, decode_content=True):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
            if buf:
                yield buf.decode(errors="replace")
        except (HTTPError, OSError) as exc:
            raise CliError(f"the log stream of pod {pod} broke: {exc}") from None
        finally:
            raw.release_conn()

    def configmap(self, name: str) -> dict[str, Any]:
        """A ConfigMap of the namespace (CliError, missing=True, when there is none)."""
        return self._call("GET", f"/api/v1/namespaces/{self.namespace}/configmaps/{name}", name=name,
                          namespace=self.namespace) or {}

    def exec_output(self, pod: str, command: list[str], *, timeout: float = 30) -> str:
        """What `command` prints (stdout and stderr) run in the pod's trainer container (pods/exec)."""
        from kubernetes.client import CoreV1Api
        from kubernetes.client.rest import ApiException
        from kubernetes.stream import stream

        try:
            return str(stream(CoreV1Api(self.api).connect_get_namespaced_pod_exec, pod, self.namespace,
                              container=labels.CONTAINER, command=command, stdout=True, stderr=True, stdin=False,
                              tty=False, _request_timeout=timeout))
        except ApiException as exc:
            raise CliError(api_error(exc.status, exc.body, name=pod, namespace=self.namespace, verb="exec into"),
                           missing=missing_object(exc.status, exc.body)) from None
        except (HTTPError, OSError, ValueError) as exc:
            raise CliError(f"exec into pod {pod}: {' '.join(str(exc).split())[:200]}") from None

    def simulated_node(self, node: str) -> bool:
        """True for a node kwok simulates (its pods' addresses are fictitious: nothing to proxy to);
        False when it is not, or the node may not be read (most users may not)."""
        if node not in self._simulated:
            try:
                obj = self._call("GET", f"/api/v1/nodes/{node}", name=node) or {}
            except CliError:
                obj = {}
            self._simulated[node] = is_simulated_node(obj)
        return self._simulated[node]

    def pod_metrics(self, pod: str, port: int, *, max_bytes: int = MAX_BODY_BYTES) -> str:
        """A pod's metrics text through the API server's pod proxy (pods/proxy; the CLI itself
        never connects to a pod)."""
        raw = self._call("GET", f"{child_path('v1', 'Pod', self.namespace, pod)}:{port}/proxy/metrics", stream=True,
                         name=pod, namespace=self.namespace)
        buf = bytearray()
        try:
            for chunk in raw.stream(65536, decode_content=True):
                buf += chunk
                if len(buf) > max_bytes:
                    raise CliError(f"pod {pod}'s metrics are over {max_bytes} bytes")
        except (HTTPError, OSError) as exc:
            raise CliError(f"reading pod {pod}'s metrics: {exc}") from None
        finally:
            raw.release_conn()
        return buf.decode(errors="replace")

    def close(self) -> None:
        self.api.close()
