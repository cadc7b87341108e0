"""Per-step fault tolerance (spec.faultTolerance, contract.ENV_FT_*): torchft's Manager around the loop.

Each pod is one replica group, a torchrun world of its own: DDP averages gradients over the
group's ranks as in any job, then `average` averages them over the groups of the current quorum
(torchft's reconfigurable process group: gloo on CPU, NCCL on GPU), and the optimizer step is
committed only when the quorum agrees (OptimizerWrapper). A group that joins late, or replaces a
lost one, takes the whole training state (model, optimizer, LR schedule, TrainState) from a live
peer at its first quorum, over torchft's HTTP checkpoint transport: no checkpoint read.

torchft is imported only here and only in a per-step job (the trainer extra's, on CPython 3.11 x86_64); without it the
job is refused by name. torchft's own DistributedDataParallel is not used: its comm hook crashes the
surviving group on CPU in torchft 0.2.0 (ddp.py `assert fut._fut`); one allreduce per parameter
does the same averaging.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping
from urllib.parse import urlsplit

from ddpjob_api import contract
from ddpjob_api.names import lighthouse_id_url
from .errors import ConfigError

if TYPE_CHECKING:  # torch is imported where used: the launcher's telemetry reads job_rank without it
    import torch

# The greppable lines every group's rank 0 logs (tests and the bench read them):
#   ft: step N participants P weights H quorum Q   at each log step (Q: its quorum's folded id)
#   ft: joined at step N from a peer, weights H   right after this group took a peer's state
LINE = "ft:"


@dataclass(frozen=True)
class FtEnv:
    """What the pod's env says about per-step mode (envvars.per_step_env); None from `from_env`
    when the job is not per-step."""

    lighthouse: str
    host: str            # where the other groups reach this one (its store, manager, checkpoints)
    group: int           # this replica group's index (the job's NODE_RANK)
    groups: int          # how many there are (NNODES)
    min_replicas: int
    timeout_seconds: float
    quorum_timeout_seconds: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FtEnv | None:
        lighthouse = env.get(contract.ENV_FT_LIGHTHOUSE)
        if not lighthouse:
            return None
        try:
            return cls(lighthouse=lighthouse, host=env.get(contract.ENV_FT_HOST) or "127.0.0.1",
                       group=int(env.get(contract.ENV_NODE_RANK, "0")), groups=int(env.get(contract.ENV_NNODES, "1")),
                       min_replicas=int(env.get(contract.ENV_FT_MIN_REPLICAS, "1")),
                       timeout_seconds=float(env.get(contract.ENV_FT_TIMEOUT, "3")),
                       quorum_timeout_seconds=float(env.get(contract.ENV_FT_QUORUM_TIMEOUT, "60")))
        except ValueError as exc:
            raise ConfigError(f"per-step fault tolerance ({contract.ENV_FT_LIGHTHOUSE} set): bad "
                              f"DDPJOB_FT_*/NODE_RANK/NNODES value: {exc}") from exc

    def data_split(self, *, rank: int, world_size: int) -> tuple[int, int]:
        """(data rank, data world): the training set split over every group's ranks, so that the
        groups train on different shards; while a group is lost its shard is skipped."""
        return self.group * world_size + rank, self.groups * world_size


def job_rank(env: Mapping[str, str] = os.environ) -> int | None:
    """This process's rank in a per-step job, across its groups (torchrun's RANK is the pod's): what
    its telemetry is labelled with, as the launcher labels the pod's ranks; None outside per-step mode."""
    fe = FtEnv.from_env(env)
    if fe is None:
        return None
    return fe.data_split(rank=int(env.get(contract.TORCHRUN_RANK, "0")),
                         world_size=int(env.get(contract.TORCHRUN_LOCAL_WORLD_SIZE, "1")))[0]


def reporting_group(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this pod's rank 0 reports for the job (its result, its MLflow run): any pod's outside
    per-step mode (the job is one torchrun world: only its rank 0 is a pod's rank 0), group 0's in
    it, where every pod is a world with a rank 0 of its own and the others would report each step
    again (a replacement of group 0 reports in its place)."""
    fe = FtEnv.from_env(env)
    return fe is None or fe.group == 0


def import_torchft() -> Any:
    """torchft, or a ConfigError naming it (an extra, with wheels for CPython 3.11 on x86_64 only)."""
    # torchft's Rust side logs every quorum and commit at INFO (five lines a step): warnings only,
    # unless the job's env says otherwise. Read when the extension starts logging.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
        import torchft.checkpointing.http_transport
        import torchft.optim
    except ImportError as exc:
        raise ConfigError(f"spec.faultTolerance needs torchft, which this environment lacks ({exc}): "
                          f"pip install 'ddpjob[trainer]' (torchft 0.2.0 ships wheels for CPython 3.11 on x86_64 only; "
                          f"this is Python {sys.version_info.major}.{sys.version_info.minor})") from exc
    return torchft


# Between two tries of a failed quorum (FaultTolerance._quorum): a Lighthouse being recreated
# refuses connections for seconds.
QUORUM_RETRY_PAUSE = 0.5


def quorum_try_seconds(fe: FtEnv) -> float:
    """How long one try of a quorum may take before it is asked again: with the Lighthouse up, a
    quorum comes within its join timeout (timeoutSeconds) of the last group's request; ten seconds
    at least, for a loaded machine."""
    return max(10.0, 3 * fe.timeout_seconds)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def weights_hash(model: torch.nn.Module) -> str:
    """A short SHA-1 of the model's parameters (in order, as bytes): equal across groups in sync."""
    import torch

    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def folded_quorum_id(incarnation: str, quorum_id: int) -> int:
    """The quorum id torchft compares and names its store keys by (`torchft/<id>/`): the
    Lighthouse's, which a recreated Lighthouse starts again from 1, made one of this incarnation of
    it (a positive int below 2**62, equal on every rank that got the same quorum from the same one)."""
    digest = hashlib.sha256(f"{incarnation}/{quorum_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


class _Folded:
    """torchft's QuorumResult with the folded id (every other field as torchft made it)."""

    def __init__(self, quorum: Any, quorum_id: int) -> None:
        self._quorum, self.quorum_id = quorum, quorum_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)


class LighthouseId:
    """Reads the id of the Lighthouse's current incarnation (ddpjob_trainer.lighthouse) over one
    kept-alive HTTP connection, opened again once when it fails (a recreated Lighthouse)."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        self.url, self._host, self._port, self._timeout = url, parts.hostname or "", parts.port, timeout
        self._conn: http.client.HTTPConnection | None = None

    def read(self) -> str:
        last: Exception | None = None
        for _ in range(2):
            try:
                if self._conn is None:
                    self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
                self._conn.request("GET", "/")
                resp = self._conn.getresponse()
                body = resp.read().decode()
                if resp.status == 200 and body:
                    return body
                last = RuntimeError(f"HTTP {resp.status}")
            except (OSError, http.client.HTTPException) as exc:
                last = exc
            self.close()
        raise RuntimeError(f"the Lighthouse's id at {self.url} did not answer: {last}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class IncarnationClient:
    """torchft's ManagerClient, whose quorums come with the Lighthouse's id folded into their id
    (folded_quorum_id): read right after the quorum, so that a quorum of a recreated Lighthouse never
    has the id of one of its predecessor's, and every group reconfigures its process group for it,
    also one that did not notice the loss (torchft reconfigures only when the id changes). A quorum
    whose id cannot be read fails like one the Lighthouse did not answer (FaultTolerance._quorum asks
    again). Everything else is the ManagerClient's."""

    def __init__(self, client: Any, lighthouse_id: Callable[[], str]) -> None:
        self._client, self._lighthouse_id = client, lighthouse_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> _Folded:
        quorum = self._client._quorum(*args, **kwargs)
        return _Folded(quorum, folded_quorum_id(self._lighthouse_id(), quorum.quorum_id))


class FaultTolerance:
    """One rank's torchft Manager and optimizer wrapper; every method is called by every rank of the group."""

    def __init__(self, fe: FtEnv, *, rank: int, world_size: int, device: torch.device, optimizer: torch.optim.Optimizer,
                 state_dict: Callable[[], dict[str, Any]], load_state_dict: Callable[[dict[str, Any]], None],
                 log: Callable[[str], None] = print, env: Mapping[str, str] = os.environ) -> None:
        torchft = import_torchft()
        from torchft.checkpointing.http_transport import HTTPTransport

        host = _url_host(fe.host)

        class _Transport(HTTPTransport):
            """torchft's HTTP checkpoint server, advertised at the group's address: the default,
            socket.gethostname(), is a pod's short name, which no other pod resolves."""

            def address(self) -> str:
                return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        self.fe, self._log = fe, log
        timeout = timedelta(seconds=fe.timeout_seconds)
        # torchft's DDP example: NCCL in a child process on GPUs (a hung NCCL call can be killed), gloo on CPU.
        pg = torchft.ProcessGroupBabyNCCL(timeout=timeout) if device.type == "cuda" else torchft.ProcessGroupGloo(
            timeout=timeout)
        self._load = load_state_dict
        self.healed = False
        self._started = False
        self.manager = torchft.Manager(
            pg=pg, min_replica_size=fe.min_replicas, load_state_dict=self._healed, state_dict=state_dict,
            replica_id=f"group{fe.group}", lighthouse_addr=fe.lighthouse, rank=rank, world_size=world_size,
            # The group's torchrun store (the worker store torchrun started in this pod), reached at the
            # group's address: the quorum hands it to the other groups for the cross-group process group.
            store_addr=fe.host, store_port=int(env[contract.ENV_MASTER_PORT]), hostname=host,
            timeout=timeout, quorum_timeout=timedelta(seconds=fe.quorum_timeout_seconds),
            use_async_quorum=False, checkpoint_transport=_Transport(timeout=timeout, num_chunks=0))
        self._lighthouse_id = LighthouseId(lighthouse_id_url(fe.lighthouse), fe.timeout_seconds)
        self.manager._client = IncarnationClient(self.manager._client, self._lighthouse_id.read)
        self.optimizer = torchft.optim.OptimizerWrapper(self.manager, optimizer)

    def _healed(self, state: dict[str, Any]) -> None:
        self._load(state)
        self.healed = True

    def start_step(self) -> bool:
        """The step's quorum, then the gradients cleared; True when this group took a live peer's
        state in it."""
        self.healed = False
        if self._started:
            self._quorum()
        else:
            self._first_quorum()
            self._started = True
        self.optimizer.optim.zero_grad(set_to_none=True)
        return self.healed

    def _quorum(self) -> None:
        """One quorum, asked again while asking fails, until quorumTimeoutSeconds have passed.
        A Lighthouse lost mid-request (its pod deleted, its node gone) takes the request with it:
        torchft's call then hangs for its whole timeout and fails the step, every group's at once,
        though the operator has a new Lighthouse serving at the same name within seconds. Each try
        waits at most quorum_try_seconds; the groups' heartbeats reconnect to the new one by
        themselves, and the next try is served by it."""
        deadline = time.monotonic() + self.fe.quorum_timeout_seconds
        while True:
            left = deadline - time.monotonic()
            try:
                self.manager.start_quorum(timeout=timedelta(seconds=max(0.1, min(left, quorum_try_seconds(self.fe)))))
                return
            except Exception as exc:  # torchft raises the Rust client's errors as RuntimeError/TimeoutError
                if time.monotonic() >= deadline:
                    raise
                self._log(f"{LINE} quorum failed ({type(exc).__name__}: {str(exc)[:200]}): asking the Lighthouse "
                          f"again for {deadline - time.monotonic():.0f} s more (spec.faultTolerance.quorumTimeoutSeconds)")
                # torchft 0.2.0 (pinned) re-raises the failed quorum at the next start_quorum: forget it.
                self.manager._quorum_future = None
                time.sleep(QUORUM_RETRY_PAUSE)

    def _first_quorum(self) -> None:
        """The first step's quorum, with every group of the job: the groups start at different times
        (images pulled, torch imported), and with minReplicas below their number the first to come
        would otherwise train alone, its peers joining later, or after it ended. Asked again (no step
        taken in between) until every group is in it or quorumTimeoutSeconds passed; a replacement
        group finds its peers stepping and is in their next quorum at once. The last one asked is
        the first step's. Counted in tries, not read off a clock: every rank of the group must ask
        the same number of times (each quorum is collective within the group)."""
        pause = 0.1
        tries = max(1, int(self.fe.quorum_timeout_seconds / pause))
        self._quorum()
        while self.manager.num_participants() < self.fe.groups and tries:
            tries -= 1
            time.sleep(pause)
            self._quorum()

    def average(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average the gradients over the quorum's groups (DDP already averaged them within this one)."""
        works = [self.manager.allreduce(p.grad) for p in params if p.grad is not None]
        for w in works:
            w.wait()

    def commit(self) -> bool:
        """The optimizer step, taken only if every group of the quorum agrees; True when it was."""
        before = self.manager.current_step()
        self.optimizer.step()
        return self.manager.current_step() > before

    def step(self) -> int:
        """The committed step, the quorum's (a healed group's jumps to its peer's)."""
        return self.manager.current_step()

    def participants(self) -> int:
        return self.manager.num_participants()

    def quorum_id(self) -> int:
        """The id of the quorum whose process group the group uses (folded_quorum_id)."""
        return int(self.manager._quorum_id)

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints at this step: the first group of the
        step's quorum, one group a step (every rank of a group sees the same quorum). The others
        keep none: every group holds the same state, and two writing one step's directory would
        tear it. A group outside the quorum (healing) writes nothing."""
        return self.manager.participating_rank() == 0

    def resumed_at(self, step: int) -> None:
        """The Manager's step set to a checkpoint's (every group resumed from the newest one, after
        the job lost them all): the quorum's steps go on from there, and a group that resumed from
        an older one takes a peer's state at its first quorum, as a replacement does."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.fe.groups})

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        self._lighthouse_id.close()
