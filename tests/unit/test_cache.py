"""cache.Store and cache.Informer: newest wins, no ghosts after a relist, synced only once listed."""
from __future__ import annotations

import asyncio
import threading

import pytest

from ddpjob_api import labels
from ddpjob_operator.cluster.cache import LAST_APPLIED, Informer, PackedStore, Store, pod_informers, pod_store
from ddpjob_operator.cluster.k8s import LIST_PAGE, K8s
from tests.support.builders import make_pod


@pytest.mark.parametrize("kind", [Store, PackedStore])
def test_store_keeps_the_newest_version_and_indexes_by_job(kind):
    store = kind(index_label=labels.JOB_NAME)
    store.upsert(make_pod(name="a", resource_version=5))
    assert not store.upsert(make_pod(name="a", resource_version=4))     # a late, older event
    store.upsert(make_pod(name="b", resource_version=6, job="k"))
    assert [p["metadata"]["resourceVersion"] for p in store.by_index("ns", "j")] == ["5"]
    assert [p["metadata"]["name"] for p in store.by_index("ns", "k")] == ["b"]
    assert store.by_index("other", "j") == []


@pytest.mark.parametrize("kind", [Store, PackedStore])
def test_deleted_object_is_not_resurrected_by_a_late_copy(kind):
    store = kind(index_label=labels.JOB_NAME)
    store.upsert(make_pod(name="a", resource_version=5))
    store.delete(make_pod(name="a", resource_version=7))
    # e.g. our create's response, after the DELETED event
    assert not store.upsert(make_pod(name="a", resource_version=6))
    assert store.get("ns", "a") is None
    assert store.by_index("ns", "j") == []


@pytest.mark.parametrize("kind", [Store, PackedStore])
def test_delete_of_an_older_object_keeps_the_newer_one_with_that_name(kind):
    store = kind(index_label=labels.JOB_NAME)
    store.upsert(make_pod(name="a", resource_version=9, uid="new"))
    store.delete(make_pod(name="a", resource_version=5, uid="old"))
    assert store.get("ns", "a")["metadata"]["uid"] == "new"


@pytest.mark.parametrize("kind", [Store, PackedStore])
def test_relist_drops_what_vanished_and_notifies(kind):
    store = kind(index_label=labels.JOB_NAME)
    seen = []
    store.listeners.append(lambda etype, obj: seen.append((etype, obj["metadata"]["name"])))
    store.upsert(make_pod(name="a", resource_version=1))
    store.upsert(make_pod(name="b", resource_version=2))
    store.upsert(make_pod(name="x", resource_version=3, namespace="elsewhere"))
    store.replace("ns", [store.cut(make_pod(name="b", resource_version=4))])   # as an informer lists
    assert store.get("ns", "a") is None and store.get("ns", "b")["metadata"]["resourceVersion"] == "4"
    assert store.get("elsewhere", "x") is not None   # another informer's scope is left alone
    assert ("DELETED", "a") in seen and ("MODIFIED", "b") in seen


def test_a_packed_store_hands_out_a_new_dict_per_read_and_keeps_no_dicts():
    store = PackedStore(index_label=labels.JOB_NAME)
    store.upsert(make_pod(name="a", resource_version=5))
    first = store.get("ns", "a")
    first["status"]["phase"] = "Failed"                      # a reader's change stays its own
    assert store.get("ns", "a")["status"]["phase"] == "Running" and store.get("ns", "a") is not store.get("ns", "a")
    assert store.by_index("ns", "j") == [store.get("ns", "a")] and store.items() == [store.get("ns", "a")]
    (entry,) = store._objs.values()
    assert isinstance(entry.blob, bytes) and not any(isinstance(getattr(entry, s), dict) for s in entry.__slots__)
    # A later version under a new job label moves it in the index.
    store.upsert(make_pod(name="a", resource_version=6, job="k"))
    assert store.by_index("ns", "j") == [] and [p["metadata"]["name"] for p in store.by_index("ns", "k")] == ["a"]


class ScriptedAPI:
    """Lists and watch streams played from a script, as the API server would send them."""

    def __init__(self, lists: list, watches: list) -> None:
        self.lists, self.watches = list(lists), list(watches)
        self.calls: list[tuple] = []
        self.idle = threading.Event()

    def list_objects(self, path, query=None, *, transform=None):
        self.calls.append(("list", path, tuple(query or ())))
        items, rv = self.lists.pop(0)
        return [transform(o) if transform else o for o in items], rv

    def watch(self, path, query, *, resource_version, timeout=270):
        self.calls.append(("watch", path, resource_version))
        if not self.watches:
            self.idle.set()
            threading.Event().wait(0.05)
            return iter(())
        return iter(self.watches.pop(0))


def test_informer_lists_watches_and_relists_after_410_without_ghosts():
    api = ScriptedAPI(
        lists=[([make_pod(name="a", resource_version=1), make_pod(name="b", resource_version=2)], "10"),
               ([make_pod(name="b", resource_version=13)], "20")],
        watches=[[{"type": "MODIFIED", "object": with_env(make_pod(name="a", resource_version=11))},
                  {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}},
                  {"type": "ERROR", "object": {"code": 410, "message": "too old"}}]])
    store = pod_store()
    informer, = pod_informers(api, store, ("ns",))
    kept: list[dict] = []
    store.listeners.append(lambda etype, obj: kept.append(obj))

    async def main():
        assert not store.synced
        informer.start(asyncio.get_running_loop())
        await asyncio.wait_for(store.wait_synced(), 5)
        while not api.idle.is_set():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        informer.stop()
    asyncio.run(main())
    # "a" was deleted while the watch was gone: the relist removed it.
    assert [p["metadata"]["name"] for p in store.by_index("ns", "j")] == ["b"]
    assert api.calls[0] == ("list", "/api/v1/namespaces/ns/pods", (("labelSelector", labels.JOB_NAME),))
    assert ("watch", "/api/v1/namespaces/ns/pods", "10") in api.calls
    assert ("watch", "/api/v1/namespaces/ns/pods", "20") in api.calls   # continued from the relist
    # What the watch brought was cut to what the operator reads (in the informer's thread).
    assert kept and all("containers" not in (p.get("spec") or {}) for p in kept)


def with_env(pod: dict) -> dict:
    pod.setdefault("spec", {})["containers"] = [{"name": "trainer", "env": [{"name": "A", "value": "1"}]}]
    return pod


def test_informer_for_a_missing_resource_counts_as_synced():
    from kubernetes.client.rest import ApiException

    class Missing:
        def list_objects(self, path, query=None, *, transform=None):
            raise ApiException(status=404, reason="NotFound")

    store = Store()
    informer = Informer(Missing(), store, "/apis/kopf.dev/v1/namespaces/ns/kopfpeerings")

    async def main():
        informer.start(asyncio.get_running_loop())
        await asyncio.wait_for(store.wait_synced(), 5)
        informer.stop()
    asyncio.run(main())
    assert len(store) == 0


def test_store_drops_managed_fields_without_touching_the_original():
    store = Store(index_label=labels.JOB_NAME)
    original = make_pod(name="a", resource_version=1)
    original["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    store.upsert(original)
    assert "managedFields" not in store.get("ns", "a")["metadata"]
    assert original["metadata"]["managedFields"] == [{"manager": "kubectl"}]


def test_store_drops_kubectls_last_applied_copy_of_a_job():
    store = Store()
    job = {"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "1",
                        "annotations": {LAST_APPLIED: '{"spec": "the whole manifest again"}', "team": "a"}},
           "spec": {"nodes": 2}}
    store.upsert(job)
    assert store.get("ns", "j")["metadata"]["annotations"] == {"team": "a"}
    assert LAST_APPLIED in job["metadata"]["annotations"]


def test_a_list_is_read_page_by_page_each_page_cut_before_the_next():
    """One consistent list in pages of LIST_PAGE (the continue token), as client-go's informers
    read it: a relist of 50,000 pods never holds their whole JSON at once."""
    k8s = K8s.__new__(K8s)
    pages = {"": {"items": [{"n": 1}, {"n": 2}], "metadata": {"continue": "c1"}},
             "c1": {"items": [{"n": 3}], "metadata": {"resourceVersion": "42"}}}
    seen: list[tuple] = []
    cut: list[int] = []

    def request(method, path, *, query=None, **_):
        q = dict(query)
        seen.append((method, path, q.get("labelSelector"), q.get("limit"), q.get("continue", ""), len(cut)))
        return pages[q.get("continue", "")]

    def transform(obj):
        cut.append(obj["n"])
        return {"kept": obj["n"]}

    k8s._request = request  # type: ignore[method-assign]
    items, rv = k8s.list_objects("/api/v1/pods", [("labelSelector", "x")], transform=transform)
    assert items == [{"kept": 1}, {"kept": 2}, {"kept": 3}] and rv == "42"
    # The first page's two items were cut before the second page was asked for.
    assert seen == [("GET", "/api/v1/pods", "x", str(LIST_PAGE), "", 0),
                    ("GET", "/api/v1/pods", "x", str(LIST_PAGE), "c1", 2)]
