"""`python -m ddpjob_trainer`: the built-in trainer (under torchrun, or as one process)."""
from __future__ import annotations

import logging
import os
import sys
import traceback
from contextlib import suppress

from ddpjob_api import contract
from .errors import EXIT_BAD_CONFIG, EXIT_TRAINING_FAILED, ConfigError, PeerStopped


def _record(kind: str, msg: str) -> None:
    """Tell the launcher why this rank failed: `bad-config` (nobody retries) or `failed` (its
    traceback becomes the pod's termination message, which outlives the pod's log)."""
    status_dir = os.environ.get(contract.ENV_STATUS_DIR)
    if status_dir:
        os.makedirs(status_dir, exist_ok=True)
        with open(os.path.join(status_dir, f"{kind}-rank-{os.environ.get('RANK', '0')}.txt"), "w") as f:
            f.write(msg + "\n")


def _failed(exc: BaseException, rank: str) -> int:
    """Say and record why this rank failed; the exit code it owes."""
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM on a tracking rank (reporting.Terminated)
        return 128 + getattr(exc, "signum", 2)
    bad_config = isinstance(exc, ConfigError)
    if bad_config:
        said = recorded = f"bad configuration: {exc}"
    elif isinstance(exc, PeerStopped):  # not this rank's fault: its message says it all
        said = recorded = str(exc)
    else:  # any other failure may succeed on retry
        tb = "".join(traceback.format_exception(exc))
        said, recorded = f"training failed:\n{tb}", f"rank {rank} failed:\n{tb}"
    print(f"[rank {rank}] {said}", file=sys.stderr, flush=True)
    _record("bad-config" if bad_config else "failed", recorded)
    return EXIT_BAD_CONFIG if bad_config else EXIT_TRAINING_FAILED


def main() -> int:
    """Parse config, set up the process group, train; map failures to exit codes. A rank that
    fails once its group is up does not return: it exits with its code, the group's teardown
    bounded (see below)."""
    from .config import config_from_env
    from .debug import Knobs
    from .faulttolerance import reporting_group
    from .dist import FAILED_TEARDOWN_SECONDS, process_group, teardown_within
    from .loop import train
    from .reporting import make_reporter
    from .telemetry import Telemetry

    rank = os.environ.get(contract.TORCHRUN_RANK, "0")
    try:
        cfg = config_from_env()
        telemetry = Telemetry.from_env()
        telemetry.set_stage("process_group_init")
        Knobs.from_env(rank=int(rank)).at_stage("process_group_init")
        debug = contract.debug_dir(cfg.checkpoint.dir, os.environ.get(contract.ENV_ATTEMPT, "0")) if cfg.checkpoint.dir else None
        with process_group(timeout_seconds=cfg.timeout_seconds, io_group=bool(cfg.checkpoint.dir),
                           debug_dir=debug) as ctx:
            log = None
            try:
                import torch

                # A per-step job's other groups log to their console only: one group's rank 0 tracks the run.
                log = make_reporter(rank=ctx.rank, mlflow=cfg.mlflow if reporting_group() else None, telemetry=telemetry,
                                    checkpoint_dir=cfg.checkpoint.dir, torch_mod=torch, device=ctx.device)
                train(cfg, ctx, log=log, telemetry=telemetry,
                      result_path=os.environ.get(contract.ENV_RESULT_FILE))
            except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - recorded as the rank's failure
                # Recorded before anything that can block: with a peer mid-collective the group's
                # teardown can hang until the watchdog fires, and the peers failing meanwhile (its
                # casualties) would be recorded first, taken for the cause.
                code = _failed(exc, rank)
                if log is not None:
                    log.close(status="KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
                if not teardown_within(FAILED_TEARDOWN_SECONDS):
                    print(f"[rank {rank}] process group teardown still blocked after {FAILED_TEARDOWN_SECONDS:.0f}s "
                          "(a peer mid-collective); exiting without it", file=sys.stderr, flush=True)
                exit_now(code)
            log.close(status="FINISHED")
        return 0
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - recorded as the rank's failure
        return _failed(exc, rank)


def exit_now(code: int) -> None:
    """End the rank's process without interpreter and C++ teardown. With torch's CPU build a
    rank now and then aborts there, after its work is done ("terminate called without an active
    exception", SIGABRT: about 1 run in 12 of a 3-node job on a loaded 2-core machine), and
    torchrun then fails the whole node. Everything a run owes is written by now (checkpoints and
    the result file atomically, the reporter closed); only buffered output needs flushing."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # closed or gone: nothing more to lose
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
