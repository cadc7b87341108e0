"""What a node says: its lines on stderr, and its termination message (kept by the kubelet after
the pod's log is gone): why it failed, or rank 0's result, which the operator reads into status."""
from __future__ import annotations

import json
import os
import sys
from contextlib import suppress

from ddpjob_api import contract

TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LIMIT = 4000  # characters; the kubelet truncates a termination message at 4096 bytes


def say(msg: str) -> None:
    print(f"[ddpjob-launch node {os.environ.get('NODE_RANK', '?')}] {msg}", file=sys.stderr, flush=True)


def write_termination(msg: str) -> None:
    with suppress(OSError), open(TERMINATION_LOG, "w") as f:  # OSError: not in a pod, or no termination log mounted
        f.write(msg[-TERMINATION_LIMIT:])


def rank_messages(status_dir: str, kind: str) -> list[str]:
    """What the ranks of this node recorded under `kind` (bad-config, failed), by file name."""
    if not os.path.isdir(status_dir):
        return []
    paths = [os.path.join(status_dir, n) for n in os.listdir(status_dir) if n.startswith(f"{kind}-rank-")]
    out = []
    # Oldest first: the rank that failed first is the likely cause, the others its casualties.
    for path in sorted(paths, key=lambda p: (os.stat(p).st_mtime_ns, p)):
        with open(path, errors="replace") as f:
            out.append(f.read().strip())
    return out


def recorded_error(path: str) -> list[str]:
    """The exception that torch.distributed.elastic's @record wrote to `path` (directly, or copied
    there by torchrun from the first failed worker): its traceback, else its message. Empty when
    nothing was recorded (an entrypoint without @record, a crash) or the file is not that JSON."""
    try:
        with open(path, errors="replace") as f:
            data = json.load(f)
        message = data["message"]
    except (OSError, ValueError, TypeError, KeyError):
        return []
    if isinstance(message, dict):  # torchrun's form: the traceback in extraInfo, else the message
        extra = message.get("extraInfo")
        detail = (extra.get("py_callstack") if isinstance(extra, dict) else None) or message.get("message")
        message = str(detail) if detail else ""
    return [message.strip()] if isinstance(message, str) and message.strip() else []


def failure_message(code: int, failed: list[str], *, step: int | None = None,
                    limit: int = TERMINATION_LIMIT) -> str | None:
    """The termination message of a node whose training exited with `code`: the first line says
    so, with the newest `step` its ranks finished (contract.failure_head), the rest is the end of
    the first failed rank's traceback (its last line names the error),
    cut to `limit` characters — the kubelet keeps 4 KiB, and the start of a traceback matters least.
    None when no rank recorded why (a user's script without @record, a crash, torchrun itself): the pod's
    terminationMessagePolicy (FallbackToLogsOnError) then has the kubelet keep the log's tail."""
    if not failed:
        return None
    head = contract.failure_head(code, step)
    detail = failed[0]
    room = limit - len(head) - len("\n...")
    return head + "\n" + (detail if len(detail) <= room else "..." + detail[-room:])


def name_the_run(path: str, run_id: str) -> None:
    """Put the job's MLflow run (node 0's launcher resolved it; every rank's tracker resumes it)
    into rank 0's result where the result does not name it: a user's script writes no result, and
    the built-in trainer's tracker opens the run on its own thread, so a short attempt (a worker
    restarted in place near the end) can finish before its open does. Whole or not at all."""
    try:
        with open(path) as f:
            result = json.load(f)
    except FileNotFoundError:
        result = {}
    except (OSError, ValueError):
        return  # not ours to rewrite: reported as it is
    if not isinstance(result, dict) or result.get(contract.RESULT_MLFLOW_RUN_ID):
        return
    with open(f"{path}.part", "w") as f:
        json.dump({**result, contract.RESULT_MLFLOW_RUN_ID: run_id}, f, indent=1)
    os.replace(f"{path}.part", path)


def report_result(path: str) -> None:
    """Rank 0's result (final eval, steps, resumed-from step) as the termination message: the run's
    last numbers come after the last metrics scrape, and the operator reads them from there into
    status.result. Other nodes, and user scripts that write no result, leave it empty."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return
    if text.strip() and len(text) <= TERMINATION_LIMIT:
        write_termination(text.strip())
