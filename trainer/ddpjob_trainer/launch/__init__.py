"""In-pod launcher: `python -m ddpjob_trainer.launch [opts] -- [CMD ...]` (contract.LAUNCHER).

What Kubeflow users otherwise bolt on with init containers, done in-process:
1. non-zero node ranks wait (with a deadline) until the master's DNS name resolves and
   its port accepts, so a worker never dies because pod 0 is a second late;
2. one Prometheus endpoint per pod serves every local rank (a shared multiprocess dir);
3. CMD (default: `torchrun -m ddpjob_trainer`, configured by the PET_* env) runs; the exit code
   is 78 when any rank failed on bad configuration (preflight.py checks the built-in trainer's
   configuration and the image first), and the termination message says why it failed or what
   rank 0's result was (report.py); the job's MLflow run is found before torchrun (runs.py).

Stopping (a pod deletion sends SIGTERM; Ctrl-C sends SIGINT) is bounded: the handlers are
installed before anything else (as a container's PID 1 the launcher would otherwise *ignore*
SIGTERM until the kubelet's SIGKILL at the end of terminationGracePeriodSeconds; signals.py; the
operator's pods share their PID namespace, so that one arriving while Python starts, before any
handler, ends the launcher at once: builders/pods.share_process_namespace), every
process below the launcher (torchrun's agent and its workers, which torchrun puts in sessions of
their own, and any orphan re-parented to the launcher) gets SIGTERM, then SIGKILL after
`--stop-grace` seconds (DDPJOB_STOP_GRACE_SECONDS, which the operator derives from the pod's
terminationGracePeriodSeconds; default 5; procs.py). The ranks are told the grace they got (the
built-in trainer saves a last checkpoint in it when that fits: preempt.py). Exit code 128 + signal:
143 for SIGTERM, 130 for SIGINT. node.py runs one node's launch from start to end; exitguard/ is
put first on every child's PYTHONPATH.
"""

# What the local runner (cli/ddpjob_cli/local.py), the pod's launcher on the host, takes from the
# trainer: this surface, never the modules behind it (tests/unit/test_package_boundaries.py).
from ddpjob_trainer.errors import ConfigError
from ddpjob_trainer.launch.procs import become_subreaper, die_with_parent, stop_tree
from ddpjob_trainer.launch.report import rank_messages
from ddpjob_trainer.launch.signals import Stop, StopSignals, stop_grace_from_env


def check_trainer_config(trainer: dict) -> None:
    """Raise ConfigError naming the field the built-in trainer would refuse in spec.trainer. Its
    parser is imported here, not above: it needs the trainer extra, which `ddpjob run --local`
    asks for by name when it is missing."""
    from ddpjob_trainer.config import parse_config

    parse_config(trainer)


__all__ = ["ConfigError", "Stop", "StopSignals", "become_subreaper", "check_trainer_config", "die_with_parent",
           "rank_messages", "stop_grace_from_env", "stop_tree"]
