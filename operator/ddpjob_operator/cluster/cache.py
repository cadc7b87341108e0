"""What the operator knows about the cluster, kept current by watches instead of polling.

`Store` holds objects by (namespace, name), newest resourceVersion wins, so an object the
operator itself just wrote (a created pod, a status write) is visible to the next pass before
its watch event arrives, and a late event never rolls it back. `Informer` feeds a Store from a
server-side label- or field-selected list+watch in a thread (the API server filters, Python
never decodes other objects); after a relist, objects that vanished meanwhile are reported as
deleted, so no ghost survives a dropped watch. `PeerGate` answers "does a live peer with a
higher priority exist" from kopf's peering object, kept by an informer: no request per pass.
"""
from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import logging
import sys
import threading
import zlib
from typing import Any, Callable

from kubernetes.client.rest import ApiException

from ddpjob_api import labels, spec
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.objmeta import parse_time, resource_version, shared

log = logging.getLogger("ddpjob.cache")
Key = tuple[str, str]
Obj = dict[str, Any]
# (event type ADDED|MODIFIED|DELETED, the object); called in the event loop's thread.
Listener = Callable[[str, Obj], None]
TOMBSTONES = 4096  # uids of recently deleted objects, so a late response cannot resurrect one


def key_of(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")



def newer(a: Obj, b: Obj | None) -> bool:
    """True unless `b` is provably newer than `a` (resourceVersions are opaque, but etcd's are
    integers; when either is not, the later arrival wins)."""
    ra, rb = resource_version(a), resource_version(b)
    return not (ra.isdigit() and rb.isdigit()) or int(ra) >= int(rb)


# kubectl apply's copy of the whole manifest (a DDPJob's spec twice over); nothing here reads it.
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def slim(obj: Obj) -> Obj:
    """The object without metadata.managedFields and kubectl's last-applied-configuration
    annotation (nothing here reads them; they are a good part of an object's size, and the caches
    hold every DDPJob and every pod), its short strings shared (objmeta.shared). A new dict; `obj`
    is left as it was."""
    meta = obj.get("metadata")
    if meta:
        annotations = meta.get("annotations") or {}
        meta = {k: v for k, v in meta.items() if k != "managedFields"}
        if LAST_APPLIED in annotations:
            meta["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
        obj = {**obj, "metadata": meta}
    return shared(obj)


class Store:
    """Objects by (namespace, name), optionally indexed by a label (our pods by job name).
    Touched only from the event loop's thread. What it keeps of an object (its entry, made by
    `cut`) is the transformed object itself here; PackedStore keeps a denser entry, and each read
    of it is a new dict."""

    def __init__(self, *, index_label: str | None = None, transform: Callable[[Obj], Obj] = slim) -> None:
        self.index_label = index_label
        # What is kept of each object (client-go's transform function): `slim` by default, the
        # pod cache keeps only what the operator reads (base/podinfo.slim).
        self.transform = transform
        self._objs: dict[Key, Any] = {}
        self._index: dict[Key, set[str]] = collections.defaultdict(set)
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._synced = 0          # informers whose first list has landed
        self.informers = 0        # informers feeding this store (0 = filled by hand, always synced)
        self._synced_event: asyncio.Event | None = None
        self.listeners: list[Listener] = []

    # -- entries (what is kept of an object: PackedStore's differ) ------------------------
    def cut(self, obj: Obj) -> Any:
        """The entry kept for `obj`: an informer's thread makes it, so that a loop that lags
        behind a burst of events queues entries, not whole decoded objects."""
        return self.transform(obj)

    def _read(self, entry: Any) -> Obj:
        return entry

    def _meta(self, entry: Any) -> dict[str, Any]:
        """The entry's metadata as far as the store reads it: namespace, name, uid,
        resourceVersion and the index label."""
        return entry.get("metadata") or {}

    # -- reads -------------------------------------------------------------------------
    def get(self, namespace: str, name: str) -> Obj | None:
        entry = self._objs.get((namespace, name))
        return None if entry is None else self._read(entry)

    def by_index(self, namespace: str, value: str) -> list[Obj]:
        """Objects in `namespace` whose index label equals `value` (e.g. a job's pods)."""
        return [self._read(self._objs[(namespace, n)]) for n in sorted(self._index.get((namespace, value), ()))
                if (namespace, n) in self._objs]

    def items(self) -> list[Obj]:
        return [self._read(e) for e in self._objs.values()]

    def __len__(self) -> int:
        return len(self._objs)

    @property
    def synced(self) -> bool:
        return self._synced >= self.informers

    async def wait_synced(self) -> None:
        """Return once every informer feeding the store has delivered its first list."""
        if self.synced:
            return
        if self._synced_event is None:
            self._synced_event = asyncio.Event()
        await self._synced_event.wait()

    # -- writes ------------------------------------------------------------------------
    def _label(self, meta: dict[str, Any]) -> str | None:
        if self.index_label is None:
            return None
        return (meta.get("labels") or {}).get(self.index_label)

    def upsert(self, obj: Any, *, notify: bool = True, cut: bool = False) -> bool:
        """Keep `obj` unless what is stored is newer or it was deleted; True when stored. `cut`:
        `obj` is an entry already (an informer's thread made it)."""
        entry = obj if cut else self.cut(obj)
        meta = self._meta(entry)
        uid = meta.get("uid")
        if uid and uid in self._gone:
            return False
        k = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        kept = self._objs.get(k)
        old = None if kept is None else self._meta(kept)
        if old is not None and not newer({"metadata": meta}, {"metadata": old}):
            return False
        if old is not None and self._label(old) != self._label(meta):
            self._unindex(k, old)
        self._objs[k] = entry
        label = self._label(meta)
        if label is not None:
            self._index[(k[0], label)].add(k[1])
        if notify and self.listeners:
            self._notify("MODIFIED" if old is not None else "ADDED", self._read(entry))
        return True

    def delete(self, obj: Any, *, notify: bool = True, cut: bool = False) -> None:
        """Drop the object (only the same uid: a newer object may already hold the name)."""
        entry = obj if cut else self.cut(obj)
        meta = self._meta(entry)
        k = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        uid = meta.get("uid")
        if uid:
            self._gone[uid] = None
            while len(self._gone) > TOMBSTONES:
                self._gone.popitem(last=False)
        kept = self._objs.get(k)
        old = None if kept is None else self._meta(kept)
        if old is None or (uid and old.get("uid") != uid):
            return
        del self._objs[k]
        self._unindex(k, old)
        if notify and self.listeners:
            # A DELETED event carries the object's last state, which may be newer than what
            # is stored (PodGC's Failed + DisruptionTarget write, seen only with the deletion).
            self._notify("DELETED", self._read(entry if newer({"metadata": meta}, {"metadata": old}) else kept))

    def replace(self, namespace: str | None, entries: list[Any]) -> None:
        """A fresh list for `namespace` (None = all), as entries: upsert each, delete what is missing."""
        seen = {(str(m.get("namespace") or ""), str(m.get("name") or "")) for m in map(self._meta, entries)}
        for k, kept in list(self._objs.items()):
            if (namespace is None or k[0] == namespace) and k not in seen:
                self.delete(kept, cut=True)
        for entry in entries:
            self.upsert(entry, cut=True)

    def mark_synced(self) -> None:
        self._synced += 1
        if self.synced and self._synced_event is not None:
            self._synced_event.set()

    def _unindex(self, k: Key, meta: dict[str, Any]) -> None:
        label = self._label(meta)
        if label is None:
            return
        names = self._index.get((k[0], label))
        if names is not None:
            names.discard(k[1])
            if not names:
                del self._index[(k[0], label)]

    def _notify(self, etype: str, obj: Obj) -> None:
        for listener in self.listeners:
            try:
                listener(etype, obj)
            except Exception:  # one broken listener must not stop the cache
                log.exception("cache listener failed")


class Informer:
    """List, then watch, one collection into a Store, from a daemon thread; relists after a
    410 or an error (with backoff). The store is updated in the event loop's thread."""

    def __init__(self, k8s: Any, store: Store, path: str, *, query: list | None = None,
                 namespace: str | None = None, timeout: int = 270, what: str = "") -> None:
        self.k8s, self.store, self.path = k8s, store, path
        self.query = list(query or [])
        self.namespace = namespace      # the store's scope that a relist replaces (None = all)
        self.timeout = timeout
        self.what = what or path
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._first = True
        store.informers += 1

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name=f"informer {self.what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _post(self, fn: Callable, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the operator is exiting
            self._stop.set()

    def _listed(self, items: list[Obj]) -> None:
        self.store.replace(self.namespace, items)
        if self._first:
            self._first = False
            self.store.mark_synced()

    def _event(self, etype: str, obj: Obj) -> None:
        if etype == "DELETED":
            self.store.delete(obj, cut=True)
        else:
            self.store.upsert(obj, cut=True)

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                # Page by page, each cut to what the store keeps before the next is read: a relist of
                # 50,000 pods never holds their whole JSON at once.
                items, rv = self.k8s.list_objects(self.path, self.query, transform=self.store.cut)
                self._post(self._listed, items)
                backoff = 1.0
                rv = self._watch(rv)
            except ApiException as exc:
                if exc.status in (403, 404):
                    # Not installed (e.g. no peering CRD) or not allowed: nothing to keep. Count
                    # as synced so that passes are not held back forever, and ask again rarely.
                    (log.warning if self._first else log.debug)(
                        "cannot watch %s (%s %s); asking again every 5 min", self.what, exc.status, exc.reason)
                    if self._first:
                        self._post(self._listed, [])
                    self._stop.wait(300)
                    continue
                log.warning("watch of %s failed (%s); relisting in %.0fs", self.what, exc, backoff)
            except Exception as exc:  # noqa: BLE001  (network trouble: relist with backoff)
                if self._stop.is_set():
                    return
                log.warning("watch of %s failed (%s); relisting in %.0fs", self.what, exc, backoff)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)

    def _watch(self, rv: str) -> str:
        """Watch from `rv` until the stream must be relisted (410) or the informer stops."""
        while not self._stop.is_set():
            for ev in self.k8s.watch(self.path, self.query, resource_version=rv, timeout=self.timeout):
                if self._stop.is_set():
                    return rv
                etype, obj = ev.get("type"), ev.get("object") or {}
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        return rv  # too old: relist (the caller does)
                    raise RuntimeError(f"watch error: {obj.get('message') or obj}")
                rv = resource_version(obj) or rv
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    # Cut here, in this thread (Store.cut).
                    self._post(self._event, etype, self.store.cut(obj))
        return rv


# A pod as the operator makes it and the cache keeps it (base/podinfo.slim, Running): the preset
# dictionary its entries are deflated against. Our pods differ from it in little but names, uids,
# times and addresses, so a 1.2 KiB entry deflates to about 170 bytes (tests/unit/test_podinfo_slim.py
# holds our real Running pods under a quarter of their slim JSON).
# Only the ratio depends on it: an entry unlike it still packs and reads back whole.
_T = "2026-01-01T00:00:00Z"
_EXEMPLAR = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {
        "annotations": {labels.COUNTED_RESTARTS: "0", labels.RESTARTS: "0"},
        "labels": {labels.MANAGED_BY: labels.MANAGER, labels.ATTEMPT: "0", labels.JOB_NAME: "",
                   labels.NODE_RANK: "0"},
        "name": "", "namespace": "",
        "ownerReferences": [{"apiVersion": spec.API_VERSION, "blockOwnerDeletion": True,
                             "controller": True, "kind": spec.KIND, "name": "", "uid": ""}],
        "resourceVersion": "", "uid": ""},
    "spec": {"nodeName": "", "schedulerName": "default-scheduler"},
    "status": {
        "conditions": [{"lastTransitionTime": _T, "status": "True", "type": t}
                       for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady",
                                 "PodScheduled")],
        "containerStatuses": [{"name": labels.CONTAINER, "state": {"running": {"startedAt": _T}}}],
        "phase": "Running", "podIP": "10.0.0.0", "startTime": _T},
}
ZDICT = json.dumps(_EXEMPLAR, separators=(",", ":")).encode()
_WBITS = -15  # raw deflate (no header or checksum: the entry is only ever read here)


def _deflate(data: bytes) -> bytes:
    z = zlib.compressobj(6, zlib.DEFLATED, _WBITS, 8, zlib.Z_DEFAULT_STRATEGY, ZDICT)
    return z.compress(data) + z.flush()


def _inflate(data: bytes) -> bytes:
    return zlib.decompressobj(_WBITS, ZDICT).decompress(data)


class Packed:
    """A slim object kept as its compact JSON deflated against ZDICT, beside what the store itself
    reads of it (its key, uid, resourceVersion and index label) without decoding it."""

    __slots__ = ("namespace", "name", "uid", "version", "label", "blob")

    def __init__(self, obj: Obj, index_label: str | None) -> None:
        meta = obj.get("metadata") or {}
        # Namespaces and job names repeat across pods: one string each.
        self.namespace, self.name = sys.intern(str(meta.get("namespace") or "")), str(meta.get("name") or "")
        self.uid, self.version = meta.get("uid"), meta.get("resourceVersion")
        label = (meta.get("labels") or {}).get(index_label) if index_label else None
        self.label = sys.intern(label) if isinstance(label, str) else None
        self.blob = _deflate(json.dumps(obj, separators=(",", ":")).encode())


class PackedStore(Store):
    """A Store whose entries are Packed, made in the informer's thread. A slim pod's dicts and
    strings held 3.5 KiB (tracemalloc of the cut), its compact JSON about 1.2 KiB, and a burst of
    watch events that the loop has yet to take waits as a few objects each. The RSS did not follow
    (it is the creation's peak of small objects: bench/results/operator_memory_issue48/); what lives
    does. A read decodes, and every read is a new dict that no reader can change for the next."""

    def cut(self, obj: Obj) -> Any:
        return Packed(self.transform(obj), self.index_label)

    def _read(self, entry: Any) -> Obj:
        return json.loads(_inflate(entry.blob))

    def _meta(self, entry: Any) -> dict[str, Any]:
        meta = {"namespace": entry.namespace, "name": entry.name, "uid": entry.uid,
                "resourceVersion": entry.version}
        if self.index_label is not None and entry.label is not None:
            meta["labels"] = {self.index_label: entry.label}
        return meta


def pod_store() -> Store:
    """The operator's pods by job name, each kept as base/podinfo.slim cuts it, packed."""
    return PackedStore(index_label=labels.JOB_NAME, transform=podinfo.slim)


def pod_informers(k8s: Any, store: Store, namespaces: tuple[str, ...] | None) -> list[Informer]:
    """Our pods only (`ddpjob.dev/job-name` present), selected by the API server."""
    query = [("labelSelector", labels.JOB_NAME)]
    if namespaces is None:
        return [Informer(k8s, store, "/api/v1/pods", query=query, what="pods (all namespaces)")]
    return [Informer(k8s, store, f"/api/v1/namespaces/{ns}/pods", query=query, namespace=ns,
                     what=f"pods in {ns}") for ns in namespaces]


def peering_informers(k8s: Any, store: Store, name: str, namespaces: tuple[str, ...] | None) -> list[Informer]:
    """kopf's peering object(s) named `name`: cluster-wide, or one per namespace."""
    query = [("fieldSelector", f"metadata.name={name}")]
    if namespaces is None:
        return [Informer(k8s, store, "/apis/kopf.dev/v1/clusterkopfpeerings", query=query,
                         what=f"clusterkopfpeering {name}")]
    return [Informer(k8s, store, f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings", query=query,
                     namespace=ns, what=f"kopfpeering {ns}/{name}") for ns in namespaces]



class PeerGate:
    """kopf's peering rule, from the peering objects in `store`: pause while a live peer with a
    higher priority exists. A peer is live until `lastseen + lifetime` (kopf's keep-alive format,
    the documented status of KopfPeering objects)."""

    def __init__(self, store: Store, *, identity: str | None, priority: int,
                 clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)) -> None:
        self.store, self.identity, self.priority, self.clock = store, identity, priority, clock

    def blocking_until(self) -> dt.datetime | None:
        """When the last live higher-priority peer would be presumed dead; None = act now."""
        now = self.clock()
        until: dt.datetime | None = None
        for obj in self.store.items():
            for ident, info in (obj.get("status") or {}).items():
                if ident == self.identity or not isinstance(info, dict):
                    continue
                try:
                    prio, lifetime = int(info.get("priority", 0)), float(info.get("lifetime", 60))
                except (TypeError, ValueError):
                    continue
                seen = parse_time(info.get("lastseen")) or now
                deadline = seen + dt.timedelta(seconds=lifetime)
                if prio > self.priority and deadline > now:
                    until = max(until or deadline, deadline)
        return until
