"""What the cluster commands print (`ddpjob list/get/describe/wait/top/logs`), as pure functions.

Each takes DDPJob, pod and event objects as the API serves them (plain dicts, camelCase) and
returns plain data or text; `kube.py` does the I/O and `jobs.py` the click commands. The names
of phases, conditions and labels are the operator's (`ddpjob_api.phases`, `.health`,
`.labels`), read from there.
"""
from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

from ddpjob_api.contract import INPLACE_MARKER_RE, MLFLOW_DEFAULT_EXPERIMENT, public_uri
from ddpjob_api.phases import Phase, Signal
from ddpjob_api.spec import KIND, PLURAL, from_manifest
from ddpjob_operator.base import objmeta, podinfo
from ddpjob_operator.base.group import Group
from ddpjob_operator.decisions import goodput
from ddpjob_operator.base.podinfo import meta
from ddpjob_operator.decisions.progress import UNAVAILABLE, human_duration
from ddpjob_operator.decisions.samples import RankSample

Row = list[str]
NONE = "-"


# --- small formatters -----------------------------------------------------------------------------

def age(timestamp: str | None, now: dt.datetime) -> str:
    """'4m10s' since an RFC 3339 time (as `kubectl get` shows AGE); '-' when unknown."""
    t = objmeta.parse_time(timestamp)
    if t is None:
        return NONE
    return human_duration((now - t).total_seconds())


def _num(value: Any, fmt: str = "{:.4g}") -> str:
    if value is None or value == "":
        return NONE
    try:
        return fmt.format(float(value))
    except (TypeError, ValueError):
        return str(value)


def table(headers: list[str], rows: Iterable[Row]) -> str:
    """Columns padded like kubectl's (3 spaces), no trailing blanks; '' ends without a newline."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows if i < len(r)]) for i, h in enumerate(headers)]
    lines = ["   ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [headers, *rows]]
    return "\n".join(lines) + "\n"


def status_of(job: dict[str, Any]) -> dict[str, Any]:
    return job.get("status") or {}


def phase_of(job: dict[str, Any]) -> str:
    """The job's phase as the API shows it; 'Pending' before the operator wrote one."""
    return str(status_of(job).get("phase") or Phase.PENDING.value)


def one_line(text: Any, limit: int = 200) -> str:
    """A message squeezed onto one line (conditions and events may hold tracebacks)."""
    s = " ".join(str(text or "").split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


# --- list / get -----------------------------------------------------------------------------------

LIST_HEADERS = ["NAME", "PHASE", "READY", "PROGRESS", "LOSS", "SAMPLES/S", "RESTARTS", "GOODPUT", "AGE"]
WIDE_HEADERS = ["ETA", "ATTEMPT", "ACCURACY", "REASON"]


def list_rows(jobs: list[dict[str, Any]], now: dt.datetime, *, wide: bool = False,
              all_namespaces: bool = False) -> tuple[list[str], list[Row]]:
    """(headers, rows) of `ddpjob list` / `ddpjob get NAME`: one row per job, sorted by namespace and name."""
    headers = (["NAMESPACE"] if all_namespaces else []) + LIST_HEADERS + (WIDE_HEADERS if wide else [])
    rows = []
    for job in sorted(jobs, key=lambda j: (meta(j).get("namespace") or "", meta(j).get("name") or "")):
        st = status_of(job)
        prog = st.get("progress") or {}
        row = ([meta(job).get("namespace") or ""] if all_namespaces else []) + [
            meta(job).get("name") or "", phase_of(job), (st.get("nodes") or {}).get("ready") or NONE,
            prog.get("display") or NONE, _num(prog.get("loss")), _num(prog.get("samplesPerSecond"), "{:.1f}"),
            str(st.get("restarts") or 0), (st.get("goodput") or {}).get("display") or NONE,
            age(meta(job).get("creationTimestamp"), now)]
        if wide:
            row += [prog.get("eta") or NONE, str(st.get("attempt", NONE)),
                    _num((st.get("result") or {}).get("evalAccuracy") or prog.get("evalAccuracy")),
                    st.get("reason") or NONE]
        rows.append(row)
    return headers, rows


def as_list(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The jobs as one API list object, for -o json|yaml (what `kubectl get -o json` prints)."""
    return {"apiVersion": "v1", "kind": "List", "items": jobs}


def dump(obj: Any, fmt: str) -> str:
    """-o json|yaml."""
    if fmt == "json":
        return json.dumps(obj, indent=2, sort_keys=False) + "\n"
    import yaml

    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)


# --- per-rank table (describe, top) ---------------------------------------------------------------

def current_attempt(job: dict[str, Any], pods: list[dict[str, Any]]) -> int:
    """status.attempt, else the newest attempt among the pods (0 when neither says)."""
    att = status_of(job).get("attempt")
    if att is not None:
        return int(att)
    return max(Group.of(pods).attempts, default=0)


def _flags(job: dict[str, Any], key: str, what: str) -> tuple[str, ...]:
    """("straggler", "stalled"): which True Straggler/Stalled conditions name the pod (what="pod")
    or global rank (what="rank") `key` (the monitor's message names each rank and its pod:
    'rank 3 (pod job-1 on node n7)'). Conditions are a map by type (the CRD's list type)."""
    pattern = {"pod": r"\bpod ([a-z0-9][-a-z0-9.]*[a-z0-9])", "rank": r"\brank (\d+)"}[what]
    naming = {cond.get("type") for cond in status_of(job).get("conditions") or []
              if cond.get("status") == "True" and key in re.findall(pattern, str(cond.get("message") or ""))}
    return tuple(flag for flag, kind in (("straggler", Signal.STRAGGLER), ("stalled", Signal.STALLED)) if kind in naming)


@dataclass(frozen=True)
class RankRow:
    """One node rank of the current attempt: its pod (None: not created, or gone)."""

    rank: int
    pod: str
    node: str
    phase: str
    ready: str
    restarts: int
    exit_code: int | None
    started: str
    flags: tuple[str, ...]   # "straggler", "stalled"

    def cells(self, now: dt.datetime) -> Row:
        return [str(self.rank), self.pod or NONE, self.node or NONE, self.phase, self.ready, str(self.restarts),
                NONE if self.exit_code is None else str(self.exit_code), age(self.started or None, now),
                ",".join(self.flags) or NONE]

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "pod": self.pod or None, "node": self.node or None, "phase": self.phase,
                "ready": self.ready, "restarts": self.restarts, "exitCode": self.exit_code,
                "startTime": self.started or None, "flags": list(self.flags)}


RANK_HEADERS = ["RANK", "POD", "NODE", "PHASE", "READY", "RESTARTS", "EXIT", "AGE", "FLAGS"]


def rank_rows(job: dict[str, Any], pods: list[dict[str, Any]]) -> list[RankRow]:
    """One row per node rank 0..spec.nodes-1 of the current attempt (a rank without a pod shows
    phase '-'), then any pod of that attempt with a rank beyond (an elastic job shrinking)."""
    attempt = current_attempt(job, pods)
    at = Group.of(pods).at(attempt)
    # Each rank's newest pod (a lost pod's replacement), while it is not being deleted.
    mine = {r: p for r, p in at.by_rank.items() if not podinfo.terminating(p)}
    nodes = int((job.get("spec") or {}).get("nodes") or 0)
    rows = []
    for rank in sorted(set(range(nodes)) | set(mine)):
        pod = mine.get(rank)
        if pod is None:
            rows.append(RankRow(rank, "", "", NONE, NONE, 0, None, "", ()))
            continue
        name = podinfo.name(pod)
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        ready = f"{sum(1 for c in statuses if c.get('ready'))}/{len((pod.get('spec') or {}).get('containers') or [])}"
        rows.append(RankRow(rank=rank, pod=name, node=(pod.get("spec") or {}).get("nodeName") or "",
                            phase=podinfo.phase(pod), ready=ready,
                            restarts=sum(int(c.get("restartCount") or 0) for c in statuses),
                            exit_code=podinfo.exit_code(pod), started=(pod.get("status") or {}).get("startTime") or "",
                            flags=_flags(job, name, "pod")))
    return rows


# --- describe -------------------------------------------------------------------------------------

def spec_summary(job: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, value) lines of what the job runs, for `describe`."""
    js = from_manifest(job)
    out = [("Nodes", str(js.spec.nodes)), ("Processes per node", str(js.nproc_per_node)),
           ("GPUs per node", str(js.spec.gpus_per_node)), ("World size", str(js.world_size)), ("Image", js.spec.image)]
    if js.uses_builtin_trainer:
        t = js.trainer
        what = ", ".join(f"{k} {t[k]}" for k in ("dataset", "model", "epochs", "batchSize", "lr") if k in t)
        out.append(("Trainer", f"built-in ({what})" if what else "built-in"))
        ckpt = (t.get("checkpoint") or {}).get("dir")
        if ckpt:
            out.append(("Checkpoints", str(ckpt)))
    else:
        out.append(("Command", " ".join(map(str, (js.command or []) + (js.args or [])))))
    mlflow = js.trainer.get("mlflow")
    if mlflow is not None:
        uri = (mlflow or {}).get("trackingUri")
        out.append(("MLflow", (public_uri(str(uri)) if uri else "the operator's default tracking URI")
                    + f", experiment {(mlflow or {}).get('experiment') or MLFLOW_DEFAULT_EXPERIMENT}"))
    out.append(("Max restarts", str(js.spec.failure_policy.max_restarts)))
    if js.spec.suspend:
        out.append(("Suspend", "true"))
    for value, label in ((js.spec.active_deadline_seconds, "Deadline (s)"),
                         (js.spec.ttl_seconds_after_finished, "TTL after finish (s)")):
        if value is not None:
            out.append((label, str(value)))
    return out


def events_of(job: dict[str, Any], events: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events about the job or its pods, oldest first."""
    names = {meta(job).get("name")} | {podinfo.name(p) for p in pods}
    uid = meta(job).get("uid")

    def about(e: dict[str, Any]) -> bool:
        inv = e.get("involvedObject") or e.get("regarding") or {}
        if inv.get("kind") == KIND:
            return inv.get("name") == meta(job).get("name") and (not uid or not inv.get("uid") or inv.get("uid") == uid)
        return inv.get("kind") == "Pod" and inv.get("name") in names

    def when(e: dict[str, Any]) -> str:
        return str(e.get("lastTimestamp") or e.get("eventTime") or meta(e).get("creationTimestamp") or "")

    return sorted((e for e in events if about(e)), key=when)


def describe_data(job: dict[str, Any], events: list[dict[str, Any]], pods: list[dict[str, Any]],
                  now: dt.datetime, *, max_events: int = 20, samples: Mapping[int, RankSample] | None = None,
                  notes: Iterable[str] = ()) -> dict[str, Any]:
    """Everything `describe` shows, as plain data (what -o json|yaml prints); with `samples`
    (`--live`, as `top --live` reads them) every process's own numbers, and `notes` on pods not read."""
    st = status_of(job)
    evs = events_of(job, events, pods)[-max_events:]
    live: dict[str, Any] = {} if samples is None else {
        "processes": [dict(zip(PROCESS_HEADERS, cells)) for cells, _ in process_rows(job, samples)],
        "notes": list(notes)}
    return {**live,
        "name": meta(job).get("name"), "namespace": meta(job).get("namespace"),
        "created": meta(job).get("creationTimestamp"),
        "spec": dict(spec_summary(job)),
        "phase": phase_of(job), "reason": st.get("reason"), "message": st.get("message"),
        "attempt": st.get("attempt"), "restarts": st.get("restarts", 0), "countedRestarts": st.get("countedRestarts", 0),
        "maxRestarts": from_manifest(job).spec.failure_policy.max_restarts,
        "masterAddr": st.get("masterAddr"), "startTime": st.get("startTime"), "completionTime": st.get("completionTime"),
        "progress": st.get("progress") or {}, "result": st.get("result") or {}, "mlflow": st.get("mlflow") or {},
        "goodput": {k: v for k, v in (st.get("goodput") or {}).items() if k != "accounting"},
        "conditions": list(st.get("conditions") or []),
        "ranks": [r.as_dict() for r in rank_rows(job, pods)],
        "failures": list(st.get("failures") or []),
        "culprits": culprits(st),
        "events": [{"type": e.get("type"), "reason": e.get("reason"), "message": e.get("message"),
                    "object": f"{(e.get('involvedObject') or {}).get('kind', '')}/{(e.get('involvedObject') or {}).get('name', '')}",
                    "time": e.get("lastTimestamp") or e.get("eventTime") or meta(e).get("creationTimestamp"),
                    "count": e.get("count") or 1} for e in evs],
    }


def culprits(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The culprit of each in-place restart its stacks named (status.restartHistory[].culprit)."""
    return [{"attempt": e.get("attempt"), "restart": e.get("restart"),
             **{k: c.get(k) for k in ("rank", "pod", "node", "waitingIn", "frames")}}
            for e in status.get("restartHistory") or [] if (c := e.get("culprit"))]


def progress_line(progress: dict[str, Any]) -> str:
    """'step 420/1000 (42%), epoch 3, loss 0.412, 812.5 samples/s, ETA 4m10s' from what is known."""
    parts = []
    if progress.get("step") is not None:
        total = progress.get("totalSteps")
        parts.append(f"step {progress['step']}" + (f"/{total}" if total else "")
                     + (f" ({float(progress['percent']):.0f}%)" if progress.get("percent") is not None else ""))
    for key, label in (("epoch", "epoch {}"), ("loss", "loss {:.4g}"), ("samplesPerSecond", "{:.1f} samples/s"),
                       ("eta", "ETA {}"), ("evalAccuracy", "eval accuracy {:.4g}")):
        if progress.get(key) is not None:
            parts.append(label.format(progress[key]))
    if progress.get(UNAVAILABLE):
        parts.append(f"unavailable: {one_line(progress[UNAVAILABLE], 200)}")
    return ", ".join(parts)


def describe_text(data: dict[str, Any], now: dt.datetime) -> str:
    """`ddpjob describe NAME` from describe_data."""
    out: list[str] = []

    def field(label: str, value: Any) -> None:
        if value not in (None, ""):
            out.append(f"{label + ':':<22}{value}")

    field("Name", data["name"])
    field("Namespace", data["namespace"])
    field("Created", f"{data['created']} ({age(data['created'], now)} ago)" if data.get("created") else None)
    out.append("Spec:")
    for k, v in data["spec"].items():
        out.append(f"  {k + ':':<20}{v}")
    field("Phase", data["phase"] + (f" ({data['reason']})" if data.get("reason") else ""))
    field("Message", one_line(data.get("message"), 400))
    field("Attempt", data.get("attempt"))
    field("Restarts", f"{data['restarts']} ({data['countedRestarts']}/{data['maxRestarts']} of the budget)")
    field("Master", data.get("masterAddr"))
    field("Started", data.get("startTime"))
    field("Completed", data.get("completionTime"))
    field("Progress", progress_line(data["progress"]))
    field("Goodput", goodput.summary(data.get("goodput")))
    run = data.get("mlflow") or {}
    field("MLflow run", " ".join(str(run[k]) for k in ("runId", "url") if run.get(k)))
    res = data.get("result") or {}
    if res:
        field("Result", ", ".join(f"{k} {v}" for k, v in res.items()))
    out.append("")
    out.append("Conditions:")
    out.append(_block(["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"],
                      [[c.get("type", ""), c.get("status", ""), c.get("reason") or NONE,
                        age(c.get("lastTransitionTime"), now), one_line(c.get("message"), 160) or NONE]
                       for c in data["conditions"]]))
    out.append(f"Ranks (attempt {data.get('attempt') if data.get('attempt') is not None else NONE}):")
    out.append(_block(RANK_HEADERS, [RankRow(r["rank"], r["pod"] or "", r["node"] or "", r["phase"], r["ready"],
                                             r["restarts"], r["exitCode"], r["startTime"] or "",
                                             tuple(r["flags"])).cells(now) for r in data["ranks"]]))
    if "processes" in data:
        out.append("Processes (live):")
        out.append(_block(PROCESS_HEADERS, [[str(p.get(h, NONE)) for h in PROCESS_HEADERS] for p in data["processes"]],
                          empty="  no process reported metrics yet"))
        out += [f"  {note}" for note in data.get("notes") or []]
    out.append("Failures (earlier attempts):")
    out.append(_block(["ATTEMPT", "RANK", "POD", "NODE", "EXIT", "REASON", "FINISHED", "LAST LINE"],
                      [[str(f.get("attempt", NONE)), str(f.get("rank", NONE)), f.get("pod") or NONE,
                        f.get("node") or NONE, failure_cause(f), f.get("reason") or NONE,
                        f.get("finishedAt") or NONE, last_line(f.get("logTail")) or NONE]
                       for f in data["failures"]]))
    if data.get("culprits"):  # only once a restart's stacks named one
        out.append(f"Culprits (by the ranks' captured stacks; every stack: ddpjob logs {data['name']} --stacks):")
        out.append(_block(["ATTEMPT", "RESTART", "RANK", "POD", "NODE", "OTHERS WAIT IN", "FRAMES"],
                          [[str(c["attempt"]), str(c["restart"]), str(c["rank"]), c["pod"] or NONE,
                            c["node"] or NONE, c["waitingIn"] or NONE, c["frames"] or NONE]
                           for c in data["culprits"]]))
    out.append("Events:")
    out.append(_block(["TYPE", "REASON", "AGE", "OBJECT", "MESSAGE"],
                      [[e.get("type") or NONE, e.get("reason") or NONE,
                        age(e.get("time"), now) + (f" (x{e['count']})" if e.get("count", 1) > 1 else ""),
                        e["object"], one_line(e.get("message"), 160)] for e in data["events"]]))
    return "\n".join(out).rstrip("\n") + "\n"


def _block(headers: list[str], rows: list[Row], *, empty: str = "  <none>") -> str:
    """A describe section's table, indented under its heading; `empty` when it has no rows."""
    if not rows:
        return empty
    return "\n".join("  " + line for line in table(headers, rows).rstrip("\n").splitlines())


def failure_cause(f: dict[str, Any]) -> str:
    """'137 (signal 9)' / '78 (bad config)' / '1'."""
    code = f.get("exitCode")
    if code is None:
        return NONE
    if f.get("signal"):
        return f"{code} (signal {f['signal']})"
    if int(code) == podinfo.EXIT_BAD_CONFIG:
        return f"{code} (bad config)"
    return str(code)


def last_line(text: Any) -> str:
    """The last non-empty line of a log tail (the error, usually)."""
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    return one_line(lines[-1], 120) if lines else ""


# --- wait -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """How `wait` ends: exit code and the line to print."""

    code: int
    message: str


WAIT_REACHED, WAIT_OTHER_END, WAIT_TIMEOUT = 0, 1, 2


def wait_outcome(job: dict[str, Any] | None, want: Iterable[Phase], *, name: str = "") -> Outcome | None:
    """Outcome once the job is in a wanted phase (0) or in a terminal phase that is not wanted,
    or gone (1); None: keep waiting."""
    wanted = set(want)
    if job is None:
        return Outcome(WAIT_OTHER_END, f"DDPJob {name} was deleted")
    name = meta(job).get("name") or name
    phase = Phase.parse(status_of(job).get("phase")) or Phase.PENDING
    if phase in wanted:
        return Outcome(WAIT_REACHED, f"{name} {phase.value}")
    if phase.finished:
        st = status_of(job)
        why = ": ".join(str(x) for x in (st.get("reason"), one_line(st.get("message"), 300)) if x)
        return Outcome(WAIT_OTHER_END, f"{name} is {phase.value}, not {'|'.join(sorted(p.value for p in wanted))}"
                       + (f" ({why})" if why else ""))
    return None


# --- top --------------------------------------------------------------------------------------------

PROCESS_HEADERS = ["RANK", "NODE RANK", "POD", "STAGE", "STEP", "LOSS", "SAMPLES/S", "STEP MS", "DATA WAIT MS",
                   "GPU MEM GiB", "FLAGS"]


def _per_step(total: float, count: float) -> str:
    return _num(1000 * total / count, "{:.1f}") if count > 0 else NONE


def process_rows(job: dict[str, Any], samples: Mapping[int, RankSample]) -> list[tuple[Row, bool]]:
    """(cells, flagged) per training process from its pod's metrics (`top --live`): its stage,
    step, loss, own samples/s over its stepping time, mean step and data-wait time per step, GPU
    memory; flagged when the Straggler/Stalled condition names its rank."""
    out = []
    for rank in sorted(samples):
        s = samples[rank]
        flags = _flags(job, str(rank), "rank")
        rate = s.samples_total / s.step_seconds_sum if s.step_seconds_sum > 0 else None
        gpu = None if s.gpu_memory_allocated_bytes is None else s.gpu_memory_allocated_bytes / 2**30
        out.append(([str(rank), NONE if s.node_rank is None else str(s.node_rank), s.pod or NONE, s.stage or NONE,
                     NONE if s.step is None else str(s.step), _num(s.loss), _num(rate, "{:.1f}"),
                     _per_step(s.step_seconds_sum, s.step_seconds_count),
                     _per_step(s.data_wait_seconds_total, s.step_seconds_count), _num(gpu, "{:.2f}"),
                     ",".join(flags) or NONE], bool(flags)))
    return out


def _styled(text: str, rows_flagged: list[bool], color: bool) -> list[str]:
    """A table's lines, the flagged rows in bold red when `color`."""
    lines = text.rstrip("\n").splitlines()
    if not color:
        return lines
    import click

    return [lines[0]] + [click.style(line, fg="red", bold=True) if flagged else line
                         for line, flagged in zip(lines[1:], rows_flagged)]


def top_text(job: dict[str, Any], pods: list[dict[str, Any]], now: dt.datetime, *, color: bool = False,
             samples: Mapping[int, RankSample] | None = None, notes: Iterable[str] = ()) -> str:
    """The `top` screen: the job's line, its progress, the per-rank table of pods with the ones a
    Straggler or Stalled condition names marked (and in colour on a terminal); with `samples`
    (`--live`), a table of every process's own numbers below, and `notes` (pods not read)."""
    st = status_of(job)
    head = f"{meta(job).get('namespace')}/{meta(job).get('name')}  {phase_of(job)}"
    if st.get("attempt") is not None:
        head += f"  attempt {st['attempt']}"
    head += f"  restarts {st.get('restarts', 0)}  ready {(st.get('nodes') or {}).get('ready') or NONE}"
    lines = [head]
    prog = progress_line(st.get("progress") or {})
    if prog:
        lines.append(prog)
    spent = goodput.summary(st.get("goodput"))
    if spent:
        lines.append(f"goodput {spent}")
    for cond in st.get("conditions") or []:
        if cond.get("type") in (Signal.STRAGGLER, Signal.STALLED) and cond.get("status") == "True":
            lines.append(f"{cond['type']}: {one_line(cond.get('message'), 300)}")
    lines.append("")
    rows = rank_rows(job, pods)
    lines += _styled(table(RANK_HEADERS, [r.cells(now) for r in rows]), [bool(r.flags) for r in rows], color)
    if samples is not None:
        procs = process_rows(job, samples)
        lines.append("")
        if procs:
            lines += _styled(table(PROCESS_HEADERS, [cells for cells, _ in procs]), [f for _, f in procs], color)
        else:
            lines.append("no process reported metrics yet")
    lines += list(notes)
    return "\n".join(lines) + "\n"


# --- logs -------------------------------------------------------------------------------------------

def every_rank(job: dict[str, Any], pods: list[dict[str, Any]], *, rank: int | None, all_ranks: bool,
               attempt: int | None) -> bool:
    """True when `logs` shows every rank it finds, each line prefixed: --all-ranks, or an earlier
    attempt without --rank (what it kept are its failed ranks' pods)."""
    return all_ranks or (rank is None and attempt is not None and attempt != current_attempt(job, pods))


def log_pods(job: dict[str, Any], pods: list[dict[str, Any]], *, rank: int | None, all_ranks: bool,
             attempt: int | None) -> list[tuple[int, str]]:
    """(rank, pod name) whose logs to show: the given attempt's (default: the current one), every
    rank or one (default rank 0), among the pods that still exist."""
    att = current_attempt(job, pods) if attempt is None else attempt
    mine = sorted((podinfo.rank(p), podinfo.name(p)) for p in Group.of(pods).at(att).pods)
    if all_ranks:
        return mine
    want = 0 if rank is None else rank
    return [(r, n) for r, n in mine if r == want]


def running_pods(job: dict[str, Any], pods: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(rank, pod name) of the current attempt's running pods."""
    return sorted((podinfo.rank(p), podinfo.name(p)) for p in Group.of(pods).at(current_attempt(job, pods)).pods
                  if podinfo.phase(p) == "Running")


def kept_tails(job: dict[str, Any], *, attempt: int, rank: int | None, all_ranks: bool) -> list[tuple[int, str]]:
    """(rank, log tail) that status.failures kept of an attempt whose pods are gone (the tails are
    there with spec.failurePolicy.logTailInStatus): the given rank's, else every failed rank's."""
    return [(int(f.get("rank", -1)), str(f["logTail"])) for f in status_of(job).get("failures") or []
            if f.get("attempt") == attempt and f.get("logTail") and (rank is None or all_ranks or f.get("rank") == rank)]


def restart_lines(lines: Iterable[str], restart: int) -> Iterator[str]:
    """One start of a pod's workers out of its log: from the launcher's marker line for that start
    (contract.INPLACE_MARKER, `==> ddpjob: attempt A restart R <==`, R = 0 for the first start) to
    the next marker. Restarts in place share a pod, so this is how an in-place attempt's output is
    found on its own."""
    inside = False
    for line in lines:
        marker = INPLACE_MARKER_RE.match(line.strip())
        if marker is not None:
            inside = int(marker.group(2)) == restart
        if inside:
            yield line


def prefixed(rank: int, line: str) -> str:
    """A log line with its rank in front, for --all-ranks."""
    return f"[rank {rank}] {line}"


# --- errors -----------------------------------------------------------------------------------------

def _status_body(body: Any) -> dict[str, Any]:
    """An API error's body as its Status dict ({} when it is none: a plain-text 404 page)."""
    data = objmeta.error_body(body)
    return data if data.get("kind") == "Status" else {}


def missing_object(code: int | None, body: Any) -> bool:
    """True for a 404 about a named object (the resource is served); False for a 404 on the
    resource itself (its CRD is not installed: the API server answers with a plain 404 page)."""
    return code == 404 and bool((_status_body(body).get("details") or {}).get("name"))


def api_error(code: int | None, body: Any, *, name: str | None, namespace: str | None, verb: str) -> str:
    """One line naming what went wrong and what to do, from an API error's status and body."""
    data = _status_body(body)
    msg = one_line(data.get("message") or "", 300)
    where = f" in namespace {namespace}" if namespace else ""
    if code == 404:
        details = data.get("details") or {}
        if missing_object(code, body) and details.get("kind") == PLURAL:
            return f'DDPJob "{details["name"]}" not found{where}: `ddpjob list{" -n " + namespace if namespace else ""}` shows the jobs there'
        if missing_object(code, body):
            return f"{details.get('kind')} \"{details['name']}\" not found{where}"
        return ("the DDPJob resource (ddpjobs.ddpjob.dev) is not installed on this cluster: install the operator "
                "(helm install ddpjob charts/ddpjob-operator, or kubectl apply --server-side -f manifests/)")
    if code == 403:
        return (f"forbidden: {msg or f'you may not {verb} ddpjobs' + where}; ask a cluster admin for RBAC "
                f"on ddpjobs.ddpjob.dev (kubectl auth can-i {verb} ddpjobs{' -n ' + namespace if namespace else ''})")
    if code == 401:
        return "unauthorized: the API server rejected the kubeconfig's credentials (log in again or fix --context)"
    if code == 409:
        return f"{msg or 'conflict'}: delete it first (ddpjob delete {name}) or choose another name"
    if code == 422:
        return f"the API server refused the DDPJob: {msg}"
    if code == 400 and msg:   # e.g. a log asked of a container that has not started: the API says which
        return msg
    return f"the API server answered {code}{': ' + msg if msg else ''}"
