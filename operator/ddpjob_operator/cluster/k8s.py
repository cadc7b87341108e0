"""The operator's only Kubernetes I/O: thin async wrappers over the official client.

Objects go in and come out as plain dicts (camelCase, as the API serves them), so the pure
builders and the status function never see client model classes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Hashable

from kubernetes import client, config as kconfig
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from ddpjob_api import labels
from ddpjob_api.spec import KIND, PLURAL, API_VERSION
from ddpjob_operator.base import objmeta
from ddpjob_operator.cluster.fairqueue import FairSlots

log = logging.getLogger("ddpjob.k8s")
COMPONENT = "ddpjob-operator"
# Requests the facade runs at once, all jobs together (its threads and fair slots): a creation
# pass never has more pods in flight than this (app/children's slow start stops doubling here).
# On the local control plane (loopback, 2 CPUs) 64 made 1x64 and 10x8 no faster than 16 and cost
# about 2 MiB (bench/results/operator_scale_inflight_64_vs_16_loaded.json): round trips on loopback
# are short. 64 stays for API servers a real network away, where the round trips bound a creation
# (not measurable here).
IN_FLIGHT = 64
# Objects per page of a list (client-go's informers ask for 500): a relist of tens of thousands of
# pods is read, decoded and cut down page by page, never as one response.
LIST_PAGE = 500


def load_api_client(*, pool: int = 32) -> client.ApiClient:
    """In-cluster config when running in a pod, else the current kubeconfig."""
    cfg = client.Configuration()
    try:
        kconfig.load_incluster_config(client_configuration=cfg)
    except kconfig.ConfigException:
        kconfig.load_kube_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    api = client.ApiClient(cfg)
    # Our name in the API server's audit log and metrics (kopf's own requests say kopf/<version>).
    api.user_agent = COMPONENT
    return api


_SUBRESOURCES = {"status", "scale", "binding", "eviction", "log"}


def request_kind(method: str, path: str, *, watch: bool = False) -> tuple[str, str]:
    """(verb, resource) of a request, as the API server's metrics name them:
    GET /api/v1/namespaces/ns/pods -> (LIST, pods); PATCH .../ddpjobs/x/status -> (PATCH, ddpjobs/status)."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    parts = parts[2:] if parts[:1] == ["api"] else parts[3:]   # drop api/v1 or apis/group/version
    if parts[:1] == ["namespaces"] and len(parts) > 2:
        parts = parts[2:]
    resource, rest = (parts[0], parts[1:]) if parts else ("", [])
    if len(rest) > 1 and rest[1] in _SUBRESOURCES:
        resource = f"{resource}/{rest[1]}"
    if watch:
        return "WATCH", resource
    if method == "GET" and not rest:
        return "LIST", resource
    return method, resource


# The kinds of the operator's children and of the DDPJobs themselves, and their resource names.
_PLURALS = {"Pod": "pods", "Service": "services", "PodGroup": "podgroups", "ConfigMap": "configmaps", KIND: PLURAL}


def child_path(api_version: str, kind: str, namespace: str | None, name: str = "") -> str:
    """/api/v1/namespaces/ns/pods[/name], /apis/group/version/namespaces/ns/podgroups[/name];
    namespace None: the collection across all namespaces (/apis/group/version/ddpjobs)."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{root}/namespaces/{namespace}/{_PLURALS[kind]}" if namespace else f"{root}/{_PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def job_path(namespace: str | None, name: str = "") -> str:
    """A DDPJob's path, or its collection's (namespace None: every namespace's)."""
    return child_path(API_VERSION, KIND, namespace, name)


class K8s:
    """Async facade: raw JSON requests through the client's auth and connection pool,
    each run in a bounded thread pool (no model classes, so pass-through fields survive).
    Requests are shared out fairly between namespaces, then between each namespace's jobs
    (`fairqueue`): a job creating thousands of pods does not hold up another job's restart behind
    its backlog, nor a tenant with many jobs another tenant's."""

    def __init__(self, api: client.ApiClient | None = None, *, workers: int = IN_FLIGHT,
                 on_request: Callable[[str, str], None] | None = None):
        self.api = api or load_api_client(pool=workers * 2)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k8s")
        # As many slots as threads: a request that holds a slot runs at once, so the wait (and
        # its order) is decided here, per job, not in the pool's first-come queue.
        self._slots = FairSlots(workers)
        self._instance = os.environ.get("POD_NAME") or os.uname().nodename
        self.on_request = on_request  # (verb, resource): counts what we ask of the API server
        self._server_version = ""

    def _count(self, method: str, path: str, *, watch: bool = False) -> None:
        if self.on_request is not None:
            self.on_request(*request_kind(method, path, watch=watch))

    def _request(self, method: str, path: str, *, body: Any = None, query: list | None = None,
                 content_type: str = "application/json") -> Any:
        self._count(method, path)
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = self.api.param_serialize(method=method, resource_path=path, query_params=query or [],
                                          header_params=headers, body=body, auth_settings=["BearerToken"])
        resp = self.api.call_api(*params, _request_timeout=(10, 60))
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException(http_resp=resp)
        return json.loads(resp.data) if resp.data else None

    def list_objects(self, path: str, query: list | None = None, *, transform: Callable[[Any], Any] | None = None,
                     page: int = LIST_PAGE) -> tuple[list[dict[str, Any]], str]:
        """(items, the list's resourceVersion): blocking, for an informer's thread. Read `page`
        items at a time (one consistent snapshot: the API server's continue token), each page's
        items passed through `transform` before the next page is read."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            q = list(query or []) + [("limit", str(page))] + ([("continue", token)] if token else [])
            data = self._request("GET", path, query=q) or {}
            items += [transform(o) for o in data.get("items") or []] if transform else list(data.get("items") or [])
            meta = data.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def watch(self, path: str, query: list | None, *, resource_version: str,
              timeout: int = 270) -> Iterator[dict[str, Any]]:
        """Watch events (dicts with type/object) from `resource_version` until the server ends the
        stream after `timeout` s: blocking, for an informer's thread. Bookmarks keep the version fresh."""
        q = list(query or []) + [("watch", "true"), ("allowWatchBookmarks", "true"),
                                 ("resourceVersion", resource_version), ("timeoutSeconds", str(timeout))]
        self._count("GET", path, watch=True)
        headers = {"Accept": "application/json"}
        params = self.api.param_serialize(method="GET", resource_path=path, query_params=q,
                                          header_params=headers, auth_settings=["BearerToken"])
        # The read timeout outlives the server's own, so a silently dead connection still ends.
        resp = self.api.call_api(*params, _request_timeout=(10, timeout + 30))
        raw = resp.response
        try:
            if not 200 <= resp.status <= 299:
                resp.read()
                raise ApiException(http_resp=resp)
            for line in iter_resp_lines(raw):   # the client library's own line splitter of a watch stream
                if line.strip():
                    yield json.loads(line)
        finally:
            raw.release_conn()

    async def _call(self, method: str, path: str, *, job: Hashable, **kwargs: Any) -> Any:
        """One request, made when `job` (namespace, name) gets its turn."""
        loop = asyncio.get_running_loop()
        async with self._slots.slot(job):
            return await loop.run_in_executor(self._pool, partial(self._request, method, path, **kwargs))

    async def _get(self, path: str, *, job: Hashable) -> dict[str, Any] | None:
        """A consistent read of one object, None when it is gone (404)."""
        try:
            return await self._call("GET", path, job=job)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def close(self) -> None:
        """Stop the thread pool (pending calls finish)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DDPJob (a consistent read), or None when it is gone."""
        return await self._get(job_path(namespace, name), job=(namespace, name))

    async def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create a child (Pod, Service, PodGroup): the created object, or None when it already
        exists (409), so retries are harmless. Strict field validation: a field this API server
        does not know (a DDPJob's field newer than the cluster) is refused naming it, where the
        default would drop it silently and run a pod without it."""
        meta = obj["metadata"]
        ns = meta["namespace"]
        job = (ns, (meta.get("labels") or {}).get(labels.JOB_NAME) or meta["name"])
        try:
            return await self._call("POST", child_path(obj["apiVersion"], obj["kind"], ns), body=obj, job=job,
                                    query=[("fieldValidation", "Strict")]) or {}
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    async def get_child(self, kind: str, namespace: str, name: str, *, job: str,
                        api_version: str = "v1") -> dict[str, Any] | None:
        """A child of `job` (a consistent read), or None when it is gone."""
        return await self._get(child_path(api_version, kind, namespace, name), job=(namespace, job))

    async def patch_child(self, kind: str, namespace: str, name: str, patch: dict[str, Any], *, job: str,
                          resource_version: str, api_version: str = "v1") -> dict[str, Any]:
        """Merge-patch a child of `job`, refused (409) when it changed since `resource_version` was read."""
        body = {**patch, "metadata": {**(patch.get("metadata") or {}), "resourceVersion": resource_version}}
        return await self._call("PATCH", child_path(api_version, kind, namespace, name), job=(namespace, job),
                                body=body, content_type="application/merge-patch+json")

    async def server_version(self) -> str:
        """The API server's Kubernetes version (gitVersion, e.g. v1.32.9), read once."""
        if not self._server_version:
            info = await self._call("GET", "/version", job=("", "version")) or {}
            self._server_version = str(info.get("gitVersion") or "")
        return self._server_version

    async def get_node(self, name: str) -> dict[str, Any] | None:
        """A Node (the monitor reads its annotations), or None when it is gone."""
        return await self._get(f"/api/v1/nodes/{name}", job=("", "nodes"))

    async def delete_pod(self, namespace: str, name: str, *, job: str, uid: str | None = None) -> bool:
        """Delete a pod of `job` (by uid precondition when given); False when already gone."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self._call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body=body,
                             job=(namespace, job))
            return True
        except ApiException as exc:
            if exc.status in (404, 409):  # gone, or a newer pod took the name
                return False
            raise

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any], *,
                           resource_version: str | None = None) -> dict[str, Any]:
        """Merge-patch the status subresource; returns the updated object. With `resource_version`
        the API server refuses (409) a write based on a stale read, as an Update would."""
        body: dict[str, Any] = {"status": patch}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._call("PATCH", job_path(namespace, name) + "/status", job=(namespace, name),
                                body=body, content_type="application/merge-patch+json")

    async def delete_job(self, namespace: str, name: str) -> bool:
        """Delete the DDPJob; garbage collection removes its Service and pods."""
        try:
            await self._call("DELETE", job_path(namespace, name), job=(namespace, name),
                             body={"apiVersion": "v1", "kind": "DeleteOptions",
                                   "propagationPolicy": "Background"})
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def post_event(self, job: dict[str, Any], type: str, reason: str, message: str) -> None:
        """A core/v1 Event on the DDPJob (best effort: a lost event never fails a pass)."""
        meta = job.get("metadata") or {}
        now = objmeta.now()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta.get('name')}.{uuid.uuid4().hex[:12]}",
                         "namespace": meta.get("namespace")},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta.get("name"),
                               "namespace": meta.get("namespace"), "uid": meta.get("uid")},
            "type": type, "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT, "reportingInstance": self._instance,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            await self._call("POST", f"/api/v1/namespaces/{meta.get('namespace')}/events", body=body,
                             job=(meta.get("namespace"), meta.get("name")))
        except ApiException as exc:
            log.warning("could not post event %s on %s: %s", reason, meta.get("name"), exc.reason)
