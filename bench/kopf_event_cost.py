#!/usr/bin/env python3
"""CPU per DDPJob watch event in kopf's processing, with our handlers (benchmark, not a test).

kopf runs every DDPJob event through `process_resource_event` before our `on.event` handler sees
it. Whatever handlers are registered, it builds the object's "essence" for its diffs: a deep copy
of the whole body (status, managedFields and all) that it then throws away, and a second copy of
what is left. Our handlers are level-based (on.event only: no diffs read, nothing stored on the
object), so the operator gives kopf a diff base that copies nothing (app/handlers.WatchOnlyDiffBase).

Arms, interleaved block by block so machine drift hits all alike (CPU time of this process):
- `kopf-default`: kopf's default settings;
- `kopf-ours`: the settings the operator uses (operator_main.operator_settings);
- `upsert`: only what our handler does with the event (the job cache's upsert), the floor any
  watch of DDPJobs (kopf's or an informer of our own) pays besides decoding the event.
Also the JSON decoding of the event's line (paid by every watch alike), for scale.
The body is a large but legal DDPJob: 20 restartHistory entries with peers' failures, 10 failures
with 1,500-character log tails, progress from 256 ranks, a kubectl last-applied annotation and
managedFields. Prints medians and ours/default with its 95 % interval; writes
bench/results/kopf_event_cost.json.

    .venv/bin/python bench/kopf_event_cost.py [--blocks 10] [--events 200]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "operator"))

import kopf  # noqa: E402
from kopf._cogs.structs import ephemera, references  # noqa: E402
from kopf._core.actions import lifecycles  # noqa: E402
from kopf._core.engines import indexing  # noqa: E402
from kopf._core.reactor import inventory, processing  # noqa: E402

from ddpjob_api.spec import GROUP, KIND, PLURAL, VERSION  # noqa: E402
from ddpjob_operator.base.config import OperatorConfig  # noqa: E402
from ddpjob_operator.app.handlers import register  # noqa: E402
from ddpjob_operator.app.operator_main import operator_settings  # noqa: E402
from ddpjob_operator.cluster.cache import Store  # noqa: E402
from provenance import Provenance  # noqa: E402
from stats import ratio_interval, verdict  # noqa: E402

RESULTS = REPO / "bench" / "results" / "kopf_event_cost.json"
RANKS = 256


def big_job(rv: int) -> dict:
    """A Running 32-node x 8-GPU job late in a rough life (every list at its cap)."""
    spec = {"image": "registry.example.com/team/trainer:2026.11", "nodes": 32, "gpusPerNode": 8,
            "command": ["python", "-m", "team.train", "--config", "/etc/train/config.yaml"],
            "trainer": {"model": "resnet50", "dataset": "imagenet", "epochs": 90, "batchSize": 256,
                        "learningRate": 0.1, "checkpointEvery": 500},
            "failurePolicy": {"maxRestarts": 50, "restartOnHang": True, "logTailInStatus": True},
            "resources": {"limits": {"nvidia.com/gpu": 8, "cpu": "64", "memory": "900Gi"}},
            "env": [{"name": f"TEAM_VAR_{i}", "value": f"value-{i}"} for i in range(12)]}
    history = [{"kind": "InPlace" if i % 3 else "Group", "attempt": i // 3, "restart": i, "rank": 17 * i % RANKS,
                "pod": f"big-{i % 32}-a{i // 3}", "node": f"gpu-node-{i:03d}", "exitCode": 1, "signal": 0,
                "message": "RuntimeError: NCCL communicator was aborted on rank 17. " * 3,
                "reason": "WorkerFailed", "time": "2026-11-27T10:00:00Z", "failedAt": "2026-11-27T09:59:58Z",
                "stepAtFailure": 1000 * i, "resumedFromStep": 1000 * i - 37, "stepsLost": 37,
                "recoverySeconds": 4.2,
                "alsoFailed": [{"rank": r, "pod": f"big-{r // 8}-a{i // 3}", "exitCode": 1,
                                "message": "connection closed by peer"} for r in range(8)]}
               for i in range(20)]
    failures = [{"attempt": i, "pod": f"big-{i}-a{i}", "rank": 8 * i, "container": "trainer", "exitCode": 1,
                 "reason": "Error", "node": f"gpu-node-{i:03d}", "finishedAt": "2026-11-27T09:59:58Z",
                 "logTail": ("Traceback (most recent call last):\n  File \"train.py\", line 42\n" * 40)[:1500]}
                for i in range(10)]
    status = {"phase": "Running", "observedGeneration": 1, "attempt": 6, "launchedAttempt": 6, "restarts": 6,
              "countedRestarts": 6, "inPlaceRestarts": 14, "restartHistory": history, "failures": failures,
              "masterAddr": "big-0.big.team.svc", "startTime": "2026-11-26T08:00:00Z",
              "nodes": {"total": 32, "pending": 0, "running": 32, "succeeded": 0, "failed": 0, "ready": 32},
              "mlflow": {"runId": "a" * 32, "experimentId": "12", "url": "https://mlflow.example.com/#/runs/" + "a" * 32},
              "progress": {"epoch": 41, "step": 205_000 + rv, "totalSteps": 450_000, "percent": 45.6, "loss": 1.234,
                           "samplesPerSecond": 52_000.0, "eta": "9h12m", "etaSeconds": 33_120,
                           "lastStepTime": "2026-11-27T10:00:00Z", "ranksReporting": RANKS, "slowestRank": 201},
              "conditions": [{"type": t, "status": "False", "reason": "Fine", "message": "every rank keeps pace",
                              "lastTransitionTime": "2026-11-27T08:00:00Z", "observedGeneration": 1}
                             for t in ("Created", "Running", "Restarting", "Straggler", "Stalled", "Succeeded")]}
    fields_status = {f"f:{k}": {} for k in status}
    managed = [{"manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": f"{GROUP}/{VERSION}",
                "time": "2026-11-26T08:00:00Z", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:annotations": {".": {}, "f:kubectl.kubernetes.io/last-applied-configuration": {}}},
                             "f:spec": {f"f:{k}": {} for k in spec}}},
               {"manager": "ddpjob-operator", "operation": "Update", "apiVersion": f"{GROUP}/{VERSION}",
                "time": "2026-11-27T10:00:00Z", "fieldsType": "FieldsV1", "subresource": "status",
                "fieldsV1": {"f:status": fields_status}}]
    meta = {"name": "big", "namespace": "team", "uid": "0f6b9c1e-5a7d-4c1b-9e7a-3d2f1b0c9a88",
            "resourceVersion": str(1_000_000 + rv), "generation": 1, "creationTimestamp": "2026-11-26T08:00:00Z",
            "labels": {"team": "vision", "app.kubernetes.io/managed-by": "kubectl"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": json.dumps(
                {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": "big", "namespace": "team"},
                 "spec": spec})},
            "managedFields": managed}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": meta, "spec": spec, "status": status}


class Jobs:
    """What our handler feeds per event (Reconciler.job_event's cache upsert), without the pass."""

    def __init__(self) -> None:
        self.jobs = Store()

    def job_event(self, obj: dict) -> None:
        self.jobs.upsert(obj, notify=False)

    def job_deleted(self, obj: dict) -> None:
        self.jobs.delete(obj, notify=False)


class KopfArm:
    """One operator's worth of kopf state, processing events as its watch would hand them over."""

    def __init__(self, settings: kopf.OperatorSettings) -> None:
        self.registry = kopf.OperatorRegistry()
        register(self.registry, Jobs())  # type: ignore[arg-type]  # the handler calls only job_event/job_deleted
        self.settings = settings
        self.memories = inventory.ResourceMemories()
        self.indexers = indexing.OperatorIndexers()
        self.resource = references.Resource(GROUP, VERSION, PLURAL, kind=KIND, namespaced=True,
                                            verbs=["list", "watch", "patch"])
        self.queue: asyncio.Queue = asyncio.Queue()

    async def event(self, raw: dict) -> None:
        await processing.process_resource_event(
            lifecycle=lifecycles.all_at_once, indexers=self.indexers, registry=self.registry,
            settings=self.settings, memories=self.memories, memobase=ephemera.Memo(), resource=self.resource,
            raw_event={"type": "MODIFIED", "object": raw}, event_queue=self.queue, no_throttling=True)


async def block(arm, bodies: list[dict]) -> float:
    """CPU seconds per event over `bodies`."""
    t0 = time.process_time()
    for body in bodies:
        if isinstance(arm, Jobs):
            arm.job_event(body)
        else:
            await arm.event(body)
    return (time.process_time() - t0) / len(bodies)


async def run(blocks: int, events: int) -> dict:
    cfg = OperatorConfig()
    arms = {"kopf-default": KopfArm(kopf.OperatorSettings()), "kopf-ours": KopfArm(operator_settings(cfg)),
            "upsert": Jobs()}
    lines = [json.dumps({"type": "MODIFIED", "object": big_job(i)}) for i in range(events)]
    for arm in arms.values():                                      # warm-up
        await block(arm, [big_job(i) for i in range(20)])
    per: dict[str, list[float]] = {k: [] for k in arms}
    decode: list[float] = []
    serial = events
    for b in range(blocks):
        order = list(arms)[b % len(arms):] + list(arms)[:b % len(arms)]
        for name in order:
            # A fresh decoded body per event (as a watch delivers), its resourceVersion ever newer.
            bodies = [big_job(serial + i) for i in range(events)]
            serial += events
            gc.collect()  # each block starts alike: not charged a collection of the bodies just built
            per[name].append(await block(arms[name], bodies))
        t0 = time.process_time()
        for line in lines:
            json.loads(line)
        decode.append((time.process_time() - t0) / len(lines))
    ratios = [o / d for o, d in zip(per["kopf-ours"], per["kopf-default"])]
    ci = ratio_interval(ratios)
    return {"blocks": blocks, "events_per_block": events, "body_bytes": len(lines[0]),
            "cpu_us_per_event": {k: {"median": round(1e6 * statistics.median(v), 1),
                                     "min": round(1e6 * min(v), 1), "max": round(1e6 * max(v), 1)}
                                 for k, v in per.items()},
            "json_decode_us_per_event": round(1e6 * statistics.median(decode), 1),
            "ratio_ours_default": {k: round(v, 3) if isinstance(v, float) else v for k, v in ci.items()},
            "verdict": verdict(ci, what="kopf CPU per event, ours/default", above_one="costlier",
                               below_one="cheaper")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    prov = Provenance("api", "operator", "bench", out=args.out)
    res = asyncio.run(run(args.blocks, args.events))
    res.update({"benchmark": "kopf_event_cost", "kopf": kopf.__version__ if hasattr(kopf, "__version__") else None})
    for k, v in res["cpu_us_per_event"].items():
        print(f"{k:14s} {v['median']:8.1f} us/event [{v['min']}-{v['max']}]")
    print(f"json decode    {res['json_decode_us_per_event']:8.1f} us/event ({res['body_bytes']} bytes)")
    print(res["verdict"])
    print(f"wrote {prov.write(res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
