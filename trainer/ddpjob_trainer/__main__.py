"""`python -m ddpjob_trainer`: the built-in trainer (under torchrun, or as one process)."""
from __future__ import annotations

import logging
import os
import sys
import traceback

from . import contract
from .errors import EXIT_BAD_CONFIG, EXIT_TRAINING_FAILED, ConfigError


def _record(kind: str, msg: str) -> None:
    """Tell the launcher why this rank failed: `bad-config` (nobody retries) or `failed` (its
    traceback becomes the pod's termination message, which outlives the pod's log)."""
    status_dir = os.environ.get(contract.ENV_STATUS_DIR)
    if status_dir:
        os.makedirs(status_dir, exist_ok=True)
        with open(os.path.join(status_dir, f"{kind}-rank-{os.environ.get('RANK', '0')}.txt"), "w") as f:
            f.write(msg + "\n")


def main() -> int:
    """Parse config, set up the process group, train; map failures to exit codes."""
    from .config import config_from_env
    from .debug import Knobs
    from .dist import process_group
    from .loop import train
    from .reporting import make_reporter
    from .telemetry import Telemetry

    rank = os.environ.get("RANK", "0")
    try:
        cfg = config_from_env()
        telemetry = Telemetry.from_env()
        telemetry.set_stage("process_group_init")
        Knobs.from_env(rank=int(rank)).at_stage("process_group_init")
        with process_group(timeout_seconds=cfg.timeout_seconds, io_group=bool(cfg.checkpoint.dir)) as ctx:
            log = make_reporter(rank=ctx.rank, mlflow=cfg.mlflow)
            status = "FAILED"
            try:
                train(cfg, ctx, log=log, telemetry=telemetry,
                      result_path=os.environ.get(contract.ENV_RESULT_FILE))
                status = "FINISHED"
            finally:
                log.close(status=status)
        return 0
    except ConfigError as exc:
        msg = f"bad configuration: {exc}"
        print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)
        _record("bad-config", msg)
        return EXIT_BAD_CONFIG
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - any other failure may succeed on retry
        tb = traceback.format_exc()
        print(f"[rank {rank}] training failed:\n{tb}", file=sys.stderr, flush=True)
        _record("failed", f"rank {rank} failed:\n{tb}")
        return EXIT_TRAINING_FAILED


def exit_now(code: int) -> None:
    """End the rank's process without interpreter and C++ teardown. With torch's CPU build a
    rank now and then aborts there, after its work is done ("terminate called without an active
    exception", SIGABRT: about 1 run in 12 of a 3-node job on a loaded 2-core machine), and
    torchrun then fails the whole node. Everything a run owes is written by now (checkpoints and
    the result file atomically, the reporter closed); only buffered output needs flushing."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or gone: nothing more to lose
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
