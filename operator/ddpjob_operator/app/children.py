"""The children of a DDPJob: its headless Service, its pods and (gang-scheduled) its PodGroup,
deleted and created as a pass decided (the Kueue workload is Kueue's, made from the pods' labels).

Creates are idempotent: a 409 is the object already there, ours after an operator restart, or
someone else's, which is refused. A group is created in one pass, with slow start
(`slow_start`). What a refused create means is decided here, where it happens: `refusal` turns the
API's 4xx into a `CreateRefusal` that the status only renders (decisions/status.create_refused);
anything else (5xx, 429, a lost connection) is raised for the pass to retry.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, Callable, Sequence

from kubernetes.client.rest import ApiException

from ddpjob_operator.base import podinfo
from ddpjob_operator.base.config import OperatorConfig
from ddpjob_operator.base.objmeta import error_body, owned_by
from ddpjob_operator.app.operator_metrics import OperatorMetrics
from ddpjob_operator.builders import gang
from ddpjob_operator.builders.lighthouse import render_lighthouse_pod, render_lighthouse_service
from ddpjob_operator.builders.pods import render_pod
from ddpjob_operator.builders.service import render_service
from ddpjob_operator.cluster.cache import Store
from ddpjob_operator.cluster.fairqueue import FairSlots
from ddpjob_operator.cluster.k8s import IN_FLIGHT, K8s
from ddpjob_operator.decisions.lifecycle import Decision
from ddpjob_operator.decisions.status import NAME_CONFLICT, CreateRefusal

log = logging.getLogger("ddpjob.controller")
# POSTs of a shared child (Service, PodGroup) answered 409 by one that is gone when read back.
SHARED_TRIES = 3
# Test knob: seconds to wait between pod creations (lets a test kill the operator mid-creation).
CREATE_DELAY_ENV = "DDPJOB_DEBUG_CREATE_DELAY"


def slow_start(created: int, *, cap: int = IN_FLIGHT) -> int:
    """Pod creates a pass may have in flight once `created` of its creates went through: TCP's
    slow start, one more per success, so 1, 2, 4, ... per round trip up to `cap`. The Job
    controller's batches (1, 2, 4, ...) grow the same way, but here a slow request holds up only its
    own slot, not the next batch. A template the API server refuses costs one request, not a
    group's; other jobs' requests still get their turn, as the K8s facade hands its slots out
    round-robin between jobs."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    return min(1 + max(created, 0), cap)


# What strict field validation says of a field this API server's schema lacks ("strict decoding
# error: unknown field \"spec.containers[0].stopSignal\"").
UNKNOWN_FIELD = "unknown field"


def unknown_field(exc: object) -> bool:
    """The API server refused a create for a field it does not know (strict field validation)."""
    return isinstance(exc, ApiException) and exc.status == 400 and UNKNOWN_FIELD in str(exc.body or "")


def refusal(pod: str, code: int | None, body: Any, *, server: str = "") -> CreateRefusal | None:
    """A CreateRefusal from an API error (code + JSON Status body), None when it is not one:
    409 (the pod exists), 429 and 5xx are the pass's to retry. `server`: the API server's version,
    named when it refused a field it does not know (one newer than the cluster)."""
    if code is None or not 400 <= code < 500 or code in (409, 429):
        return None
    data = error_body(body)
    message = " ".join(str(data.get("message") or f"HTTP {code}").split())
    if server and UNKNOWN_FIELD in message:
        message = (f"{message[:800]} (the API server is Kubernetes {server}, which does not have that field: "
                   f"it is newer than this cluster; upgrade the cluster or leave the field out)")
    return CreateRefusal(pod=pod, code=int(code), reason=str(data.get("reason") or code), message=message[:1000])


def split_creates(objs: list[dict[str, Any]], results: list[Any], *,
                  server: str = "") -> tuple[list[Any], list[CreateRefusal]]:
    """(created results, refusals) from `asyncio.gather(*creates, return_exceptions=True)` over
    `objs`; any other exception (5xx, 429, a lost connection) is raised for the pass to retry."""
    created: list[Any] = []
    refused: list[CreateRefusal] = []
    for obj, res in zip(objs, results):
        if isinstance(res, BaseException):
            r = refusal(str((obj.get("metadata") or {}).get("name") or ""), getattr(res, "status", None),
                        getattr(res, "body", None), server=server)
            if r is None:
                raise res
            refused.append(r)
        else:
            created.append(res)
    return created, refused


def foreign(job, obj: dict[str, Any] | None, kind: str, harm: str = "") -> CreateRefusal | None:
    """A refusal naming the object that holds a name of this job's children when it is someone
    else's (`harm`: what it would do in ours' place); None when it is ours or has gone meanwhile
    (the next pass creates it)."""
    if obj is None or owned_by(obj, job.uid):
        return None
    name = podinfo.name(obj) or job.name
    return CreateRefusal(pod=name, code=409, reason=NAME_CONFLICT, kind=kind,
                         message=f"{kind} {name} exists and is not owned by this DDPJob{harm}")


def foreign_service(job, svc: dict[str, Any] | None) -> CreateRefusal | None:
    """The job's Service name held by a Service that is not this job's headless Service: the pods
    would get a MASTER_ADDR that does not resolve."""
    harm = ": pods would get a MASTER_ADDR that does not resolve; rename the job or delete that service"
    ip = ((svc or {}).get("spec") or {}).get("clusterIP")
    if svc is None or not owned_by(svc, job.uid) or ip == "None":
        return foreign(job, svc, "service", harm)
    name = podinfo.name(svc) or job.name
    return CreateRefusal(pod=name, code=409, reason=NAME_CONFLICT, kind="service",
                         message=f"service {name} is not headless (clusterIP {ip}){harm}")


def foreign_lighthouse_service(job, svc: dict[str, Any] | None) -> CreateRefusal | None:
    """The Lighthouse's Service name held by someone else's Service: the replica groups would reach
    whatever it selects for their quorum."""
    return foreign(job, svc, "service", ": the replica groups would not reach their Lighthouse; rename the job or "
                   "delete that service")


def foreign_podgroup(job, pg: dict[str, Any] | None) -> CreateRefusal | None:
    """The job's PodGroup name held by someone else's: the gang scheduler would wait for that
    group's minMember, not ours."""
    return foreign(job, pg, "podgroup", ": the gang scheduler would place the pods by its rules; rename the job or delete it")


class Children:
    """Creates and deletes one operator's DDPJob children; remembers which jobs' shared children exist."""

    def __init__(self, config: OperatorConfig, k8s: K8s, metrics: OperatorMetrics, pods: Store, *,
                 current: Callable[[Any], bool]):
        self.config = config
        self.k8s = k8s
        self.metrics = metrics
        self.pods = pods
        self._current = current  # is the job still as decided on: a deleted or edited job's creation stops
        self.create_delay = float(os.environ.get(CREATE_DELAY_ENV) or 0)
        self.services: dict[str, int] = {}         # job uid -> attempt its Service was last seen in
        self.podgroups: dict[str, int] = {}        # job uid -> attempt its PodGroup was last seen in
        self.lighthouses: dict[str, int] = {}      # job uid -> attempt its Lighthouse's Service was last seen in
        # A pod is rendered when its create is about to go out, so at most IN_FLIGHT rendered pods
        # wait for a request slot, handed out between jobs as fairly as the slots themselves.
        # Rendered up front, 800 jobs' passes held several thousand (10 KiB each) while their creates
        # waited their turn, and Python keeps the small-object arenas such a peak fills.
        self._renders = FairSlots(IN_FLIGHT)

    def forget(self, uid: str) -> None:
        """A DDPJob is gone: its Service, PodGroup and Lighthouse go with it (garbage collection)."""
        self.services.pop(uid, None)
        self.podgroups.pop(uid, None)
        self.lighthouses.pop(uid, None)

    async def act(self, job, pods: Sequence[dict[str, Any]], decision: Decision) -> list[CreateRefusal]:
        """Delete, create, delete the job, as decided; returns the pod creates the API refused."""
        by_name = {podinfo.name(p): p for p in pods}
        deletes = [self.k8s.delete_pod(job.namespace, n, job=job.name, uid=(by_name[n].get("metadata") or {}).get("uid"))
                   for n in decision.delete_pods]
        if deletes:
            results = await asyncio.gather(*deletes)
            self.metrics.count_pods(job.namespace, deleted=sum(bool(r) for r in results))
        refused: list[CreateRefusal] = []
        if decision.create_lighthouse:
            refused = await self._create_lighthouse(job, decision)
        if decision.create_ranks and not refused:  # the groups would wait for a Lighthouse that is not there
            refused = await self._create(job, decision)
        if decision.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished passed", job.namespace, job.name)
            await self.k8s.delete_job(job.namespace, job.name)
        return refused

    async def _ensure_shared(self, job, obj: dict[str, Any], *, attempt: int, seen: dict[str, int],
                             conflict: Callable[[Any, dict[str, Any] | None], CreateRefusal | None]
                             ) -> CreateRefusal | None:
        """Create a child the whole job shares (its Service, its PodGroup), once per job; a refusal
        when it cannot be made or is someone else's. Nothing watches these, so a later creation
        pass (a restart) reads it back, once per attempt (not per batch): someone may have
        deleted it, and the new group's rendezvous (or gang) would then never form."""
        kind, name, api_version = obj["kind"], obj["metadata"]["name"], obj["apiVersion"]
        if seen.get(job.uid) not in (None, attempt):
            if await self.k8s.get_child(kind, job.namespace, name, job=job.name, api_version=api_version) is None:
                del seen[job.uid]
            else:
                seen[job.uid] = attempt
        if job.uid in seen:
            return None
        for _ in range(SHARED_TRIES):
            try:
                created = await self.k8s.create(obj)
            except ApiException as exc:
                refused = refusal(name, exc.status, exc.body,
                                  server=await self.k8s.server_version() if unknown_field(exc) else "")
                if refused is None:
                    raise
                if exc.status == 404 and kind == gang.KIND:  # the API group is not served: no scheduler CRD
                    refused = dataclasses.replace(refused, message=(
                        f"this cluster does not serve {api_version} {kind}s: install the scheduler that "
                        f"spec.scheduling.gang names (or remove spec.scheduling.gang)"))
                return dataclasses.replace(refused, kind=kind.lower())
            if created is not None:
                break
            # 409: after an operator restart it is ours; anyone else's would stand in for ours.
            held = await self.k8s.get_child(kind, job.namespace, name, job=job.name, api_version=api_version)
            if held is not None:
                found = conflict(job, held)
                if found:
                    return found
                break
            # Deleted between our POST and this read (someone else's, just removed): POST again,
            # as pods made now would wait for it forever.
        else:
            raise RuntimeError(f"{kind} {name} was there and gone {SHARED_TRIES} times in a row")
        seen[job.uid] = attempt
        return None

    async def _create_lighthouse(self, job, decision: Decision) -> list[CreateRefusal]:
        """A per-step job's Lighthouse pod, with its Service read back first (a Lighthouse made
        again may have lost its Service the same way: someone deleted the job's children)."""
        self.lighthouses.pop(job.uid, None)
        refused = await self._ensure_shared(job, render_lighthouse_service(job), attempt=decision.attempt,
                                            seen=self.lighthouses, conflict=foreign_lighthouse_service)
        if refused:
            return [refused]
        return await self.create_pods(job, [render_lighthouse_pod(job)])

    async def _create(self, job, decision: Decision) -> list[CreateRefusal]:
        # The Service and PodGroup outlive group restarts: POST them once per job (a 409 after an
        # operator restart also means they exist). A Service that is not ours (or not headless)
        # would give the pods a MASTER_ADDR that never resolves, so no pods until it is sorted out.
        service = render_service(job)
        shared: list[tuple[Any, Any, Any]] = [(service, self.services, foreign_service)]
        if gang.api_of(job) is not None:
            pod = render_pod(job, 0, attempt=decision.attempt, config=self.config)
            shared.append((gang.render_podgroup(job, pod), self.podgroups, foreign_podgroup))
        for obj, seen, conflict in shared:
            shared_refused = await self._ensure_shared(job, obj, attempt=decision.attempt, seen=seen,
                                                       conflict=conflict)
            if shared_refused:
                return [shared_refused]
        # The whole group in this pass (its status, the attempt, is stored already).
        return await self._create_group(job, decision)

    async def _create_group(self, job, decision: Decision) -> list[CreateRefusal]:
        """Create the decided ranks' pods, at most `slow_start(created)` at a time. A refusal ends
        it, as in the Job controller (the rest would be refused alike), and so does a job deleted or
        edited meanwhile (the next pass decides again); another error is raised once the creates in
        flight are done, for the pass to retry."""
        cap = 1 if self.create_delay > 0 else IN_FLIGHT
        ranks = iter(decision.create_ranks)
        flying: set[asyncio.Task[list[CreateRefusal]]] = set()
        created, stop = 0, False
        refused: list[CreateRefusal] = []
        error: BaseException | None = None
        try:
            while True:
                while not stop and len(flying) < slow_start(created, cap=cap):
                    rank = next(ranks, None)
                    if rank is None:
                        break
                    if not self._current(job):
                        log.info("%s/%s was deleted or changed: its creation stops", job.namespace, job.name)
                        stop = True
                        break
                    flying.add(asyncio.ensure_future(self._create_rank(job, decision, rank)))
                if not flying:
                    break
                done, flying = await asyncio.wait(flying, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        error, stop = error or task.exception(), True
                    elif task.result():
                        refused, stop = refused + task.result(), True
                    else:
                        created += 1
                if self.create_delay > 0:
                    await asyncio.sleep(self.create_delay)
        finally:
            for task in flying:   # the pass was cancelled (the operator stops)
                task.cancel()
        if error is not None:
            raise error
        return refused

    async def _create_rank(self, job, decision: Decision, rank: int) -> list[CreateRefusal]:
        """Render the rank's pod once its turn comes (self._renders), and create it."""
        async with self._renders.slot((job.namespace, job.name)):
            pod = render_pod(job, rank, attempt=decision.attempt, config=self.config,
                             restarts=decision.restarts, counted_restarts=decision.counted_restarts,
                             replacement=decision.replacement.get(rank, 0))
            return await self.create_pods(job, [pod])

    async def create_pods(self, job, pods: list[dict[str, Any]]) -> list[CreateRefusal]:
        results = await asyncio.gather(*(self.k8s.create(p) for p in pods), return_exceptions=True)
        server = await self.k8s.server_version() if any(unknown_field(r) for r in results) else ""
        made, refused = split_creates(pods, results, server=server)
        self._created(job.namespace, made)
        # A 409 is usually our own pod the cache has not shown yet; a pod of that name made by
        # someone else would keep the job waiting forever without a word, so look at its owner.
        for pod, res in zip(pods, results):
            if res is not None:
                continue
            conflict = foreign(job, await self.k8s.get_child("Pod", job.namespace, podinfo.name(pod), job=job.name), "pod")
            if conflict:
                refused.append(conflict)
        return refused

    def _created(self, namespace: str, pods: list[dict[str, Any] | None]) -> None:
        made = [p for p in pods if p is not None]  # None: it existed already (409)
        self.metrics.count_pods(namespace, created=len(made))
        for pod in made:
            if pod.get("metadata"):
                self.pods.upsert(pod, notify=False)  # seen by the next pass even before its watch event
