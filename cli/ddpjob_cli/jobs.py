"""The cluster commands: `ddpjob list/get/describe/wait/top/logs/stacks/submit/delete/suspend/resume`.

Thin: each reads through `kube.Kube`, hands plain dicts to a `views` builder and prints what it
returns. A failure is one line on stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import datetime as dt
import functools
import queue
import shutil
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import click

from ddpjob_api import contract
from ddpjob_api.phases import Phase
from ddpjob_operator.decisions import stacks as captured_stacks

from . import views
from .kube import CliError, Kube

OUTPUTS = ("json", "yaml")


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def cluster_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """kubectl's connection flags (--kubeconfig, --context, -n), and CliError as one line + exit code."""
    @click.option("--kubeconfig", default=None, metavar="FILE",
                  help="Kubeconfig file (default: $KUBECONFIG, else ~/.kube/config).")
    @click.option("--context", default=None, help="Kubeconfig context (default: its current-context).")
    @click.option("--namespace", "-n", default=None, help="Namespace (default: the context's, else default).")
    @functools.wraps(fn)
    def wrapper(kubeconfig, context, namespace, **kwargs):
        try:
            kube = Kube(kubeconfig=kubeconfig, context=context, namespace=namespace)
            try:
                return fn(kube, **kwargs)
            finally:
                kube.close()
        except CliError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.code)
        except KeyboardInterrupt:
            sys.exit(130)
    return wrapper


class CtrlC:
    """Ctrl-C for the refreshing commands (top, wait): a KeyboardInterrupt at once, as Python raises
    it (it interrupts a request in flight), and a flag their loop's sleep reads. The raise alone can
    be lost: one inside a finalizer or weakref callback (the API client's objects, churned by every
    refresh) is printed as "Exception ignored" and dropped, and the loop would refresh on; the flag
    ends it at its next sleep. An ignored SIGINT (a background job's) stays ignored."""

    def __init__(self) -> None:
        self.pressed = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> "CtrlC":
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, _signum: int, _frame: object) -> None:
        self.pressed.set()
        raise KeyboardInterrupt

    def sleep(self, seconds: float) -> None:
        """Sleep up to `seconds`: KeyboardInterrupt (the command's exit 130) as soon as Ctrl-C was
        pressed, now or before (during a request, say)."""
        if self.pressed.wait(max(0.0, seconds)):
            raise KeyboardInterrupt


def output_option(choices: tuple[str, ...] = OUTPUTS) -> Callable[..., Any]:
    return click.option("--output", "-o", type=click.Choice(choices), default=None,
                        help="Print the object(s) as " + "|".join(choices) + " instead of a table.")


def _echo_table(headers: list[str], rows: list[list[str]]) -> None:
    click.echo(views.table(headers, rows), nl=False)


@click.command("list")
@cluster_command
@click.option("--all-namespaces", "-A", is_flag=True, help="Jobs of every namespace.")
@output_option(("wide", *OUTPUTS))
def list_cmd(kube: Kube, all_namespaces: bool, output: str | None) -> None:
    """List DDPJobs: phase, progress, loss, samples/s, restarts, age."""
    if all_namespaces and kube.namespace_given:
        raise click.UsageError("--namespace and --all-namespaces exclude each other")
    jobs = kube.list_jobs(all_namespaces=all_namespaces)
    if output in OUTPUTS:
        click.echo(views.dump(views.as_list(jobs), output), nl=False)
        return
    if not jobs:
        click.echo("No DDPJobs found" + ("" if all_namespaces else f" in namespace {kube.namespace}") + ".", err=True)
        return
    _echo_table(*views.list_rows(jobs, now(), wide=output == "wide", all_namespaces=all_namespaces))


@click.command()
@cluster_command
@click.argument("name")
@output_option(("wide", *OUTPUTS))
def get(kube: Kube, name: str, output: str | None) -> None:
    """Show one DDPJob: a table row, or the whole object with -o json|yaml."""
    job = kube.get_job(name)
    if output in OUTPUTS:
        click.echo(views.dump(job, output), nl=False)
        return
    _echo_table(*views.list_rows([job], now(), wide=output == "wide"))


@click.command()
@cluster_command
@click.argument("name")
@click.option("--live", is_flag=True,
              help="Also each process's own numbers (stage, step, samples/s, step and data-wait time, GPU memory), "
                   "read as `top --live` reads them (needs get on pods/proxy).")
@output_option()
def describe(kube: Kube, name: str, live: bool, output: str | None) -> None:
    """Spec, phase, conditions, per-rank pods, failed attempts and recent events of a DDPJob."""
    job = kube.get_job(name)
    pods = kube.pods(name)
    samples, notes = _live_samples(kube, job, pods) if live else (None, [])
    data = views.describe_data(job, kube.events(), pods, now(), samples=samples, notes=notes)
    click.echo(views.dump(data, output) if output else views.describe_text(data, now()), nl=False)


def _phases(values: tuple[str, ...]) -> set[Phase]:
    by_name = {p.value.lower(): p for p in Phase}
    out = set()
    for v in (x for value in values for x in value.split(",") if x):
        if v.lower() not in by_name:
            raise click.BadParameter(f"{v!r}: one of {', '.join(p.value for p in Phase)}", param_hint="--for")
        out.add(by_name[v.lower()])
    return out


class _Bar:
    """A tqdm bar of steps on a terminal (nothing elsewhere)."""

    def __init__(self, enabled: bool, name: str):
        self.enabled, self.name = enabled, name
        self.bar: Any = None

    def update(self, job: dict[str, Any]) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        prog = views.status_of(job).get("progress") or {}
        total, step = prog.get("totalSteps"), prog.get("step")
        if self.bar is None:
            # A terminal that reports no width (a fresh pty) would get an empty bar: 80 columns then.
            width = shutil.get_terminal_size((0, 0)).columns
            self.bar = tqdm(total=total, desc=self.name, unit="step", file=sys.stdout, leave=True,
                            dynamic_ncols=width > 0, ncols=None if width > 0 else 80)
        if total and self.bar.total != total:
            self.bar.total = total
        if step is not None and step < self.bar.n:   # a restart resumed from an earlier checkpoint
            self.bar.reset(total=self.bar.total)
        if step is not None:
            self.bar.update(step - self.bar.n)
        post = {"phase": views.phase_of(job)}
        if prog.get("loss") is not None:
            post["loss"] = f"{float(prog['loss']):.4g}"
        if prog.get("eta"):
            post["eta"] = prog["eta"]
        self.bar.set_postfix(post, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@click.command()
@cluster_command
@click.argument("name")
@click.option("--for", "for_", multiple=True, default=(Phase.SUCCEEDED.value,), show_default=True,
              metavar="PHASE[,PHASE]", help="Phase(s) to wait for: " + "|".join(p.value for p in Phase) + ".")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds; 0 = check once.")
@click.option("--interval", type=float, default=1.0, hidden=True, help="Seconds between reads.")
@output_option()
def wait(kube: Kube, name: str, for_: tuple[str, ...], timeout: float, interval: float, output: str | None) -> None:
    """Wait until a DDPJob reaches a phase. Exit 0 when it does, 1 when it ends in another phase
    (or is deleted), 2 on timeout. A progress bar on a terminal."""
    want = _phases(for_)
    deadline = time.monotonic() + timeout
    job: dict[str, Any] | None = kube.get_job(name)   # a job that does not exist is an error at once
    bar = _Bar(sys.stdout.isatty() and output is None, name)
    try:
        with CtrlC() as ctrl_c:
            while True:
                outcome = views.wait_outcome(job, want, name=name)
                if job is not None:
                    bar.update(job)
                if outcome is not None or time.monotonic() >= deadline:
                    break
                ctrl_c.sleep(min(interval, max(0.0, deadline - time.monotonic())))
                try:
                    job = kube.find_job(name)
                except CliError as exc:  # a blip of the API server: keep waiting until the deadline
                    click.echo(f"warning: {exc}", err=True)
    finally:
        bar.close()
    if outcome is None:
        phase = views.phase_of(job) if job else "?"
        outcome = views.Outcome(views.WAIT_TIMEOUT, f"timed out after {timeout:g}s waiting for {name} to be "
                                f"{'|'.join(sorted(p.value for p in want))} (it is {phase})")
    if output:
        click.echo(views.dump({"name": name, "phase": views.phase_of(job) if job else None,
                               "exitCode": outcome.code, "message": outcome.message}, output), nl=False)
    else:
        click.echo(outcome.message, err=outcome.code != views.WAIT_REACHED)
    sys.exit(outcome.code)


@click.command()
@cluster_command
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@output_option()
def submit(kube: Kube, file: str, output: str | None) -> None:
    """Validate the DDPJob in FILE (the API server's schema and rules, and the trainer's config, as
    `ddpjob run --local` does) and create it; print its name."""
    from .local import LocalRunError, load_job_file, validate

    try:
        obj = load_job_file(file)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and not meta.get("generateName"):
            raise CliError(f"{file}: metadata.name (or generateName) is missing")
        validate(dict(obj, metadata=dict(meta, name=meta.get("name") or meta["generateName"] + "x")))
    except LocalRunError as exc:
        raise CliError(str(exc)) from None
    if meta.get("namespace") and meta["namespace"] != kube.namespace:
        if kube.namespace_given:
            raise CliError(f"{file} names namespace {meta['namespace']}, -n says {kube.namespace}: drop one")
        kube.namespace = meta["namespace"]
    created = kube.create_job(obj)
    click.echo(views.dump(created, output) if output else views.meta(created).get("name"), nl=not output)


@click.command()
@cluster_command
@click.argument("name")
def delete(kube: Kube, name: str) -> None:
    """Delete a DDPJob (its pods and Service go with it)."""
    kube.delete_job(name)
    click.echo(f"ddpjob {name} deleted")


def _suspend_command(verb: str, done: str, value: bool, doc: str) -> click.Command:
    """`suspend NAME` / `resume NAME`: spec.suspend set to `value`."""
    @click.command(verb, help=doc)
    @cluster_command
    @click.argument("name")
    def command(kube: Kube, name: str) -> None:
        kube.patch_spec(name, {"suspend": value})
        click.echo(f"ddpjob {name} {done}")
    return command


suspend = _suspend_command("suspend", "suspended", True,
                           "Suspend a DDPJob: its pods are deleted, the job stays (phase Suspended).")
resume = _suspend_command("resume", "resumed", False,
                          "Resume a suspended DDPJob: a fresh attempt starts from its newest checkpoint.")


@click.command()
@cluster_command
@click.argument("name")
@click.option("--rank", type=int, default=None, help="Node rank whose pod to show (default 0).")
@click.option("--all-ranks", is_flag=True, help="Every rank's pod, each line prefixed [rank N].")
@click.option("--attempt", type=int, default=None,
              help="An attempt's pods (default: the current one): an earlier attempt's ended pods stay "
                   "(spec.failurePolicy.keepFailedAttempts), each rank's lines prefixed unless --rank; once "
                   "they are gone, the failed ranks' log tails kept in the status "
                   "(spec.failurePolicy.logTailInStatus).")
@click.option("--restart", type=int, default=None,
              help="Only the lines of one start of the workers within the attempt's pods: 0 the first, R the "
                   "R-th restart in place (from the launcher's marker line `==> ddpjob: attempt A restart R <==` "
                   "to the next; --tail counts lines before this filter).")
@click.option("--follow", "-f", is_flag=True, help="Stream until the containers end.")
@click.option("--tail", type=int, default=None, help="Lines from the end of each log.")
@click.option("--stacks", is_flag=True,
              help="Instead of logs: every rank's Python stack its pod's agent captured at a hang or a failure "
                   f"(kept in ConfigMap NAME{contract.stacks_configmap('')}, after the pods are gone too); "
                   "--attempt and --restart select, --rank keeps one global rank's.")
def logs(kube: Kube, name: str, rank: int | None, all_ranks: bool, attempt: int | None, restart: int | None,
         follow: bool, tail: int | None, stacks: bool) -> None:
    """The trainer container's log of a rank's pod (through the API server)."""
    if rank is not None and all_ranks:
        raise click.UsageError("--rank and --all-ranks exclude each other")
    if stacks:
        if follow or tail is not None:
            raise click.UsageError("--stacks prints what was captured: no --follow or --tail")
        kube.get_job(name)  # a job that does not exist is said so, not its ConfigMap
        try:
            data = kube.configmap(contract.stacks_configmap(name)).get("data") or {}
        except CliError as exc:
            if not exc.missing:
                raise
            data = {}
        captured = [text for (_, at_restart, _, of_rank), text in captured_stacks.of_attempt(data, attempt)
                    if (restart is None or at_restart == restart) and (rank is None or of_rank == rank)]
        if not captured:
            raise CliError(f"no stack of {name} captured" + (f" in attempt {attempt}" if attempt is not None else "")
                           + ": its pods' agents capture them only when a rank hangs or a worker fails "
                           f"(`ddpjob stacks {name}` takes them now)")
        for dump in captured:
            click.echo(dump, nl=False)
        return

    def read_log(pod: str, *, follow: bool = False) -> Iterator[str]:
        lines = kube.log_lines(pod, follow=follow, tail=tail)
        return lines if restart is None else views.restart_lines(lines, restart)

    job = kube.get_job(name)
    pods = kube.pods(name)
    all_ranks = views.every_rank(job, pods, rank=rank, all_ranks=all_ranks, attempt=attempt)
    chosen = views.log_pods(job, pods, rank=rank, all_ranks=all_ranks, attempt=attempt)
    if not chosen and attempt is not None:
        kept = views.kept_tails(job, attempt=attempt, rank=rank, all_ranks=all_ranks)
        if kept:
            click.echo(f"attempt {attempt}'s pods are gone: the log tails kept in status.failures", err=True)
            for r, kept_tail in kept:
                for line in kept_tail.splitlines():
                    click.echo(views.prefixed(r, line))
            return
    if not chosen:
        att = views.current_attempt(job, pods) if attempt is None else attempt
        which = "any rank" if all_ranks else f"rank {0 if rank is None else rank}"
        raise CliError(f"no pod of {which} of {name} in attempt {att} (phase {views.phase_of(job)}): its pods are "
                       f"gone or not created yet; `ddpjob describe {name}` shows what failed attempts left "
                       "(their log tails with spec.failurePolicy.logTailInStatus: true)")
    if len(chosen) == 1 and not all_ranks:
        for line in read_log(chosen[0][1], follow=follow):
            click.echo(line)
        return
    if not follow:
        for r, pod in chosen:
            for line in read_log(pod):
                click.echo(views.prefixed(r, line))
        return
    # Followed: one reader thread per pod, lines printed as they come.
    lines: queue.Queue[tuple[int, str | None, str | None]] = queue.Queue()

    def read(r: int, pod: str) -> None:
        try:
            for line in read_log(pod, follow=True):
                lines.put((r, line, None))
            lines.put((r, None, None))
        except CliError as exc:
            lines.put((r, None, str(exc)))

    for r, pod in chosen:
        threading.Thread(target=read, args=(r, pod), daemon=True).start()
    open_streams = len(chosen)
    while open_streams:
        r, text, err = lines.get()
        if text is not None:
            click.echo(views.prefixed(r, text))
            continue
        open_streams -= 1
        if err:
            click.echo(f"warning: rank {r}: {err}", err=True)


@click.command()
@cluster_command
@click.argument("name")
def stacks(kube: Kube, name: str) -> None:
    """Every rank's Python stack now, for a job that is slow but not stalled: runs
    `python -m ddpjob_trainer.stacks` in each running pod of its current attempt (pods/exec)."""
    job = kube.get_job(name)
    pods = kube.pods(name)
    running = views.running_pods(job, pods)
    if not running:
        raise CliError(f"no running pod of {name} (phase {views.phase_of(job)}): `ddpjob logs {name} --stacks` "
                       "shows the stacks captured at its hangs and failures")
    for _, pod in running:
        click.echo(kube.exec_output(pod, ["python", "-m", "ddpjob_trainer.stacks"]), nl=False)


@click.command()
@cluster_command
@click.argument("name")
@click.option("--once", is_flag=True, help="Print the table once and exit (for scripts).")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option("--live", is_flag=True,
              help="Also each process's own numbers (stage, step, samples/s, step and data-wait time, GPU memory), "
                   "read from its pod's metrics through the API server's pod proxy (needs get on pods/proxy).")
@output_option()
def top(kube: Kube, name: str, once: bool, interval: float, live: bool, output: str | None) -> None:
    """A refreshing per-rank table of a DDPJob (pods, phases, exit codes; the straggler in red)."""
    tty = sys.stdout.isatty()
    with CtrlC() as ctrl_c:
        while True:
            job = kube.get_job(name)
            pods = kube.pods(name)
            samples, notes = _live_samples(kube, job, pods) if live else (None, [])
            if output:
                data = {"job": name, "phase": views.phase_of(job), "progress": views.status_of(job).get("progress") or {},
                        "ranks": [r.as_dict() for r in views.rank_rows(job, pods)]}
                if samples is not None:
                    data["processes"] = [dict(zip(views.PROCESS_HEADERS, cells)) for cells, _ in
                                         views.process_rows(job, samples)]
                click.echo(views.dump(data, output), nl=False)
            else:
                screen = views.top_text(job, pods, now(), color=tty, samples=samples, notes=notes)
                click.echo(("\x1b[H\x1b[2J" if tty and not once else "") + screen, nl=False)
            if once or output or Phase.parse(views.status_of(job).get("phase")) in (Phase.SUCCEEDED, Phase.FAILED):
                return
            ctrl_c.sleep(interval)


def _live_samples(kube: Kube, job: dict[str, Any], pods: list[dict[str, Any]]) -> tuple[dict[int, Any], list[str]]:
    """({global rank: RankSample}, notes on pods not read) from the running pods of the current attempt."""
    from ddpjob_operator.decisions.samples import merge, parse_metrics
    from ddpjob_api.spec import from_manifest

    port = from_manifest(job).spec.metrics_port
    parts, notes = [], []
    for row in views.rank_rows(job, pods):
        if row.phase != Phase.RUNNING:
            continue
        if kube.simulated_node(row.node):
            notes.append(f"rank {row.rank}: on simulated (kwok) node {row.node}, whose pods serve nothing")
            continue
        try:
            part = parse_metrics(kube.pod_metrics(row.pod, port))
        except CliError as exc:
            notes.append(f"rank {row.rank}: no metrics ({exc})")
            continue
        except ValueError as exc:
            notes.append(f"rank {row.rank}: unreadable metrics ({exc})")
            continue
        for sample in part.values():
            sample.pod = row.pod
        parts.append(part)
    return merge(parts), notes


COMMANDS = (list_cmd, get, describe, wait, submit, delete, suspend, resume, logs, stacks, top)
